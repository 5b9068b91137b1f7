"""The traceable decoding core that `generate`, `stream` and `sample` share.

    prefill  : run the (left-padded) prompts once, [B, P] -> KV cache for P slots, last logits;
               broadcast cache and logits to the n samples of each prompt (no re-prefill);
               draw token 0.
    decode   : while step < max_new_tokens and some row is running:
                   logits = forward(last token, cache)    # cache updated in place
                   draw token `step`, record its log-probs, stop rows on EOS / stop sequences.

Log-probs. `logprobs` is log p(token | prefix) under the policy (temperature 1, no filters),
computed by the trainer's own `rljax.models.logprobs_from_logits` on the decode logits, so the
sampler and the trainer score a token with the same function. They still run different programs
(a KV-cached decode step against a full-sequence forward), so a PPO ratio starts at 1 only up to
rounding: within about 1e-5 in float32, and in bfloat16 compute (f32 residual stream, bf16
matmul operands) within the bound `rljax.models.scoring` states and tests/models/test_bf16_agreement.py
checks (mean <= 1e-4, max <= 2e-3 nats on the test model).
`sampling_logprobs` is the log-probability under the tempered, filtered distribution the token
was drawn from (0 for greedy).

Keys. Row r draws token t with the uniform of fold_in(fold_in(key, r), t) (`row_uniforms`), so a
row's tokens depend on its own key, prompt and index only: not on the batch around it, and not on
when a scheduler decodes it. The continuous scheduler (`rljax.sampling.continuous`) reuses `draw`
and `stop_flags` and so gives the same tokens as this static loop.

Phases. Decode attention reads every cache slot every step, and on the CPU (einsum attention)
that read, not the weight matmuls, is the part of a step that grows with the cache. So the cache
can start narrower and grow: `spec.decode_phases` = k runs decode as k `while_loop`s over new-token
widths N / 2^(k-1), ..., N / 2, N (N the new-token bucket, each width >= 16; `phase_widths`), each
attending only over the slots that can be filled by then, with the cache padded between them.
An average step then reads about (2/3 + 1/(3 * 4^(k-1))) N new slots instead of N: 3/4 at k = 2,
0.69 at k = 3, 2/3 as k grows (doubling from 16 is the limit). Each loop is its own body for
XLA to compile, so compile time grows with k while the read saved shrinks: k = 1 (one loop over
the full width, positions -1 masked) is the default on accelerators, where a compile costs tens
of seconds and a decode-attention kernel that stops at each row's length makes the width free,
and a small k on the CPU, where einsum attention reads every slot.
`rljax.sampling.controls` picks k per backend; BENCHMARKS.md has the measurements. Whatever k,
`generate` runs prefill, every phase and the result as ONE compiled program (`sample_static`).

Rows are prompt-major: row i * n + j is sample j of prompt i.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import ModelConfig, cache_slot_axes, forward, prefill_cache
from rljax.models import hidden_states, logits_from_hidden, logprobs_from_logits, rope_table, unstack_layers
from rljax.models.attention import key_cache_layout
from rljax.models.fp8 import quantize_cache_layers
from rljax.models.moe import route_dtype, route_layers
from rljax.sampling.chunked_prefill import chunked_prompt_forward
from rljax.sampling.controls import StaticControls
from rljax.sampling.filters import row_uniforms, sample_logits_from_uniforms
from rljax.sampling.one_pass import draw_one_pass
from rljax.tokenizers.batching import bucket_length as pad_bucket_length

# Finish reasons, one int32 per row.
FINISH_LENGTH = 0  # reached max_new_tokens
FINISH_EOS = 1  # drew one of `eos_ids` (the EOS token is part of the completion)
FINISH_STOP = 2  # completed one of `stop_sequences` (its tokens are part of the completion)
MIN_BUCKET = 16


def bucket_length(n: int) -> int:
    """The padded length used for compiled shapes: the next power of two >= max(n, 16)."""
    return pad_bucket_length(int(n), MIN_BUCKET)


def phase_widths(new_bucket: int, max_new_tokens: int | None = None, *, phases: int = 1) -> tuple[int, ...]:
    """New-token cache widths of `phases` decode phases: new_bucket / 2^(phases-1), ..., new_bucket
    / 2, new_bucket (`new_bucket` a power of two >= 16; widths below 16 are raised to 16 and
    repeats dropped), stopping at the first width that holds `max_new_tokens` when it is given.
    Phase i draws tokens up to index widths[i] - 1 with a cache of P + widths[i] slots."""
    widths = sorted({max(new_bucket >> i, min(MIN_BUCKET, new_bucket)) for i in range(max(phases, 1))})
    if max_new_tokens is not None:
        widths = widths[:next(i for i, w in enumerate(widths) if w >= max_new_tokens or w == new_bucket) + 1]
    return tuple(widths)


def decode_widths(spec: StaticControls, new_bucket: int, max_new_tokens: int | None = None) -> tuple[int, ...]:
    """The cache widths the static loop decodes with: `spec.decode_phases` phases, or the full
    width alone in batch-invariant mode (a row's softmax then spans the same slots whatever the
    scheduler, so its bits do not depend on it)."""
    phases = 1 if spec.batch_invariant else spec.decode_phases
    return phase_widths(new_bucket, max_new_tokens, phases=phases)


@flax.struct.dataclass
class SampleResult:
    """Completions, rows prompt-major ([B * n, T_new] with T_new = max_new_tokens).

    tokens            int32  completion tokens; `pad_id` after a row ends
    logprobs          f32    policy log p(token | prefix), temperature 1, unfiltered; 0 off mask
    sampling_logprobs f32    log-prob under the tempered, filtered sampling distribution; 0 off mask
    mask              bool   True on generated tokens (EOS and stop-sequence tokens included)
    lengths           int32  [B * n] number of generated tokens
    finish_reason     int32  [B * n] FINISH_LENGTH (0), FINISH_EOS (1) or FINISH_STOP (2)
    decode_steps      int32  [] decode forward steps the loop ran (token 0 comes from the prefill)
    live_row_steps    int32  [] (row, step) pairs of those steps that decoded a running row
    slots             int    rows each decode step computes (static: B * n), not a pytree leaf
    slot_steps        int32  [] row-steps computed: decode_steps * slots, less after a drain
                             (`rljax.sampling.continuous`)
    preemptions       int32  [] paged layout: rows preempted when the page pool ran out (else 0)
    peak_pages        int32  [] paged layout: the most pages in use at once (else 0)
    free_pages        int32  [] paged layout: free pages when the loop ended (all of them: no leak)
    routes            int8/16 [B * n, T_new, L, k] with `record_routes` (an MoE model): each completion
                             token's experts per layer, as the decode step that fed it computed them;
                             -1 off the mask and on a row's last token when no later step fed it
                             (it scores nothing). None otherwise.
    prompt_routes     int8/16 [B * n, P, L, k] with `record_routes`: the prefill's experts of each
                             prompt token (the left-padded prompt the sampler ran; -1 on padding)

    Occupancy = live_row_steps / slot_steps; the rest of the decode compute went to
    rows that had ended (or, continuous, to empty slots).
    """

    tokens: jax.Array
    logprobs: jax.Array
    sampling_logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array
    finish_reason: jax.Array
    decode_steps: jax.Array
    live_row_steps: jax.Array
    slots: int = flax.struct.field(pytree_node=False, default=0)
    slot_steps: jax.Array | int = 0
    preemptions: jax.Array | int = 0
    peak_pages: jax.Array | int = 0
    free_pages: jax.Array | int = 0
    routes: jax.Array | None = None
    prompt_routes: jax.Array | None = None


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
    row_keys_b: jax.Array  # fold_in(key, row) per row
    scalars: Any  # (temperature, top_p, min_p) traced scalars
    live_row_steps: jax.Array  # running rows summed over decode steps
    # routing record (`record_routes`, an MoE model; else None: no buffer in the carry)
    routes_bnlk: Any = None  # completion token j's experts, written by the step that feeds it
    prompt_routes_bplk: Any = None  # the prefill's, per prompt (not per sample)


def row_keys(key, rows: int, offset=0):
    """Each row's own key, fold_in(key, row) (see the module docstring), for rows [offset,
    offset + rows): a device that decodes a share of the rows (`rljax.sampling.row_shards`) gives
    its first row's index, so a row's key does not depend on the device count."""
    rows_r = offset + jnp.arange(rows, dtype=jnp.int32)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows_r)


def draw(logits_bv, row_keys_b, row_b, step_b, scalars, spec: StaticControls):
    """Token `step_b` of rows `row_b` from `logits_bv`: (tokens_b, policy logp_b, sampling logp_b).

    The policy log-prob is the trainer's `logprobs_from_logits` on the raw logits; the token is
    drawn from the tempered, filtered distribution after `spec.logits_processor`. With
    `spec.draw == "one_pass"` (and no processor) `rljax.sampling.one_pass` draws the same law and
    returns the same log-probs in two passes over the vocabulary; this function is its reference."""
    temperature, top_p, min_p = scalars
    if spec.draw == "one_pass" and spec.logits_processor is None:
        return draw_one_pass(row_uniforms(row_keys_b, step_b), logits_bv, temperature, top_p, min_p,
                             filters=spec.filters)
    z_bv = logits_bv if spec.logits_processor is None else spec.logits_processor(logits_bv, row_b, step_b)
    u_b = row_uniforms(row_keys_b, step_b)
    tok_b, slp_b = sample_logits_from_uniforms(u_b, z_bv, temperature, top_p, min_p, filters=spec.filters)
    logp_b = logprobs_from_logits(logits_bv[:, None, :], tok_b[:, None])[0][:, 0]
    return tok_b, logp_b, slp_b


def stop_flags(window_bl, tok_b, live_b, spec: StaticControls):
    """(window, hit_eos_b, hit_stop_b) after appending `tok_b` to each row's stop window."""
    window = jnp.concatenate([window_bl[:, 1:], tok_b[:, None]], axis=1)
    hit_eos = live_b & jnp.isin(tok_b, jnp.asarray(spec.eos_ids or (-1,), jnp.int32))
    hit_stop = jnp.zeros_like(live_b)
    for seq in spec.stop_sequences:
        tail = window[:, window.shape[1] - len(seq):]
        hit_stop |= jnp.all(tail == jnp.asarray(seq, jnp.int32), axis=1)
    return window, hit_eos, hit_stop & live_b & ~hit_eos


def record(state: DecodeState, logits_bv, spec: StaticControls) -> DecodeState:
    """Draws token `step` from `logits_bv`, stores it with its log-probs and updates stop flags."""
    rows = state.last_token_b.shape[0]
    step_b = jnp.full((rows,), state.step, jnp.int32)
    tok_b, logp_b, slp_b = draw(logits_bv, state.row_keys_b, jnp.arange(rows, dtype=jnp.int32), step_b,
                                state.scalars, spec)
    live_b = ~state.done_b
    tok_b = jnp.where(live_b, tok_b, spec.pad_id)
    col = (0, state.step)
    put = lambda buf, x: jax.lax.dynamic_update_slice(buf, x[:, None].astype(buf.dtype), col)
    tokens = put(state.tokens_bn, tok_b)
    logp = put(state.logp_bn, jnp.where(live_b, logp_b, 0.0))
    slp = put(state.sampling_logp_bn, jnp.where(live_b, slp_b, 0.0))
    window, hit_eos, hit_stop = stop_flags(state.window_bl, tok_b, live_b, spec)
    finish = jnp.where(hit_eos, FINISH_EOS, jnp.where(hit_stop, FINISH_STOP, state.finish_b))
    return state.replace(
        last_token_b=tok_b, tokens_bn=tokens, logp_bn=logp, sampling_logp_bn=slp,
        done_b=state.done_b | hit_eos | hit_stop, length_b=state.length_b + live_b, finish_b=finish.astype(jnp.int32),
        window_bl=window, step=state.step + 1)


def one_row_at_a_time(fn, *row_args, shared=()):
    """`fn(*rows, *shared)` computed for each row alone (`lax.map` over the leading axis), so
    each row's arithmetic is the same whatever batch it sits in: XLA:CPU picks matmul kernels by
    the row count, and two kernels can round the same row differently in the last bit. The
    sampler's batch-invariant mode uses it; it reads the weights once per row, so it is slow."""
    def one(rows):
        out = fn(*jax.tree.map(lambda x: x[None], rows), *shared)
        return jax.tree.map(lambda x: x[0] if getattr(x, "ndim", 0) else x, out)
    return jax.lax.map(one, row_args)


def records_routes(cfg: ModelConfig, spec: StaticControls) -> bool:
    """Whether the sampler records routes: `spec.record_routes` on a model with MoE layers."""
    return spec.record_routes and cfg.moe is not None


def step_forward(cfg: ModelConfig, layer_params, tokens_b, positions_b, live_b, cache, rope_cos_sin, *,
                 batch_invariant: bool, record_routes: bool = False):
    """One decode step: logits [B, V] for the tokens `tokens_b` at `positions_b`, and the cache
    with their keys and values appended (each row at the cache's index: a scalar, or one per row).
    `record_routes` (an MoE model) appends the fed tokens' experts per layer, int32 [B, L, k]."""
    if record_routes and not batch_invariant:
        h_b1d, cache, routes_lb1k = hidden_states(cfg, layer_params, tokens_b[:, None], positions_b[:, None],
                                                  live_b[:, None], cache, rope_cos_sin=rope_cos_sin, return_routes=True)
        return logits_from_hidden(cfg, layer_params, h_b1d)[:, 0], cache, routes_lb1k[:, :, 0].swapaxes(0, 1)
    if not batch_invariant:
        logits_b1v, cache = forward(cfg, layer_params, tokens_b[:, None], positions_b[:, None], live_b[:, None],
                                    cache, rope_cos_sin=rope_cos_sin)
        return logits_b1v[:, 0], cache
    index = cache["index"]
    per_row = jnp.ndim(index) == 1
    # Per-row rotary tables [B, W, H] (image prompts' M-RoPE) go with their rows; a 1D table is shared.
    row_rope = rope_cos_sin if rope_cos_sin is not None and rope_cos_sin[0].ndim == 3 else None
    rows = (tokens_b, positions_b, live_b, cache["layers"], cache["pos"], row_rope) + ((index,) if per_row else ())

    def one(tok, pos, live, layers, kpos, rope, *row_index):
        row_cache = {"layers": layers, "pos": kpos, "index": row_index[0] if per_row else index}
        out = step_forward(cfg, layer_params, tok, pos, live, row_cache, rope_cos_sin if rope is None else rope,
                           batch_invariant=False, record_routes=record_routes)
        return (out[0], out[1]["layers"], out[1]["pos"]) + out[2:]

    logits_bv, layers, kpos, *routes = one_row_at_a_time(one, *rows)
    return (logits_bv, {"layers": layers, "pos": kpos, "index": index + 1}, *routes)


def stored_prompt_cache(cfg: ModelConfig, cache, spec: StaticControls):
    """A prompt's prefilled cache as the sampler stores it: unchanged, or with `kv_dtype = "fp8"`
    its keys and values quantised to float8_e4m3fn with per-token scales (`rljax.models.fp8`).
    Every path that prefills a cache to decode from (static, multi-turn, interruptible's swap)
    goes through it; the tokens fed afterwards are quantised where the cached forward writes them."""
    if spec.kv_dtype != "fp8":
        return cache
    return dict(cache, layers=quantize_cache_layers(cache["layers"], key_cache_layout(cfg)))


def prompt_forward(cfg: ModelConfig, params, prompt_bt, mask_bt, *, batch_invariant: bool = False,
                   record_routes: bool = False, chunk: int = 0):
    """The prompts' forward pass: (a KV cache of P slots, the logits after the last real token
    [B, V]). Both schedulers prefill with it; `batch_invariant` runs one prompt at a time.
    `record_routes` (an MoE model) appends the prompt tokens' experts per layer, [B, P, L, k] in
    `route_dtype` (-1 on padding). `chunk` > 0 (`sampling.prefill_chunk`) runs a prompt bucket
    longer than it `chunk` slots at a time (`rljax.sampling.chunked_prefill`; not with
    `record_routes`, whose record comes from the one-pass forward)."""
    if batch_invariant:
        cache, logits_bv, *routes = one_row_at_a_time(
            lambda t, m: prompt_forward(cfg, params, t, m, record_routes=record_routes, chunk=chunk), prompt_bt,
            mask_bt)
        return (dict(cache, index=jnp.asarray(prompt_bt.shape[1], jnp.int32)), logits_bv, *routes)
    p = prompt_bt.shape[1]
    if 0 < chunk < p and not record_routes:
        return chunked_prompt_forward(cfg, params, prompt_bt, mask_bt, chunk)
    h_btd, cache, *routes = prefill_cache(cfg, params, prompt_bt, mask_bt, return_routes=record_routes)
    last_b = p - 1 - jnp.argmax(jnp.flip(mask_bt, axis=1), axis=1)  # last real token (any padding)
    h_b1d = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)
    out = (cache, logits_from_hidden(cfg, params, h_b1d)[:, 0])
    if not record_routes:
        return out
    routes_bplk = routes[0].transpose(1, 2, 0, 3)
    return out + (jnp.where(mask_bt[:, :, None, None], routes_bplk, -1).astype(route_dtype(cfg)),)


def prefill(cfg: ModelConfig, params, prompt_bt, mask_bt, key, max_new, scalars, *, spec: StaticControls,
            num_samples: int, new_bucket: int, rows=None, prompt=None) -> DecodeState:
    """Prefills B prompts once, broadcasts the cache to B * n rows and draws token 0.

    `max_new` (int32) and `scalars` (temperature, top_p, min_p) are traced; `new_bucket` sizes the
    token buffers. `rows` (traced int32), when given, is the number of real rows: the rows after
    it (padding prompts, so that a batch bucket compiles once) start stopped and draw nothing.
    `prompt`, when given, is the prompts' (cache, last logits) computed by the caller instead of
    `prompt_forward` (image prompts: `rljax.sampling.vision`)."""
    b, p = prompt_bt.shape
    bn = b * num_samples
    recording = records_routes(cfg, spec)
    if prompt is None:
        prompt = prompt_forward(cfg, params, prompt_bt, mask_bt, batch_invariant=spec.batch_invariant,
                                record_routes=recording, chunk=spec.prefill_chunk)
    cache, logits_bv, *prompt_routes = prompt
    cache = stored_prompt_cache(cfg, cache, spec)

    cache = jax.tree.map(lambda x: jnp.repeat(x, num_samples, axis=0) if x.ndim else x, cache)
    cache = pad_slots(cfg, cache, decode_widths(spec, new_bucket)[0])  # the first phase
    window = max([len(s) for s in spec.stop_sequences], default=1)
    state = DecodeState(
        cache=cache,
        last_token_b=jnp.zeros((bn,), jnp.int32),
        next_pos_b=jnp.repeat(jnp.sum(mask_bt, axis=1, dtype=jnp.int32), num_samples),
        tokens_bn=jnp.full((bn, new_bucket), spec.pad_id, jnp.int32),
        logp_bn=jnp.zeros((bn, new_bucket), jnp.float32),
        sampling_logp_bn=jnp.zeros((bn, new_bucket), jnp.float32),
        done_b=jnp.zeros((bn,), bool) if rows is None else jnp.arange(bn) >= rows,
        length_b=jnp.zeros((bn,), jnp.int32),
        finish_b=jnp.full((bn,), FINISH_LENGTH, jnp.int32),
        window_bl=jnp.full((bn, window), -1, jnp.int32),
        step=jnp.zeros((), jnp.int32), max_new=max_new, row_keys_b=row_keys(key, bn), scalars=scalars,
        live_row_steps=jnp.zeros((), jnp.int32),
        routes_bnlk=jnp.full((bn, new_bucket, *route_layers(cfg)), -1, route_dtype(cfg)) if recording
        else None,
        prompt_routes_bplk=prompt_routes[0] if recording and prompt_routes else None)
    return record(state, jnp.repeat(logits_bv, num_samples, axis=0), spec)


def pad_slots(cfg: ModelConfig, cache, extra: int):
    """Appends `extra` empty slots to every cache buffer (keys and values 0, positions -1)."""
    axes = cache_slot_axes(cfg)
    def pad(x, slot_axis, fill):
        widths = [(0, 0)] * x.ndim
        widths[slot_axis] = (0, extra)
        return jnp.pad(x, widths, constant_values=fill)

    return {"layers": tuple({name: pad(c, axes[name], 0) for name, c in lc.items()}
                            for lc in cache["layers"]),
            "pos": pad(cache["pos"], 1, -1), "index": cache["index"]}


def widen(cfg: ModelConfig, state: DecodeState, extra: int) -> DecodeState:
    """The next decode phase's state: the cache grown by `extra` slots."""
    return state.replace(cache=pad_slots(cfg, state.cache, extra))


def decode(cfg: ModelConfig, params, state: DecodeState, limit, *, spec: StaticControls,
           rope_cos_sin=None) -> DecodeState:
    """Decodes until `min(limit, max_new)` tokens are drawn or every row has stopped. The caller
    keeps `limit` within the cache: a cache of P + w slots can draw tokens up to index w - 1.
    `rope_cos_sin`: per-row rotary tables by position (an image prompt's M-RoPE continuation,
    `rljax.models.mrope.mrope_table`); default the 1D table."""
    layer_params = unstack_layers(params, cfg)  # a no-op when the caller split them (generate, sample)
    # A token's position counts real tokens only, so it is at most its slot: the table covers all.
    if rope_cos_sin is None:
        rope_cos_sin = rope_table(cfg, state.cache["pos"].shape[1])
    stop_at = jnp.minimum(limit, state.max_new)
    recording = records_routes(cfg, spec)

    def cond(s: DecodeState):
        return (s.step < stop_at) & ~jnp.all(s.done_b)

    def body(s: DecodeState):
        ones_b = jnp.ones(s.last_token_b.shape, bool)
        logits_bv, cache, *routes = step_forward(cfg, layer_params, s.last_token_b, s.next_pos_b, ones_b, s.cache,
                                                 rope_cos_sin, batch_invariant=spec.batch_invariant,
                                                 record_routes=recording)
        if recording:  # the fed token is completion token step - 1
            col = (0, s.step - 1, 0, 0)
            s = s.replace(routes_bnlk=jax.lax.dynamic_update_slice(
                s.routes_bnlk, routes[0][:, None].astype(s.routes_bnlk.dtype), col))
        s = s.replace(cache=cache, next_pos_b=s.next_pos_b + 1,
                      live_row_steps=s.live_row_steps + jnp.sum(~s.done_b, dtype=jnp.int32))
        return record(s, logits_bv, spec)

    chunk = spec.decode_chunk
    if chunk > 1:
        # Whole chunks of `chunk` steps with a fixed trip count (no per-step predicate for the host
        # to read: a GPU while loop copies it back every iteration), "every row done" tested once
        # per chunk; rows that end inside a chunk record padding for its remaining steps, as they
        # do while other rows run. The steps before `stop_at` that do not fill a chunk run one at
        # a time (the loop below), so no step passes it. Same tokens and log-probs;
        # `decode_steps` then counts the padding steps of a chunk too.
        full = lambda s: (s.step + chunk <= stop_at) & ~jnp.all(s.done_b)
        state = jax.lax.while_loop(full, lambda s: jax.lax.fori_loop(0, chunk, lambda _, x: body(x), s), state)
    return jax.lax.while_loop(cond, body, state)


def to_result(state: DecodeState, *, width: int) -> SampleResult:
    """The first `width` (= max_new_tokens) columns of the decode buffers as a `SampleResult`."""
    mask = jnp.arange(width)[None, :] < state.length_b[:, None]
    routes = prompt_routes = None
    if state.routes_bnlk is not None:
        routes = jnp.where(mask[:, :, None, None], state.routes_bnlk[:, :width], -1).astype(state.routes_bnlk.dtype)
    if state.prompt_routes_bplk is not None:
        rows = state.length_b.shape[0]
        prompt_routes = jnp.repeat(state.prompt_routes_bplk, rows // state.prompt_routes_bplk.shape[0], axis=0)
    return SampleResult(routes=routes, prompt_routes=prompt_routes,
                        tokens=state.tokens_bn[:, :width], logprobs=state.logp_bn[:, :width],
                        sampling_logprobs=state.sampling_logp_bn[:, :width], mask=mask,
                        lengths=state.length_b, finish_reason=state.finish_b, decode_steps=state.step - 1,
                        live_row_steps=state.live_row_steps, slots=state.length_b.shape[0],
                        slot_steps=(state.step - 1) * state.length_b.shape[0])


def decode_phases(cfg: ModelConfig, params, state: DecodeState, *, spec: StaticControls, new_bucket: int,
                  max_new_tokens: int | None = None, decode=decode, widen=widen) -> DecodeState:
    """Runs every decode phase (see the module docstring): decode to the cache's width, widen, go
    on. Traceable; `max_new_tokens`, when known statically, drops the phases it cannot reach."""
    widths = decode_widths(spec, new_bucket, max_new_tokens)
    for i, width in enumerate(widths):
        if i:
            state = widen(cfg, state, width - widths[i - 1])
        state = decode(cfg, params, state, np.int32(width), spec=spec)
    return state


def sample_static(cfg: ModelConfig, params, prompt_bt, mask_bt, key, max_new, scalars, rows, *,
                  spec: StaticControls, num_samples: int, new_bucket: int, prompt=None,
                  prompt_rope=None) -> SampleResult:
    """The static scheduler as one traceable function: prefill, every decode phase and the result
    at the bucket's width (`max_new` and the number of real `rows` are traced, so one compile
    serves a batch bucket and a length bucket; trim with `rljax.sampling.continuous.trim`).
    `prompt` (the prompts' (cache, last logits), see `prefill`) and `prompt_rope` (per-prompt
    rotary tables [B, P + new_bucket, H] by mask position, repeated here for the n samples) are
    the image prompts' hooks (`rljax.sampling.vision`); None for text."""
    params = unstack_layers(params, cfg)  # once, for the prefill and every decode phase
    state = prefill(cfg, params, prompt_bt, mask_bt, key, max_new, scalars, spec=spec, num_samples=num_samples,
                    new_bucket=new_bucket, rows=rows, prompt=prompt)
    step = decode
    if prompt_rope is not None:
        step = functools.partial(decode, rope_cos_sin=tuple(jnp.repeat(t, num_samples, axis=0) for t in prompt_rope))
    return to_result(decode_phases(cfg, params, state, spec=spec, new_bucket=new_bucket, decode=step),
                     width=new_bucket)
