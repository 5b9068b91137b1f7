"""The host API: `generate` (a whole batch at once) and `stream` (tokens as they are drawn).

Both validate the prompts on the host and pad them. `generate` then runs ONE compiled program
per configuration, whatever the scheduler: `rljax.sampling.decode.sample_static` (prefill, the
decode phases and the result; see its module docstring for the algorithm, the log-probs and the
phases) or `rljax.sampling.continuous.sample_continuous` (`rljax.sampling.paged.sample_paged` with
`kv_layout="paged"`). `stream` runs the static pieces as separate jitted calls, so it can hand
tokens back between them. The sampling controls are one `SampleControls`.

Buckets. The prompt length P is padded (on the left) to `bucket_length(P)`, the decode buffers
are sized `bucket_length(max_new_tokens)`, with `bucket_length(n)` = the next power of two >= max(n,
16), and `generate` pads the prompt count to a power of two (padding prompts are one token each
and their rows never draw; the static loop still computes them, the continuous one never admits
them). `max_new_tokens` and the real row count are traced, so a run compiles once per (prompt
bucket, num_samples, prompt-length bucket, new-token bucket, `SampleControls.static()`), never per
exact batch or length. The result is trimmed to the real rows and `max_new_tokens` columns on the
host (on a mesh, by a small jitted slice per width, so the rows stay split).

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

from rljax.errors import DataError
from rljax.models import ModelConfig, unstack_layers
from rljax.sampling import continuous as C
from rljax.sampling import decode as D
from rljax.sampling import paged as PG
from rljax.sampling.controls import SampleControls, StaticControls
from rljax.sampling.fp8 import sampler_params_jit
from rljax.sharding import rules
from rljax.sharding.rules import batch_axes
from rljax.tokenizers import check_token_ids

_static_jit = jax.jit(D.sample_static, static_argnames=("cfg", "spec", "num_samples", "new_bucket"))
_continuous_jit = jax.jit(C.sample_continuous, static_argnames=("cfg", "spec", "layout"))
_paged_jit = jax.jit(PG.sample_paged, static_argnames=("cfg", "spec", "layout"))
_trim_jit = jax.jit(C.trim, static_argnames=("rows", "width"))
# `stream`'s pieces:
_prefill_jit = jax.jit(D.prefill, static_argnames=("cfg", "spec", "num_samples", "new_bucket"))
_decode_jit = jax.jit(D.decode, static_argnames=("cfg", "spec"), donate_argnames=("state",))
_widen_jit = jax.jit(D.widen, static_argnames=("cfg", "extra"))  # new buffers: nothing to donate
_unstack_jit = jax.jit(unstack_layers, static_argnums=1)


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
    return None if batch_axes(sharding.mesh, rows) is None else rules.rows_sharding(sharding.mesh, rows)


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
    if controls.weight_dtype != "model":  # as `generate`
        params = sampler_params_jit(params, weight_dtype=controls.weight_dtype)
    params = _unstack_jit(params, cfg)
    state = _prefill_jit(cfg, params, tokens, mask, key, np.int32(controls.max_new_tokens), controls.scalars(),
                         spec=spec, num_samples=controls.num_samples,
                         new_bucket=D.bucket_length(controls.max_new_tokens))
    return state, spec, params


def pad_prompt_count(tokens: np.ndarray, mask: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Pads padded prompts [B, P] to the next power of two of B with one-token prompts: (tokens,
    mask, B). The samplers trace the real row count, so every B of a bucket compiles once."""
    b = tokens.shape[0]
    bucket = 1 << max(b - 1, 0).bit_length()
    tokens = np.pad(tokens, ((0, bucket - b), (0, 0)), constant_values=pad_id)
    mask = np.pad(mask, ((0, bucket - b), (0, 0)))
    mask[b:, -1] = True  # padding prompts: one token each, never decoded
    return tokens, mask, b


def generate(cfg: ModelConfig, params, prompt_tokens_bt, prompt_mask_bt=None, *, key: jax.Array,
             controls: SampleControls) -> D.SampleResult:
    """Samples `controls.num_samples` completions per prompt with a KV cache.

    `prompt_tokens_bt` [B, T] int and `prompt_mask_bt` [B, T] bool (True on real tokens; prompts
    are usually left-padded, any padding works). The same `key` and inputs give the same tokens.
    Returns a `SampleResult` with B * num_samples rows, prompt-major.
    """
    spec = controls.static()
    if controls.weight_dtype != "model":  # the sampler's FP8 copy of this call's weights (`rljax.sampling.fp8`)
        params = sampler_params_jit(params, weight_dtype=controls.weight_dtype)
    tokens, mask = pad_prompts(cfg, prompt_tokens_bt, prompt_mask_bt, spec.pad_id)
    tokens, mask, b = pad_prompt_count(tokens, mask, spec.pad_id)
    rows, width = b * controls.num_samples, controls.max_new_tokens
    max_new, scalars = np.int32(controls.max_new_tokens), controls.scalars()
    if controls.scheduler == "continuous":
        layout = C.plan_layout(controls, tokens.shape[0], tokens.shape[1], cfg)
        run = _paged_jit if layout.kv_layout == "paged" else _continuous_jit
        result = run(cfg, params, tokens, mask, key, max_new, scalars, np.int32(rows), spec=spec, layout=layout)
        split = None
    else:
        split = rows_sharding(params, tokens.shape[0])
        if split is not None:  # each device prefills and decodes its own rows
            tokens, mask = jax.device_put((tokens, mask), split)
        result = _static_jit(cfg, params, tokens, mask, key, max_new, scalars, np.int32(rows), spec=spec,
                             num_samples=controls.num_samples, new_bucket=D.bucket_length(width))
    if split is not None:
        return _trim_jit(result, rows=rows, width=width)
    # Trimmed on the host: a slice on device would compile once per row count and width.
    return jax.device_put(C.trim(jax.device_get(result), rows, width))


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
    widths = iter(D.decode_widths(spec, D.bucket_length(max_new_tokens), max_new_tokens))
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
            state = _widen_jit(cfg, state, width - previous)
        limit = min(done + chunk, max_new_tokens, width)
        state = _decode_jit(cfg, params, state, np.int32(limit), spec=spec)
