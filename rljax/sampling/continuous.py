"""Continuous batching: a fixed number of decode slots, each refilled with the next pending row
as soon as its row ends, all inside one compiled `while_loop`.

RL completions are long-tailed: most end early, a few run to the limit. The static loop
(`rljax.sampling.decode`) decodes a batch until its longest row ends, so most of its row-steps go
to rows that have already finished. Here the batch is a set of S slots:

    prompts  -> prompt pool: prompts are prefilled in batches (all up front, or `prefill_batch`
                at a time inside the loop, into a ring of 2 x prefill_batch entries, as the rows
                being admitted need them). A prompt is prefilled once for its n samples.
    loop while a slot is running or a row is pending:
        [prefill]  the next prefill_batch prompts into the ring, when the admitted rows have
                   reached the last batch (a `lax.cond`; only with prefill_batch > 0)
        admit      up to `refill_batch` pending rows, in input order, into free slots: copy the
                   prompt's KV from the pool into the slot (slots [0, P)), mark the slot's
                   generated region empty (positions -1), draw token 0 from the pool's logits
        decode     one forward step over all S slots; each running slot draws its next token
                   and writes it, with its log-probs, into its row of the output buffers

The pool, the layout (`SlotLayout`) and the token-drawing halves of admit and decode are shared
with the paged layout and live in `rljax.sampling.slots`; this module owns the slot caches.

Why this shape. Admission costs a copy of P prompt slots per admitted row and no forward pass:
the prompt's forward ran once in the pool, however many samples and slots use it (the group
sharing the static sampler does by broadcasting its prefill). Copying rather than pointing at the
pool keeps each slot a plain contiguous cache, so the decode step is the model's own cached
forward with a per-row write index (`rljax.models` accepts an index per row). The copy is
P / (P + N) of a slot and happens once per row.

Isolation. A slot's new row never sees its previous occupant: admission rewrites every key
position of the slot (the prompt's positions, then -1 on the generated region), and attention
ignores keys at position -1, so the old keys and values that stay in memory are invisible.

Same tokens as static. Row r draws token t from the uniform of fold_in(fold_in(key, r), t) and
sees only its own prompt and tokens, so which slot decodes it, and when, changes nothing: the
tokens, log-probs, masks and finish reasons equal the static scheduler's for any slot count
(tests/sampling/test_continuous.py checks it bitwise on CPU). On backends whose matmul kernels depend on
the batch size the per-row logits can differ in the last bit; `slots = rows` then reproduces
static batching's shapes.

Drain. Once no row is pending, slots empty one by one while the longest rows finish, and every
step still computes all S slots. So from 16 slots up, when at most S / 4 slots are running and
nothing is pending, the running slots move (one gather) into a cache of S / 4 slots and a second
loop decodes them there: the tail costs a quarter per step. Row arithmetic is per row, so with
`batch_invariant` the result is unchanged bitwise.

Memory. The KV cache holds S x (P + N) tokens (P, N the prompt and new-token buckets) plus the
pool's G x P; `max_total_tokens` sets S = max_total_tokens // (P + N), rather than holding
rows x (P + N) as static batching does. With `kv_dtype = "fp8"` the pool and the slots hold
float8_e4m3fn keys and values with one f32 scale per (row, kv head, slot), the static sampler's
scheme (`rljax.models.fp8`): the pool's prompts are quantised after their prefill, admission
copies values and scales alike, and the model's forward quantises each fed token where it writes
it, so the tokens equal the static FP8 sampler's.

Shapes and compiles. Prompts are padded to a bucket of prompts (`generate` pads the count to a
power of two) and the number of real rows is traced, so a run compiles once per (prompt bucket,
length buckets, n, S, prefill_batch, refill_batch, static controls), whatever the number of
pending rows within a bucket.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from rljax.errors import ConfigError
from rljax.models import ModelConfig, cache_slot_axes, init_cache, rope_table, unstack_layers
from rljax.sampling.controls import SampleControls, StaticControls
from rljax.sampling.decode import SampleResult, bucket_length, row_keys, step_forward
from rljax.sampling.slots import (PromptPool, SlotLayout, admit_rows, empty_kv_layers, empty_pool, empty_routes,
                                  empty_slots, kv_bytes_per_token, pool_while, prefill_into_pool, record_slot_routes,
                                  record_step, routes_result, slot_result)
from rljax.sampling.slots import slot_rope


@flax.struct.dataclass
class SlotState:
    """What the continuous loop carries (donated between iterations)."""

    cache: Any  # the slots' KV cache: [S, ..., P + N] with a per-slot write index
    row_s: jax.Array  # the row each slot decodes
    step_s: jax.Array  # tokens drawn for that row
    live_s: jax.Array  # the slot's row is still running
    last_token_s: jax.Array
    next_pos_s: jax.Array
    window_sl: jax.Array  # the last L tokens, for stop sequences
    tokens_rn: jax.Array  # outputs, rows in input order
    logp_rn: jax.Array
    sampling_logp_rn: jax.Array
    length_r: jax.Array
    finish_r: jax.Array
    next_row: jax.Array  # rows admitted so far
    pool: PromptPool
    decode_steps: jax.Array
    live_row_steps: jax.Array
    routes_rnlk: Any = None  # `record_routes`: completion token j's experts, written by the step that feeds it


# The drain (see the module docstring): once no row is pending and at most slots / 4 are running,
# the running slots move into a cache of slots / 4 and decode there. Only from 16 slots up: below,
# a second compiled loop costs more than the tail it shortens.
DRAIN_FRACTION = 4
DRAIN_MIN_SLOTS = 16


def token_budget(controls: SampleControls, cfg: ModelConfig | None) -> tuple[int, str, int]:
    """The KV budget in tokens (0: none), how an error names it, and its unit: `max_total_tokens`
    (unit 1 token), or `kv_cache_bytes` // u with u = `kv_bytes_per_token(cfg, kv_dtype)` (unit u
    bytes a token)."""
    if not controls.kv_cache_bytes:
        return controls.max_total_tokens, f"max_total_tokens={controls.max_total_tokens}", 1
    per_token = kv_bytes_per_token(cfg, controls.kv_dtype)
    return (controls.kv_cache_bytes // per_token, f"kv_cache_bytes={controls.kv_cache_bytes} ({per_token} bytes "
            f"a token with kv_dtype={controls.kv_dtype!r})", per_token)


def plan_layout(controls: SampleControls, num_prompts: int, prompt_len: int, cfg: ModelConfig | None = None
                ) -> SlotLayout:
    """Slots, refill and prefill sizes for `num_prompts` prompts of (bucketed) length `prompt_len`.

    With M = the token budget (`token_budget`: max_total_tokens, or kv_cache_bytes over the bytes
    a token takes in `cfg`'s cache): S = slots if set, else M // (P + N) if M is set, else
    min(rows, 64); at most the rows. Paged (`kv_layout="paged"`): M // page_size pages, and
    S = slots or min(rows, 64) whatever the budget, since pages are taken only as rows grow.
    """
    rows = num_prompts * controls.num_samples
    new_bucket = bucket_length(controls.max_new_tokens)
    per_slot = prompt_len + new_bucket
    slots = controls.slots
    num_pages = 0
    budget, named, unit = token_budget(controls, cfg)
    if controls.kv_layout == "paged":
        page = controls.page_size
        num_pages = budget // page
        need = max(-(-per_slot // page), -(-prompt_len // page) + 1)  # one row alone always fits
        if num_pages < need:
            raise ConfigError(f"sampling: {named} holds {num_pages} pages of {page} tokens, and one row (prompt "
                              f"bucket {prompt_len} + new-token bucket {new_bucket}) needs {need}; raise it to "
                              f"at least {need * page * unit}")
    elif budget or controls.kv_cache_bytes:
        fit = budget // per_slot
        if fit < 1:
            raise ConfigError(f"sampling: {named} holds no slot of {per_slot} tokens (prompt bucket {prompt_len} + "
                              f"new-token bucket {new_bucket}); raise it to at least {per_slot * unit}")
        slots = min(slots, fit) if slots else fit
    slots = min(slots or 64, rows)
    refill = min(controls.refill_batch or max(1, slots // 4), slots)
    prefill_batch = controls.prefill_batch if 0 < controls.prefill_batch < num_prompts else 0
    drain = slots // DRAIN_FRACTION if slots >= DRAIN_MIN_SLOTS and controls.kv_layout == "slots" else 0
    return SlotLayout(slots=slots, refill=refill, prefill_batch=prefill_batch, num_samples=controls.num_samples,
                      new_bucket=new_bucket, kv_layout=controls.kv_layout, page_size=controls.page_size,
                      num_pages=num_pages, drain_slots=drain)


def _reset_positions(pos_sl, slot_tgt, prompt_pos_ap):
    """Key positions of the slots `slot_tgt` for their new rows: the prompt's on [0, P) and -1
    (empty, never attended) on the generated region, which still holds the previous row's keys."""
    new_slots = pos_sl.shape[1] - prompt_pos_ap.shape[1]
    fresh = jnp.concatenate([prompt_pos_ap, jnp.full((prompt_pos_ap.shape[0], new_slots), -1, jnp.int32)], axis=1)
    return pos_sl.at[slot_tgt].set(fresh, mode="drop")


def _admit(cfg: ModelConfig, state: SlotState, row_keys_r, num_rows, max_new, scalars, *, spec: StaticControls,
           layout: SlotLayout) -> SlotState:
    """Moves up to `layout.refill` pending rows, in input order, into free slots and draws their
    token 0 from the pool's logits (see the module docstring)."""
    s_count, a_count = layout.slots, layout.refill
    pool = state.pool
    entries, prompt_len = pool.pos_gp.shape
    rows_total = state.length_r.shape[0]
    free_s = ~state.live_s
    a = jnp.arange(a_count, dtype=jnp.int32)
    slot_a = jnp.searchsorted(jnp.cumsum(free_s, dtype=jnp.int32), a + 1).astype(jnp.int32)  # the a-th free slot
    row_a = state.next_row + a
    prompt_a = row_a // layout.num_samples
    ok_a = (a < jnp.sum(free_s, dtype=jnp.int32)) & (row_a < num_rows) & (prompt_a < pool.prefilled)
    slot_tgt = jnp.where(ok_a, slot_a, s_count)  # out of range: dropped by the scatters
    row_tgt = jnp.where(ok_a, row_a, rows_total)
    entry_a = prompt_a % entries
    row_safe = jnp.minimum(row_a, rows_total - 1)

    def copy_prompt(buf, pooled, name):  # the prompt's P slots of one layer's keys or values
        axis = cache_slot_axes(cfg)[name]
        index = (slot_tgt,) + (slice(None),) * (axis - 1) + (slice(0, prompt_len),)
        return buf.at[index].set(pooled[entry_a], mode="drop")

    cache = state.cache
    layers = tuple({name: copy_prompt(lc[name], pc[name], name) for name in lc}
                   for lc, pc in zip(cache["layers"], pool.layers))
    cache = {"layers": layers, "pos": _reset_positions(cache["pos"], slot_tgt, pool.pos_gp[entry_a]),
             "index": cache["index"].at[slot_tgt].set(prompt_len, mode="drop")}
    state, _ = admit_rows(state, pool.logits_gv[entry_a], row_keys_r[row_safe], row_a, pool.next_pos_g[entry_a], ok_a,
                          slot_tgt, row_tgt, max_new, scalars, spec)
    return state.replace(cache=cache, next_row=state.next_row + jnp.sum(ok_a, dtype=jnp.int32))


def _decode_step(cfg: ModelConfig, layer_params, state: SlotState, row_keys_r, max_new, scalars, rope_cos_sin,
                 *, spec: StaticControls, num_samples: int = 1) -> SlotState:
    """One forward step over every slot; running slots draw and record their next token
    (per-prompt rotary tables: each slot's prompt's, `slot_rope`)."""
    live_s = state.live_s
    recording = state.routes_rnlk is not None
    logits_sv, cache, *routes = step_forward(cfg, layer_params, state.last_token_s, state.next_pos_s, live_s,
                                             state.cache, slot_rope(rope_cos_sin, state.row_s, num_samples),
                                             batch_invariant=spec.batch_invariant,
                                             record_routes=recording)
    cache = dict(cache, index=jnp.where(live_s, cache["index"], state.cache["index"]))  # idle slots stay put
    if recording:  # a running slot fed its row's token step - 1
        state = record_slot_routes(state, routes[0])
    state, _ = record_step(state, logits_sv, row_keys_r, max_new, scalars, spec)
    return state.replace(cache=cache)


def sample_continuous(cfg: ModelConfig, params, prompt_bp, mask_bp, key, max_new, scalars, num_rows, *,
                      prompt=None, prompt_rope=None,
                      spec: StaticControls, layout: SlotLayout, row_offset=0) -> SampleResult:
    """Traceable continuous-batching sampler: B left-padded prompts -> B * n completions, rows
    prompt-major (row i * n + j is sample j of prompt i), as `rljax.sampling.sample` returns.

    `num_rows` (traced int32, <= B * n) is how many rows are real: rows from there on (padding
    prompts) are never decoded and come back empty. `max_new` and `scalars` are traced as in the
    static sampler; `layout` (see `plan_layout`) and `spec` are static. The result has
    `layout.new_bucket` columns; the callers keep the first max_new_tokens.
    This is the slot layout; `layout.kv_layout == "paged"` runs the same loop over a paged cache,
    `rljax.sampling.paged.sample_paged` (the callers pick: neither module imports the other).
    Image prompts (`rljax.sampling.vision`): `prompt` is the B prompts' (cache, last logits) from
    the spliced prefill, which fills the pool up front (no in-loop prefill), and `prompt_rope`
    their M-RoPE tables [B, P + N, H]; a slot decodes with its prompt's (`slot_rope`).
    """
    if layout.kv_layout != "slots":
        raise ValueError(f"sample_continuous decodes the slot layout, got kv_layout={layout.kv_layout!r}; "
                         "use rljax.sampling.paged.sample_paged")
    layer_params = unstack_layers(params, cfg)
    mask_bp = mask_bp.astype(bool)
    b, prompt_len = prompt_bp.shape
    n, s_count, new_bucket = layout.num_samples, layout.slots, layout.new_bucket
    rows_total = b * n
    batch = 0 if prompt is not None else layout.prefill_batch
    if batch and b % batch:  # whole prefill batches: pad with one-token prompts that are never admitted
        extra = batch - b % batch
        prompt_bp = jnp.pad(prompt_bp, ((0, extra), (0, 0)))
        mask_bp = jnp.pad(mask_bp, ((0, extra), (0, 0))).at[b:, -1].set(True)
    num_prompts = prompt_bp.shape[0]

    entries = 2 * batch if batch else num_prompts
    pool = empty_pool(cfg, entries, prompt_len, spec.kv_dtype)
    if not batch:
        pool = prefill_into_pool(cfg, layer_params, pool, prompt_bp, mask_bp, num_prompts,
                                  batch_invariant=spec.batch_invariant, prompt=prompt, chunk=spec.prefill_chunk)
    slot_len = prompt_len + new_bucket
    cache = dict(init_cache(cfg, s_count, slot_len), index=jnp.zeros((s_count,), jnp.int32))
    cache["layers"] = empty_kv_layers(cfg, cache["layers"], spec.kv_dtype)  # FP8: the model's forward
    # then quantises each fed token's keys and values where it writes them (`rljax.models.fp8`)
    routes = empty_routes(cfg, spec, rows_total, new_bucket)
    state = empty_slots(SlotState, spec, s_count, rows_total, new_bucket, cache=cache,
                        next_row=jnp.zeros((), jnp.int32), pool=pool, routes_rnlk=routes)
    keys_r = row_keys(key, rows_total, row_offset)  # row_offset: this device's first row (row_shards)
    rope_cos_sin = rope_table(cfg, slot_len)
    rope_cos_sin = rope_cos_sin if prompt_rope is None else prompt_rope
    num_rows = jnp.minimum(jnp.asarray(num_rows, jnp.int32), rows_total)
    prompts_needed = (num_rows + n - 1) // n

    def maybe_prefill(st: SlotState) -> SlotState:
        # The cond carries only the pool: a cond over the whole state can copy the slots' cache.
        need = (st.pool.prefilled < prompts_needed) & (st.next_row // n >= st.pool.prefilled - batch)
        fill = lambda pool: prefill_into_pool(cfg, layer_params, pool, prompt_bp, mask_bp, batch,
                                               batch_invariant=spec.batch_invariant, chunk=spec.prefill_chunk)
        return st.replace(pool=jax.lax.cond(need, fill, lambda pool: pool, st.pool))

    def cond(st: SlotState):
        return jnp.any(st.live_s) | (st.next_row < num_rows)

    def body(st: SlotState) -> SlotState:
        if batch:
            st = maybe_prefill(st)
        # Admission runs every step, with its scatters dropped when no slot is free: its cost is
        # `refill` prompt copies, and skipping it with a cond would pass the whole cache through.
        st = _admit(cfg, st, keys_r, num_rows, max_new, scalars, spec=spec, layout=layout)
        return _decode_step(cfg, layer_params, st, keys_r, max_new, scalars, rope_cos_sin, spec=spec,
                            num_samples=n)

    drain = layout.drain_slots
    if drain:
        cond = lambda st: (st.next_row < num_rows) | (jnp.sum(st.live_s, dtype=jnp.int32) > drain)
    state = pool_while(layout.pool_axes, cond, body, state)
    slot_steps = state.decode_steps * s_count
    if drain:
        main_steps = state.decode_steps
        state = pool_while(
            layout.pool_axes, lambda st: jnp.any(st.live_s),
            lambda st: _decode_step(cfg, layer_params, st, keys_r, max_new, scalars, rope_cos_sin, spec=spec,
                                    num_samples=n),
            _keep_slots(state, drain))
        slot_steps += (state.decode_steps - main_steps) * drain
    result = slot_result(state, s_count, slot_steps)
    if routes is None:
        return result
    return routes_result(cfg, layer_params, result, state.routes_rnlk, prompt_bp[:b], mask_bp[:b], n)


def _keep_slots(state: SlotState, count: int) -> SlotState:
    """The state with only `count` slots: the running ones first (there are at most `count`)."""
    keep = jnp.argsort(~state.live_s, stable=True)[:count]
    take = lambda x: jnp.take(x, keep, axis=0)
    cache = {"layers": jax.tree.map(take, state.cache["layers"]), "pos": take(state.cache["pos"]),
             "index": take(state.cache["index"])}
    return state.replace(cache=cache, row_s=take(state.row_s), step_s=take(state.step_s), live_s=take(state.live_s),
                         last_token_s=take(state.last_token_s), next_pos_s=take(state.next_pos_s),
                         window_sl=take(state.window_sl))


def trim(result: SampleResult, rows: int, width: int) -> SampleResult:
    """The first `rows` rows and `width` (= max_new_tokens) columns of a continuous result."""
    cut = lambda x: x[:rows, :width]
    return result.replace(tokens=cut(result.tokens), logprobs=cut(result.logprobs),
                          sampling_logprobs=cut(result.sampling_logprobs), mask=cut(result.mask),
                          lengths=result.lengths[:rows], finish_reason=result.finish_reason[:rows],
                          routes=None if result.routes is None else cut(result.routes),
                          prompt_routes=None if result.prompt_routes is None else result.prompt_routes[:rows])
