"""The sampler as a traceable function, for use inside a larger compiled program.

`generate` validates and pads prompts on the host and runs its own jitted pieces; `sample` is the
same prefill + `while_loop` decode with no host step, so the RL iteration can compile sampling,
verification and the update into one program. Prompts must already be left-padded to a fixed
(bucketed) width; `SampleControls` is static (hashable) and picks the compiled variant.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from rljax.models import ModelConfig, unstack_layers
from rljax.sampling.filters import make_filters
from rljax.sampling.sampler import (SampleResult, _decode_phases, _prefill, _result, _Spec,
                                    bucket_length)


@dataclasses.dataclass(frozen=True)
class SampleControls:
    """Static sampling settings: lengths, group size, filters and stop conditions."""

    max_new_tokens: int
    num_samples: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = False
    eos_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    pad_id: int = 0

    def greedy_version(self, num_samples: int = 1) -> SampleControls:
        """The same limits with greedy decoding (e.g. ReMax's baseline rollout)."""
        return dataclasses.replace(self, greedy=True, num_samples=num_samples)

    def spec(self) -> _Spec:
        return _Spec(filters=make_filters(self.temperature, self.top_k, self.top_p, self.min_p, self.greedy),
                     eos_ids=tuple(self.eos_ids), stop_sequences=tuple(map(tuple, self.stop_sequences)),
                     pad_id=self.pad_id)


def sample(cfg: ModelConfig, params, prompt_tokens_bt, prompt_mask_bt, key, controls: SampleControls
           ) -> SampleResult:
    """Traceable `generate`: B left-padded prompts -> B * n completions (rows prompt-major)."""
    scalars = (np.float32(controls.temperature or 1.0), np.float32(controls.top_p), np.float32(controls.min_p))
    spec = controls.spec()
    params = unstack_layers(params)  # once, for the prefill and every decode phase
    state = _prefill(cfg, params, prompt_tokens_bt, prompt_mask_bt.astype(bool), key,
                     jnp.int32(controls.max_new_tokens), scalars, spec=spec, num_samples=controls.num_samples,
                     new_bucket=bucket_length(controls.max_new_tokens))
    state = _decode_phases(cfg, params, state, spec=spec,
                           new_bucket=bucket_length(controls.max_new_tokens),
                           max_new_tokens=controls.max_new_tokens)
    return _result(state, width=controls.max_new_tokens)
