"""The sampler as a traceable function, for use inside a larger compiled program.

`generate` validates and pads prompts on the host and runs its own jitted pieces; `sample` is the
same prefill + `while_loop` decode (`rljax.sampling.decode`) with no host step, so the RL
iteration can compile sampling, verification and the update into one program. Prompts must
already be left-padded to a fixed (bucketed) width. `SampleControls` is hashable: pass it as a
static argument (or close over it); its `static()` half picks the compiled variant.
"""

from __future__ import annotations

import jax.numpy as jnp

from rljax.models import ModelConfig
from rljax.models.context_parallel import spread_rows
from rljax.sampling import continuous as C
from rljax.sampling import decode as D
from rljax.sampling.controls import SampleControls
from rljax.sampling.fp8 import sampler_params
from rljax.sampling.row_shards import sample_pools


def sample(cfg: ModelConfig, params, prompt_tokens_bt, prompt_mask_bt, key, controls: SampleControls
           ) -> D.SampleResult:
    """Traceable `generate`: B left-padded prompts -> B * n completions (rows prompt-major), with
    the scheduler `controls.scheduler` names. `controls.weight_dtype` "fp8" ("fp8_w8a8") samples
    with the FP8 round trip (the FP8 copy) of the layer weights (`rljax.sampling.fp8`), taken here
    from the params given, so every weight sync refreshes it."""
    spec = controls.static()
    params = sampler_params(params, controls.weight_dtype)
    prompt_tokens_bt, prompt_mask_bt = spread_rows((prompt_tokens_bt, prompt_mask_bt))  # a context group's rows
    new_bucket = D.bucket_length(controls.max_new_tokens)
    if controls.scheduler == "continuous":  # one slot pool per device of the row axes (`row_shards`)
        b = prompt_tokens_bt.shape[0]
        result = sample_pools(cfg, params, prompt_tokens_bt, prompt_mask_bt, key, controls)
        return C.trim(result, b * controls.num_samples, controls.max_new_tokens)
    result = D.sample_static(cfg, params, prompt_tokens_bt, prompt_mask_bt.astype(bool), key,
                             jnp.int32(controls.max_new_tokens), controls.scalars(), None, spec=spec,
                             num_samples=controls.num_samples, new_bucket=new_bucket)
    return C.trim(result, prompt_tokens_bt.shape[0] * controls.num_samples, controls.max_new_tokens)
