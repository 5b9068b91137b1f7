"""The slot machinery both continuous-batching KV layouts share: the prompt pool, the static
layout of a run, and the per-row bookkeeping of admission and of a decode step.

Two schedulers decode rows in S slots inside one `while_loop`: the slot layout
(`rljax.sampling.continuous`, each slot a contiguous cache of P + N tokens) and the paged layout
(`rljax.sampling.paged`, each slot a table of pages). They differ only in where a row's keys and
values live; everything a row does with its logits is the same, and lives here:

    prompt pool   prompts are prefilled once for their n samples (`prefill_into_pool`), and an
                  admitted row draws its token 0 from the pool's logits
    admission     `admit_rows`: token 0 of each admitted row, written into its slot (the token,
                  position, step, stop window) and into its output row (tokens, log-probs,
                  length 1, finish reason)
    decode step   `record_step`: after the layout's forward step, each running slot draws its next
                  token, records it in its row, and ends on EOS, a stop sequence or max_new

Both helpers take either loop state (`SlotState` or `PagedState`): they read and write only the
slot fields (`row_s`, `step_s`, `live_s`, `last_token_s`, `next_pos_s`, `window_sl`), the row
outputs (`tokens_rn`, `logp_rn`, `sampling_logp_rn`, `length_r`, `finish_r`) and the counters,
which `empty_slots` creates and `slot_result` reads. Row r draws token t from the uniform of
fold_in(fold_in(key, r), t) (`rljax.sampling.decode.draw`), so which slot, layout or step decodes
it changes nothing: the one copy of this arithmetic is what keeps both layouts bitwise equal to
the static scheduler (tests/sampling/test_continuous.py, tests/sampling/test_paged.py).

Writes to idle or refused slots go to index S (rows: to B * n), which `mode="drop"` skips: the
scatters keep fixed shapes inside the loop.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from rljax.models import ModelConfig, init_cache, prefill_cache
from rljax.models.attention import key_cache_layout
from rljax.models.fp8 import is_fp8_cache, quantize_cache_layers
from rljax.models.moe import route_dtype, route_layers
from rljax.sampling.controls import StaticControls
from rljax.sampling.decode import (FINISH_EOS, FINISH_LENGTH, FINISH_STOP, SampleResult, draw, prompt_forward,
                                    records_routes, stop_flags)


@flax.struct.dataclass
class PromptPool:
    """Prefilled prompts: prompt q lives in entry q % G (G = all prompts, or a ring of 2 batches)."""

    layers: Any  # per layer {"k": [G, K, H, P], "v": [G, K, P, H]} (FP8: and their scales, `empty_pool`)
    pos_gp: jax.Array  # key positions of the prompt slots (-1 on padding)
    logits_gv: jax.Array  # logits after the prompt's last real token
    next_pos_g: jax.Array  # the first completion token's position (the prompt's real length)
    prefilled: jax.Array  # prompts prefilled so far


@flax.struct.dataclass
class SlotLayout:
    """The static sizes of one continuous run, either KV layout (a jit static argument; built by
    `rljax.sampling.continuous.plan_layout`)."""

    slots: int = flax.struct.field(pytree_node=False)
    refill: int = flax.struct.field(pytree_node=False)
    prefill_batch: int = flax.struct.field(pytree_node=False)  # prompts per in-loop prefill; 0 = all up front
    num_samples: int = flax.struct.field(pytree_node=False)
    new_bucket: int = flax.struct.field(pytree_node=False)
    kv_layout: str = flax.struct.field(pytree_node=False, default="slots")  # or "paged" (rljax.sampling.paged)
    page_size: int = flax.struct.field(pytree_node=False, default=16)
    num_pages: int = flax.struct.field(pytree_node=False, default=0)  # paged: pages in each layer's pool
    drain_slots: int = flax.struct.field(pytree_node=False, default=0)  # the tail's slots (0: no drain)
    pool_axes: tuple = flax.struct.field(pytree_node=False, default=())  # one pool per device group (row_shards)


def pool_while(axes: tuple, cond, body, init, *, guard: bool = False):
    """`lax.while_loop` run in step by every slot pool: with `axes` (the mesh axes of one pool per
    device group, `rljax.sampling.row_shards`) the loop goes on while `cond` holds in any pool, so
    every pool runs the same trip count around the collectives XLA places in the body for the
    other axes (fsdp's weight gathers); pools with unequal trip counts deadlock there. The loops
    that use it are no-ops in a pool whose own `cond` is false (no running or pending row: the
    step decodes and admits nothing); `guard` keeps the state of such a pool unchanged explicitly,
    for a body that is not. Without axes: the plain loop."""
    if not axes:
        return jax.lax.while_loop(cond, body, init)
    if guard:
        plain = body
        body = lambda s: jax.tree.map(lambda new, old: jnp.where(cond(s), new, old), plain(s), s)  # noqa: E731
    return jax.lax.while_loop(lambda s: jax.lax.psum(cond(s).astype(jnp.int32), axes) > 0, body, init)


def empty_pool(cfg: ModelConfig, entries: int, prompt_len: int, kv_dtype: str = "model") -> PromptPool:
    """A pool of `entries` empty prompts. `kv_dtype = "fp8"`: its keys and values are
    float8_e4m3fn with f32 scales (`rljax.models.fp8`), which `prefill_into_pool` fills as the
    static sampler quantises its prompt cache (after the prefill), so either layout's rows see the
    static sampler's FP8 prompt keys bit for bit."""
    empty = init_cache(cfg, entries, prompt_len)
    layers = empty_kv_layers(cfg, empty["layers"], kv_dtype)
    return PromptPool(layers=layers, pos_gp=empty["pos"],
                      logits_gv=jnp.zeros((entries, cfg.vocab_size), jnp.float32),
                      next_pos_g=jnp.zeros((entries,), jnp.int32), prefilled=jnp.zeros((), jnp.int32))


def prefill_into_pool(cfg: ModelConfig, params, pool: PromptPool, prompt_bp, mask_bp, batch: int, *,
                      batch_invariant: bool, prompt=None, chunk: int = 0) -> PromptPool:
    """Prefills prompts [prefilled, prefilled + batch) into their ring entries. `prompt`, when
    given, is the caller's (cache, last logits) of exactly these prompts (image prompts: the
    spliced prefill of `rljax.sampling.vision`, filled all up front) in place of `prompt_forward`."""
    start = pool.prefilled
    tokens = jax.lax.dynamic_slice_in_dim(prompt_bp, start, batch)
    mask = jax.lax.dynamic_slice_in_dim(mask_bp, start, batch)
    if prompt is None:
        prompt = prompt_forward(cfg, params, tokens, mask, batch_invariant=batch_invariant, chunk=chunk)
    cache, logits_bv = prompt[:2]
    if is_fp8_cache(pool.layers[0]):  # quantised after the prefill, as `rljax.sampling.decode.prefill` does
        cache = dict(cache, layers=quantize_cache_layers(cache["layers"], key_cache_layout(cfg)))
    entry = start % pool.pos_gp.shape[0]
    put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), entry, 0)
    layers = tuple({name: put(pc[name], lc[name]) for name in pc} for pc, lc in zip(pool.layers, cache["layers"]))
    return pool.replace(layers=layers, pos_gp=put(pool.pos_gp, cache["pos"]), logits_gv=put(pool.logits_gv, logits_bv),
                        next_pos_g=put(pool.next_pos_g, jnp.sum(mask, axis=1, dtype=jnp.int32)),
                        prefilled=start + batch)


def slot_rope(rope_cos_sin, row_s, num_samples: int):
    """The decode step's rotary table for the slots: a shared 1D table [W, H] as it is, or, for
    per-prompt tables [B, W, H] (image prompts' M-RoPE, `rljax.models.mrope.mrope_table`, whose
    text continuation carries each prompt's delta), the table of each slot's prompt, row // n
    (idle slots: prompt 0, never read). A slot thus rotates its row's tokens as the static
    sampler's row does, whoever occupied it before."""
    if rope_cos_sin[0].ndim != 3:
        return rope_cos_sin
    prompt_s = jnp.clip(row_s, 0, None) // num_samples
    return tuple(jnp.take(t_bwh, prompt_s, axis=0) for t_bwh in rope_cos_sin)


def empty_kv_layers(cfg: ModelConfig, layers, kv_dtype: str):
    """Empty layer caches `layers` (zeros, compute dtype) as `kv_dtype` stores them: unchanged, or
    for "fp8" float8_e4m3fn zeros with unit scales (`rljax.models.fp8.quantize_cache_layers`)."""
    return quantize_cache_layers(layers, key_cache_layout(cfg)) if kv_dtype == "fp8" else layers


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    """Bytes one cached token takes over all layers, as `kv_dtype` stores it: the keys and values
    (2 L K H x the compute dtype's size, or x 1 for "fp8") plus, for "fp8", their f32 scales
    (2 L K x 4). Read from the buffers the samplers allocate (`jax.eval_shape`, no compute), so it
    cannot drift from them. `sampling.kv_cache_bytes` divides by it to count tokens."""
    shapes = jax.eval_shape(lambda: empty_kv_layers(cfg, init_cache(cfg, 1, 1)["layers"], kv_dtype))
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)))


def empty_slots(state_cls, spec: StaticControls, slots: int, rows: int, new_bucket: int, **layout_fields):
    """A `state_cls` loop state before any row is admitted: every slot idle (row -1), every row
    empty (pad tokens, length 0, FINISH_LENGTH), the counters 0, and the layout's own
    `layout_fields` (its KV, the pool, the queue)."""
    window = max([len(q) for q in spec.stop_sequences], default=1)
    zeros_s = jnp.zeros((slots,), jnp.int32)
    return state_cls(
        row_s=zeros_s - 1, step_s=zeros_s, live_s=jnp.zeros((slots,), bool), last_token_s=zeros_s,
        next_pos_s=zeros_s, window_sl=jnp.full((slots, window), -1, jnp.int32),
        tokens_rn=jnp.full((rows, new_bucket), spec.pad_id, jnp.int32),
        logp_rn=jnp.zeros((rows, new_bucket), jnp.float32),
        sampling_logp_rn=jnp.zeros((rows, new_bucket), jnp.float32),
        length_r=jnp.zeros((rows,), jnp.int32), finish_r=jnp.full((rows,), FINISH_LENGTH, jnp.int32),
        decode_steps=jnp.zeros((), jnp.int32), live_row_steps=jnp.zeros((), jnp.int32), **layout_fields)


def admit_rows(state, logits_av, keys_a, row_a, next_pos_a, ok_a, slot_tgt, row_tgt, max_new, scalars,
               spec: StaticControls):
    """Token 0 of the rows `row_a` entering slots `slot_tgt` (`ok_a` False, or targets S and B * n:
    refused, nothing written): drawn from their prompts' logits `logits_av` with their row keys
    `keys_a`, stored in the slot (next token at `next_pos_a`, step 1) and in row `row_tgt`.
    Returns the state and which admitted rows ended on token 0 (EOS, stop or max_new <= 1)."""
    a_count = row_a.shape[0]
    step0 = jnp.zeros((a_count,), jnp.int32)
    tok_a, logp_a, slp_a = draw(logits_av, keys_a, row_a, step0, scalars, spec)
    window0 = jnp.full((a_count, state.window_sl.shape[1]), -1, jnp.int32)
    window_a, hit_eos, hit_stop = stop_flags(window0, tok_a, ok_a, spec)
    ended_a = hit_eos | hit_stop | (max_new <= 1)
    reason = jnp.where(hit_eos, FINISH_EOS, jnp.where(hit_stop, FINISH_STOP, FINISH_LENGTH))
    put_row = lambda buf, x: buf.at[row_tgt, 0].set(x.astype(buf.dtype), mode="drop")
    put_slot = lambda buf, x: buf.at[slot_tgt].set(x.astype(buf.dtype), mode="drop")
    return state.replace(
        row_s=put_slot(state.row_s, row_a), step_s=put_slot(state.step_s, step0 + 1),
        live_s=put_slot(state.live_s, ~ended_a), last_token_s=put_slot(state.last_token_s, tok_a),
        next_pos_s=put_slot(state.next_pos_s, next_pos_a), window_sl=put_slot(state.window_sl, window_a),
        tokens_rn=put_row(state.tokens_rn, tok_a), logp_rn=put_row(state.logp_rn, logp_a),
        sampling_logp_rn=put_row(state.sampling_logp_rn, slp_a),
        length_r=state.length_r.at[row_tgt].set(1, mode="drop"),
        finish_r=state.finish_r.at[row_tgt].set(reason, mode="drop")), ended_a


def record_step(state, logits_sv, keys_r, max_new, scalars, spec: StaticControls):
    """The tail of a decode step, after the layout's forward gave `logits_sv` for every slot: each
    running slot draws token `step_s` of its row, writes it with its log-probs into the row, and
    ends on EOS, a stop sequence or `max_new` tokens; idle slots draw pad and write nothing.
    Returns the state (the KV untouched: the caller's) and which slots' rows ended."""
    live_s = state.live_s
    rows_total = state.length_r.shape[0]
    row_safe = jnp.clip(state.row_s, 0, rows_total - 1)
    tok_s, logp_s, slp_s = draw(logits_sv, keys_r[row_safe], state.row_s, state.step_s, scalars, spec)
    tok_s = jnp.where(live_s, tok_s, spec.pad_id)
    row_tgt = jnp.where(live_s, state.row_s, rows_total)
    put = lambda buf, x: buf.at[row_tgt, state.step_s].set(x.astype(buf.dtype), mode="drop")
    window, hit_eos, hit_stop = stop_flags(state.window_sl, tok_s, live_s, spec)
    step_s = state.step_s + live_s
    ended_s = hit_eos | hit_stop | (live_s & (step_s >= max_new))
    reason = jnp.where(hit_eos, FINISH_EOS, jnp.where(hit_stop, FINISH_STOP, FINISH_LENGTH))
    return state.replace(
        step_s=step_s, live_s=live_s & ~ended_s, last_token_s=tok_s, next_pos_s=state.next_pos_s + live_s,
        window_sl=window, tokens_rn=put(state.tokens_rn, tok_s), logp_rn=put(state.logp_rn, logp_s),
        sampling_logp_rn=put(state.sampling_logp_rn, slp_s),
        length_r=state.length_r.at[row_tgt].set(step_s, mode="drop"),
        finish_r=state.finish_r.at[jnp.where(ended_s, state.row_s, rows_total)].set(reason, mode="drop"),
        decode_steps=state.decode_steps + jnp.any(live_s),
        live_row_steps=state.live_row_steps + jnp.sum(live_s, dtype=jnp.int32)), ended_s


def slot_result(state, slots: int, slot_steps, **counters) -> SampleResult:
    """The finished loop's rows as a `SampleResult` (mask: the first `length_r` columns), with the
    layout's `counters` (the paged page counters)."""
    mask = jnp.arange(state.tokens_rn.shape[1])[None, :] < state.length_r[:, None]
    return SampleResult(tokens=state.tokens_rn, logprobs=state.logp_rn, sampling_logprobs=state.sampling_logp_rn,
                        mask=mask, lengths=state.length_r, finish_reason=state.finish_r,
                        decode_steps=state.decode_steps, live_row_steps=state.live_row_steps, slots=slots,
                        slot_steps=slot_steps, **counters)


def record_slot_routes(state, routes_slk):
    """`record_routes`: writes each running slot's fed-token experts [S, L, k] (from the layout's
    forward step) into its row's completion record at column step - 1 (the step fed the row's token
    step - 1). Either layout's state, before `record_step` advances it; a preempted row (paged)
    rewrites its columns when it runs again, with the same tokens."""
    rec = state.routes_rnlk
    row_tgt = jnp.where(state.live_s, state.row_s, rec.shape[0])
    return state.replace(routes_rnlk=rec.at[row_tgt, state.step_s - 1].set(routes_slk.astype(rec.dtype), mode="drop"))


def routes_result(cfg: ModelConfig, layer_params, result: SampleResult, routes_rnlk, prompt_bp, mask_bp,
                  n: int) -> SampleResult:
    """The continuous result with its routing record: the completion record masked to each row's
    tokens (-1 elsewhere), and the prompts' record, [B * n, P, L, k]. The prompt pool's prefill
    keeps no routes, so the prompts' come from the same cache-free forward (`prefill_cache`) run
    once more over the B prompts (the static scheduler's prefill computes the same)."""
    prompt_routes = prefill_cache(cfg, layer_params, prompt_bp, mask_bp, return_routes=True)[2]
    prompt_routes = jnp.where(mask_bp[:, :, None, None], prompt_routes.transpose(1, 2, 0, 3), -1)
    dtype = routes_rnlk.dtype
    return result.replace(routes=jnp.where(result.mask[:, :, None, None], routes_rnlk, -1).astype(dtype),
                          prompt_routes=jnp.repeat(prompt_routes, n, axis=0).astype(dtype))


def empty_routes(cfg: ModelConfig, spec: StaticControls, rows: int, new_bucket: int):
    """The completion routing record [B * n, N, L, k] (-1: none yet) when the run records routes
    (`records_routes`), else None: no buffer in the loop's carry."""
    if not records_routes(cfg, spec):
        return None
    return jnp.full((rows, new_bucket, *route_layers(cfg)), -1, route_dtype(cfg))
