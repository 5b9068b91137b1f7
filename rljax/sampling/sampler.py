"""KV-cached generation: one jitted prefill, then a jitted `lax.while_loop` decode.

    prefill  : run the (left-padded) prompts once, [B, P] -> KV cache for P slots, last logits;
               broadcast cache and logits to the n samples of each prompt (no re-prefill);
               draw token 0.
    decode   : while step < max_new_tokens and some row is running:
                   logits = forward(last token, cache)    # cache updated in place
                   draw token `step`, record its log-probs, stop rows on EOS / stop sequences.

Log-probs. `logprobs` is log p(token | prefix) under the policy (temperature 1, no filters),
computed by the trainer's own `rljax.models.logprobs_from_logits` on the decode logits, so a PPO
ratio starts at 1 up to float rounding. `sampling_logprobs` is the log-probability under the
tempered, filtered distribution the token was drawn from (0 for greedy).

Buckets. The prompt length P is padded (on the left) to `bucket_length(P)` and the decode buffers
are sized `bucket_length(max_new_tokens)`, with `bucket_length(n)` = the next power of two >= max(n,
16). `max_new_tokens` itself is a traced scalar, so a run compiles once per (batch, num_samples,
prompt bucket, new-token bucket, controls switched on), never per exact length.

Phases. Decode attention reads every cache slot every step, and that read (not the matmuls) is
what grows with length: on a 2-core CPU, attention alone at qwen2-small's shapes took about twice
as long over 96 slots as over 48. So the cache starts with room for 16 new tokens and doubles
(16, 32, 64, ... up to the new-token bucket): decode runs as one `while_loop` per width, each
attending only over the slots that can be filled by then, and the cache is padded between
phases. That is at most log2(bucket / 16) + 1 compiled loops per bucket, and the average step
reads about 3/4 of the slots a full-width cache would (see `phase_widths`): 512-token generation
on qwen2-tiny ran 1.29x faster.

Rows are prompt-major: row i * n + j is sample j of prompt i.

Meshes. When the params live on a multi-device mesh of this process (`rljax.sharding.shard_params`
or a replicated `device_put`), `generate` and `stream` split the prompt rows over the mesh's batch
axes (data x fsdp, else data, else fsdp; the first that divides the batch), so each device prefills
and decodes its own rows. The tokens are the same as on one device (the PRNG is partitionable).
Across processes, or on a mesh with Explicit axes, the rows stay replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from rljax.errors import ConfigError, DataError
from rljax.models import CACHE_SLOT_AXIS, ModelConfig, default_positions, forward, hidden_states, init_cache
from rljax.models import logits_from_hidden, logprobs_from_logits, rope_table, unstack_layers
from rljax.sampling.filters import Filters, make_filters, sample_logits
from rljax.sharding.rules import batch_axes
from rljax.tokenizers.batching import bucket_length as pad_bucket_length

# Finish reasons, one int32 per row.
FINISH_LENGTH = 0  # reached max_new_tokens
FINISH_EOS = 1  # drew one of `eos_ids` (the EOS token is part of the completion)
FINISH_STOP = 2  # completed one of `stop_sequences` (its tokens are part of the completion)
MIN_BUCKET = 16


def bucket_length(n: int) -> int:
    """The padded length used for compiled shapes: the next power of two >= max(n, 16)."""
    return pad_bucket_length(int(n), MIN_BUCKET)


def phase_widths(new_bucket: int, max_new_tokens: int | None = None) -> tuple[int, ...]:
    """New-token cache widths of the decode phases: 16, 32, 64, ... up to `new_bucket` (a power of
    two >= 16), stopping at the first width that holds `max_new_tokens` when it is given. Phase i
    draws tokens up to index widths[i] - 1 with a cache of P + widths[i] slots."""
    widths = [min(MIN_BUCKET, new_bucket)]
    while widths[-1] < new_bucket and (max_new_tokens is None or widths[-1] < max_new_tokens):
        widths.append(min(2 * widths[-1], new_bucket))
    return tuple(widths)


@flax.struct.dataclass
class SampleResult:
    """Completions, rows prompt-major ([B * n, T_new] with T_new = max_new_tokens).

    tokens            int32  completion tokens; `pad_id` after a row ends
    logprobs          f32    policy log p(token | prefix), temperature 1, unfiltered; 0 off mask
    sampling_logprobs f32    log-prob under the tempered, filtered sampling distribution; 0 off mask
    mask              bool   True on generated tokens (EOS and stop-sequence tokens included)
    lengths           int32  [B * n] number of generated tokens
    finish_reason     int32  [B * n] FINISH_LENGTH (0), FINISH_EOS (1) or FINISH_STOP (2)
    """

    tokens: jax.Array
    logprobs: jax.Array
    sampling_logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array
    finish_reason: jax.Array


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static (compile-time) sampling settings."""

    filters: Filters
    eos_ids: tuple[int, ...]
    stop_sequences: tuple[tuple[int, ...], ...]
    pad_id: int


@flax.struct.dataclass
class DecodeState:
    """Everything the decode loop carries; donated to each decode call so buffers are reused."""

    cache: Any
    last_token_b: jax.Array  # the token to feed next
    next_pos_b: jax.Array  # its position
    tokens_bn: jax.Array
    logp_bn: jax.Array
    sampling_logp_bn: jax.Array
    done_b: jax.Array
    length_b: jax.Array  # tokens generated per row (up to and including its stop token)
    finish_b: jax.Array
    window_bl: jax.Array  # the last L generated tokens, for stop-sequence matching
    step: jax.Array  # tokens generated so far
    max_new: jax.Array
    key: jax.Array
    controls: Any  # (temperature, top_p, min_p) traced scalars


def _record(state: DecodeState, logits_bv, spec: _Spec) -> DecodeState:
    """Draws token `step` from `logits_bv`, stores it with its log-probs and updates stop flags."""
    temperature, top_p, min_p = state.controls
    key = jax.random.fold_in(state.key, state.step)
    tok_b, slp_b = sample_logits(key, logits_bv, temperature, top_p, min_p, filters=spec.filters)
    logp_b = logprobs_from_logits(logits_bv[:, None, :], tok_b[:, None])[0][:, 0]
    live_b = ~state.done_b
    tok_b = jnp.where(live_b, tok_b, spec.pad_id)
    col = (0, state.step)
    put = lambda buf, x: jax.lax.dynamic_update_slice(buf, x[:, None].astype(buf.dtype), col)
    tokens = put(state.tokens_bn, tok_b)
    logp = put(state.logp_bn, jnp.where(live_b, logp_b, 0.0))
    slp = put(state.sampling_logp_bn, jnp.where(live_b, slp_b, 0.0))
    window = jnp.concatenate([state.window_bl[:, 1:], tok_b[:, None]], axis=1)
    hit_eos = live_b & jnp.isin(tok_b, jnp.asarray(spec.eos_ids or (-1,), jnp.int32))
    hit_stop = jnp.zeros_like(live_b)
    for seq in spec.stop_sequences:
        tail = window[:, window.shape[1] - len(seq):]
        hit_stop |= jnp.all(tail == jnp.asarray(seq, jnp.int32), axis=1)
    hit_stop &= live_b & ~hit_eos
    finish = jnp.where(hit_eos, FINISH_EOS, jnp.where(hit_stop, FINISH_STOP, state.finish_b))
    return state.replace(
        last_token_b=tok_b, tokens_bn=tokens, logp_bn=logp, sampling_logp_bn=slp,
        done_b=state.done_b | hit_eos | hit_stop, length_b=state.length_b + live_b, finish_b=finish.astype(jnp.int32),
        window_bl=window, step=state.step + 1)


def _prefill(cfg: ModelConfig, params, prompt_bt, mask_bt, key, max_new, controls, *, spec: _Spec,
             num_samples: int, new_bucket: int) -> DecodeState:
    """Prefills B prompts once, broadcasts the cache to B * n rows and draws token 0."""
    b, p = prompt_bt.shape
    bn = b * num_samples
    positions_bt = default_positions(mask_bt)
    h_btd, cache = hidden_states(cfg, params, prompt_bt, positions_bt, mask_bt, init_cache(cfg, b, p))
    last_b = p - 1 - jnp.argmax(jnp.flip(mask_bt, axis=1), axis=1)  # last real token (any padding)
    h_b1d = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)
    logits_bv = logits_from_hidden(cfg, params, h_b1d)[:, 0]

    cache = jax.tree.map(lambda x: jnp.repeat(x, num_samples, axis=0) if x.ndim else x, cache)
    cache = _pad_slots(cache, phase_widths(new_bucket)[0])  # room for the first phase
    window = max([len(s) for s in spec.stop_sequences], default=1)
    state = DecodeState(
        cache=cache,
        last_token_b=jnp.zeros((bn,), jnp.int32),
        next_pos_b=jnp.repeat(jnp.sum(mask_bt, axis=1, dtype=jnp.int32), num_samples),
        tokens_bn=jnp.full((bn, new_bucket), spec.pad_id, jnp.int32),
        logp_bn=jnp.zeros((bn, new_bucket), jnp.float32),
        sampling_logp_bn=jnp.zeros((bn, new_bucket), jnp.float32),
        done_b=jnp.zeros((bn,), bool),
        length_b=jnp.zeros((bn,), jnp.int32),
        finish_b=jnp.full((bn,), FINISH_LENGTH, jnp.int32),
        window_bl=jnp.full((bn, window), -1, jnp.int32),
        step=jnp.zeros((), jnp.int32), max_new=max_new, key=key, controls=controls)
    return _record(state, jnp.repeat(logits_bv, num_samples, axis=0), spec)


def _pad_slots(cache, extra: int):
    """Appends `extra` empty slots to every cache buffer (keys and values 0, positions -1)."""
    def pad(x, slot_axis, fill):
        widths = [(0, 0)] * x.ndim
        widths[slot_axis] = (0, extra)
        return jnp.pad(x, widths, constant_values=fill)

    return {"layers": tuple({name: pad(c, CACHE_SLOT_AXIS[name], 0) for name, c in lc.items()}
                            for lc in cache["layers"]),
            "pos": pad(cache["pos"], 1, -1), "index": cache["index"]}


def _widen(state: DecodeState, extra: int) -> DecodeState:
    """The next decode phase's state: the cache grown by `extra` slots."""
    return state.replace(cache=_pad_slots(state.cache, extra))


def _decode(cfg: ModelConfig, params, state: DecodeState, limit, *, spec: _Spec) -> DecodeState:
    """Decodes until `min(limit, max_new)` tokens are drawn or every row has stopped. The caller
    keeps `limit` within the cache: a cache of P + w slots can draw tokens up to index w - 1."""
    layer_params = unstack_layers(params)  # a no-op when the caller split them (generate, sample)
    # A token's position counts real tokens only, so it is at most its slot: the table covers all.
    rope_cos_sin = rope_table(cfg, state.cache["pos"].shape[1])
    stop_at = jnp.minimum(limit, state.max_new)

    def cond(s: DecodeState):
        return (s.step < stop_at) & ~jnp.all(s.done_b)

    def body(s: DecodeState):
        ones_b1 = jnp.ones((s.last_token_b.shape[0], 1), bool)
        logits_b1v, cache = forward(cfg, layer_params, s.last_token_b[:, None], s.next_pos_b[:, None],
                                    ones_b1, s.cache, rope_cos_sin=rope_cos_sin)
        s = s.replace(cache=cache, next_pos_b=s.next_pos_b + 1)
        return _record(s, logits_b1v[:, 0], spec)

    return jax.lax.while_loop(cond, body, state)


def _result(state: DecodeState, *, width: int) -> SampleResult:
    mask = jnp.arange(width)[None, :] < state.length_b[:, None]
    return SampleResult(tokens=state.tokens_bn[:, :width], logprobs=state.logp_bn[:, :width],
                        sampling_logprobs=state.sampling_logp_bn[:, :width], mask=mask,
                        lengths=state.length_b, finish_reason=state.finish_b)


def _decode_phases(cfg: ModelConfig, params, state: DecodeState, *, spec: _Spec, new_bucket: int,
                   max_new_tokens: int, decode=_decode, widen=_widen) -> DecodeState:
    """Runs every decode phase (see the module docstring): decode to the cache's width, widen, go
    on. Traceable; `generate` passes the jitted `decode` and `widen` instead."""
    widths = phase_widths(new_bucket, max_new_tokens)
    for i, width in enumerate(widths):
        if i:
            state = widen(state, width - widths[i - 1])
        state = decode(cfg, params, state, np.int32(min(width, max_new_tokens)), spec=spec)
    return state


_prefill_jit = jax.jit(_prefill, static_argnames=("cfg", "spec", "num_samples", "new_bucket"))
_decode_jit = jax.jit(_decode, static_argnames=("cfg", "spec"), donate_argnames=("state",))
_widen_jit = jax.jit(_widen, static_argnames=("extra",))  # new buffers: nothing to donate
_result_jit = jax.jit(_result, static_argnames=("width",))
_unstack_jit = jax.jit(unstack_layers)


# ----------------------------------------------------------------------------- public API


def _prepare(cfg, prompt_tokens_bt, prompt_mask_bt, max_new_tokens, num_samples, temperature, top_k,
             top_p, min_p, greedy, eos_ids, stop_sequences, pad_id):
    """Validates inputs on the host and pads prompts on the left to their bucket."""
    tokens = np.asarray(prompt_tokens_bt)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"prompt tokens must be a [batch, time] integer array, got {tokens.dtype}{list(tokens.shape)}")
    mask = np.ones(tokens.shape, bool) if prompt_mask_bt is None else np.asarray(prompt_mask_bt).astype(bool)
    if mask.shape != tokens.shape:
        raise DataError(f"prompt mask shape {list(mask.shape)} != prompt tokens shape {list(tokens.shape)}")
    if not mask.any(axis=1).all():
        raise DataError("every prompt needs at least one real token (a mask row is all False)")
    real = tokens[mask]
    if real.size and (real.min() < 0 or real.max() >= cfg.vocab_size):
        raise DataError(f"prompt token ids must lie in [0, {cfg.vocab_size}), got [{real.min()}, {real.max()}]")
    if int(max_new_tokens) < 1 or int(num_samples) < 1:
        raise ConfigError(f"max_new_tokens and num_samples must be >= 1, got {max_new_tokens}, {num_samples}")
    stops = tuple(tuple(int(t) for t in s) for s in stop_sequences)
    if any(len(s) == 0 for s in stops):
        raise ConfigError("stop_sequences must be non-empty token-id sequences")
    spec = _Spec(filters=make_filters(temperature, top_k, top_p, min_p, greedy),
                 eos_ids=tuple(int(e) for e in eos_ids), stop_sequences=stops, pad_id=int(pad_id))
    p = tokens.shape[1]
    pad = bucket_length(p) - p
    tokens = np.pad(np.where(mask, tokens, pad_id), ((0, 0), (pad, 0)), constant_values=pad_id)
    mask = np.pad(mask, ((0, 0), (pad, 0)))
    controls = (np.float32(temperature or 1.0), np.float32(top_p), np.float32(min_p))
    return tokens.astype(np.int32), mask, spec, controls


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


def _start(cfg, params, prompt_tokens_bt, prompt_mask_bt, key, max_new_tokens, num_samples, controls):
    tokens, mask, spec, scalars = _prepare(cfg, prompt_tokens_bt, prompt_mask_bt, max_new_tokens,
                                           num_samples, *controls)
    split = rows_sharding(params, tokens.shape[0])
    if split is not None:  # each device prefills and decodes its own rows
        tokens, mask = jax.device_put((tokens, mask), split)
    # Per-layer weights, split once per call: each jitted phase would otherwise copy them out of the
    # stacked arrays again (about 6% of a qwen2-small generate with 64 new tokens).
    params = _unstack_jit(params)
    state = _prefill_jit(cfg, params, tokens, mask, key, np.int32(max_new_tokens), scalars, spec=spec,
                         num_samples=int(num_samples), new_bucket=bucket_length(max_new_tokens))
    return state, spec, params


def generate(cfg: ModelConfig, params, prompt_tokens_bt, prompt_mask_bt=None, *, key: jax.Array,
             max_new_tokens: int, num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, greedy: bool = False, eos_ids: Sequence[int] = (),
             stop_sequences: Sequence[Sequence[int]] = (), pad_id: int = 0) -> SampleResult:
    """Samples `num_samples` completions per prompt with a KV cache; see the module docstring.

    `prompt_tokens_bt` [B, T] int and `prompt_mask_bt` [B, T] bool (True on real tokens; prompts
    are usually left-padded, any padding works). The same `key` and inputs give the same tokens.
    `temperature=0` means greedy. Returns a `SampleResult` with B * num_samples rows.
    """
    controls = (temperature, top_k, top_p, min_p, greedy, eos_ids, stop_sequences, pad_id)
    state, spec, params = _start(cfg, params, prompt_tokens_bt, prompt_mask_bt, key, max_new_tokens,
                                 num_samples, controls)
    state = _decode_phases(cfg, params, state, spec=spec, new_bucket=bucket_length(max_new_tokens),
                           max_new_tokens=int(max_new_tokens), decode=_decode_jit, widen=_widen_jit)
    return _result_jit(state, width=int(max_new_tokens))


def stream(cfg: ModelConfig, params, prompt_tokens_bt, prompt_mask_bt=None, *, key: jax.Array,
           max_new_tokens: int, chunk: int = 8, **controls) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Like `generate`, but yields (tokens, mask) host arrays [B * n, <= chunk] as they are drawn.

    The same compiled prefill and decode run; decode stops every `chunk` tokens (a traced limit, so
    no recompilation) and resumes on the donated state. Same key, same tokens as `generate`.
    """
    num_samples = controls.pop("num_samples", 1)
    names = ("temperature", "top_k", "top_p", "min_p", "greedy", "eos_ids", "stop_sequences", "pad_id")
    defaults = (1.0, 0, 1.0, 0.0, False, (), (), 0)
    unknown = set(controls) - set(names)
    if unknown:
        raise ConfigError(f"unknown sampling controls {sorted(unknown)}; known: {', '.join(names)}")
    values = tuple(controls.get(n, d) for n, d in zip(names, defaults))
    state, spec, params = _start(cfg, params, prompt_tokens_bt, prompt_mask_bt, key, max_new_tokens,
                                 num_samples, values)
    widths = iter(phase_widths(bucket_length(max_new_tokens), int(max_new_tokens)))
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
