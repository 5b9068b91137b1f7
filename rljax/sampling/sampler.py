"""The host API: `generate` (a whole batch at once) and `stream` (tokens as they are drawn).

Both validate the prompts on the host, pad them, and run the jitted pieces of
`rljax.sampling.decode` (prefill, then one `while_loop` decode per cache width; see its
docstring for the algorithm, the log-probs and the decode phases). The sampling controls are one
`SampleControls`.

Buckets. The prompt length P is padded (on the left) to `bucket_length(P)` and the decode buffers
are sized `bucket_length(max_new_tokens)`, with `bucket_length(n)` = the next power of two >= max(n,
16). `max_new_tokens` itself is a traced scalar, so a run compiles once per (batch, num_samples,
prompt bucket, new-token bucket, `SampleControls.static()`), never per exact length.

Meshes. When the params live on a multi-device mesh of this process (`rljax.sharding.shard_params`
or a replicated `device_put`), `generate` and `stream` split the prompt rows over the mesh's batch
axes (data x fsdp, else data, else fsdp; the first that divides the batch), so each device prefills
and decodes its own rows. The tokens are the same as on one device (the PRNG is partitionable).
Across processes, or on a mesh with Explicit axes, the rows stay replicated.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from rljax.errors import DataError
from rljax.models import ModelConfig, unstack_layers
from rljax.sampling import continuous as C
from rljax.sampling import decode as D
from rljax.sampling.controls import SampleControls, StaticControls
from rljax.sharding.rules import batch_axes
from rljax.tokenizers import check_token_ids

_prefill_jit = jax.jit(D.prefill, static_argnames=("cfg", "spec", "num_samples", "new_bucket"))
_decode_jit = jax.jit(D.decode, static_argnames=("cfg", "spec"), donate_argnames=("state",))
_widen_jit = jax.jit(D.widen, static_argnames=("extra",))  # new buffers: nothing to donate
_result_jit = jax.jit(D.to_result, static_argnames=("width",))
_unstack_jit = jax.jit(unstack_layers)
_continuous_jit = jax.jit(C.sample_continuous, static_argnames=("cfg", "spec", "layout"))


def pad_prompts(cfg: ModelConfig, prompt_tokens_bt, prompt_mask_bt=None, pad_id: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    """Checks prompts on the host and left-pads them to their bucket: int32 tokens, bool mask."""
    tokens = np.asarray(prompt_tokens_bt)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"prompt tokens must be a [batch, time] integer array, got {tokens.dtype}{list(tokens.shape)}")
    mask = np.ones(tokens.shape, bool) if prompt_mask_bt is None else np.asarray(prompt_mask_bt).astype(bool)
    if mask.shape != tokens.shape:
        raise DataError(f"prompt mask shape {list(mask.shape)} != prompt tokens shape {list(tokens.shape)}")
    if not mask.any(axis=1).all():
        raise DataError("every prompt needs at least one real token (a mask row is all False)")
    check_token_ids(tokens[mask], cfg.vocab_size, "prompt token id")
    p = tokens.shape[1]
    pad = D.bucket_length(p) - p
    tokens = np.pad(np.where(mask, tokens, pad_id), ((0, 0), (pad, 0)), constant_values=pad_id)
    mask = np.pad(mask, ((0, 0), (pad, 0)))
    return tokens.astype(np.int32), mask


def rows_sharding(params, rows: int) -> NamedSharding | None:
    """How `generate` splits `rows` prompts: over the batch axes of the params' mesh (see the module
    docstring), or None (keep them where jit puts them) for one device, a mesh spanning processes,
    a mesh with Explicit axes, or a batch no batch axis divides."""
    sharding = next((x.sharding for x in jax.tree.leaves(params)
                     if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
    if (sharding is None or sharding.mesh.size == 1 or not sharding.is_fully_addressable
            or any(t != AxisType.Auto for t in sharding.mesh.axis_types)):
        return None
    axes = batch_axes(sharding.mesh, rows)
    return None if axes is None else NamedSharding(sharding.mesh, P(axes))


def start(cfg: ModelConfig, params, prompt_tokens_bt, prompt_mask_bt=None, *, key: jax.Array,
          controls: SampleControls) -> tuple[D.DecodeState, StaticControls, Any]:
    """Everything before decode: checks and pads the prompts, splits the per-layer weights and runs
    the jitted prefill. Returns (state, static controls, per-layer params) for the decode calls."""
    spec = controls.static()
    tokens, mask = pad_prompts(cfg, prompt_tokens_bt, prompt_mask_bt, spec.pad_id)
    split = rows_sharding(params, tokens.shape[0])
    if split is not None:  # each device prefills and decodes its own rows
        tokens, mask = jax.device_put((tokens, mask), split)
    # Per-layer weights, split once per call: each jitted phase would otherwise copy them out of the
    # stacked arrays again.
    params = _unstack_jit(params)
    state = _prefill_jit(cfg, params, tokens, mask, key, np.int32(controls.max_new_tokens), controls.scalars(),
                         spec=spec, num_samples=controls.num_samples,
                         new_bucket=D.bucket_length(controls.max_new_tokens))
    return state, spec, params


def generate(cfg: ModelConfig, params, prompt_tokens_bt, prompt_mask_bt=None, *, key: jax.Array,
             controls: SampleControls) -> D.SampleResult:
    """Samples `controls.num_samples` completions per prompt with a KV cache.

    `prompt_tokens_bt` [B, T] int and `prompt_mask_bt` [B, T] bool (True on real tokens; prompts
    are usually left-padded, any padding works). The same `key` and inputs give the same tokens.
    Returns a `SampleResult` with B * num_samples rows, prompt-major.
    """
    if controls.scheduler == "continuous":
        return _generate_continuous(cfg, params, prompt_tokens_bt, prompt_mask_bt, key=key, controls=controls)
    state, spec, params = start(cfg, params, prompt_tokens_bt, prompt_mask_bt, key=key, controls=controls)
    state = D.decode_phases(cfg, params, state, spec=spec, new_bucket=D.bucket_length(controls.max_new_tokens),
                            max_new_tokens=controls.max_new_tokens, decode=_decode_jit, widen=_widen_jit)
    return _result_jit(state, width=controls.max_new_tokens)


def _generate_continuous(cfg: ModelConfig, params, prompt_tokens_bt, prompt_mask_bt, *, key: jax.Array,
                         controls: SampleControls) -> D.SampleResult:
    """`generate` with the continuous scheduler: the prompt count is padded to a power of two (the
    real row count is traced, so any count within the bucket reuses one compiled loop)."""
    spec = controls.static()
    tokens, mask = pad_prompts(cfg, prompt_tokens_bt, prompt_mask_bt, spec.pad_id)
    b = tokens.shape[0]
    bucket = 1 << max(b - 1, 0).bit_length()
    tokens = np.pad(tokens, ((0, bucket - b), (0, 0)), constant_values=spec.pad_id)
    mask = np.pad(mask, ((0, bucket - b), (0, 0)))
    mask[b:, -1] = True  # padding prompts: one token each, never decoded
    layout = C.plan_layout(controls, bucket, tokens.shape[1])
    result = _continuous_jit(cfg, params, tokens, mask, key, np.int32(controls.max_new_tokens), controls.scalars(),
                             np.int32(b * controls.num_samples), spec=spec, layout=layout)
    rows, width = b * controls.num_samples, controls.max_new_tokens
    host = jax.device_get(result)  # trimmed on the host: slicing on device would compile per row count
    return jax.device_put(C.trim(host, rows, width))


def stream(cfg: ModelConfig, params, prompt_tokens_bt, prompt_mask_bt=None, *, key: jax.Array,
           controls: SampleControls, chunk: int = 8) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Like `generate`, but yields (tokens, mask) host arrays [B * n, <= chunk] as they are drawn.

    The same compiled prefill and decode run; decode stops every `chunk` tokens (a traced limit, so
    no recompilation) and resumes on the donated state. Same key, same tokens as `generate`.
    With `controls.scheduler == "continuous"` the rows are decoded in slots as `generate` does and
    come back as one chunk, when the last row ends.
    """
    if controls.scheduler == "continuous":
        res = jax.device_get(generate(cfg, params, prompt_tokens_bt, prompt_mask_bt, key=key, controls=controls))
        yield res.tokens, res.mask
        return
    max_new_tokens = controls.max_new_tokens
    state, spec, params = start(cfg, params, prompt_tokens_bt, prompt_mask_bt, key=key, controls=controls)
    widths = iter(D.phase_widths(D.bucket_length(max_new_tokens), max_new_tokens))
    width = next(widths)
    done = 0
    while True:
        step, tokens, length, all_done = jax.device_get(
            (state.step, state.tokens_bn, state.length_b, jnp.all(state.done_b)))
        if step > done:
            yield tokens[:, done:step], np.arange(done, step)[None, :] < length[:, None]
            done = int(step)
        if all_done or done >= max_new_tokens:
            return
        if done >= width:  # this phase's cache is full: the next phase
            previous, width = width, next(widths)
            state = _widen_jit(state, width - previous)
        limit = min(done + chunk, max_new_tokens, width)
        state = _decode_jit(cfg, params, state, np.int32(limit), spec=spec)
