"""Paged KV layout for the continuous scheduler: pages taken as rows grow, shared by a prompt's
samples, handed back when rows end (`SampleControls.kv_layout = "paged"`).

The slot layout (`rljax.sampling.continuous`) reserves bucket(P) + bucket(N) tokens per slot from
the moment a row is admitted, so a budget of T tokens decodes T / (P + N) rows at once, however
short they turn out. Here the budget is a pool of `max_total_tokens // page_size` pages per layer
(the vLLM design: Kwon et al., 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention"), and a row holds only the pages its tokens fill:

    page pool   per layer k, v [K, pages, page_size, H] (the layout of JAX's Pallas kernel)
    page table  per slot: the physical page of each logical page; a row's tokens are contiguous in
                its pages from logical position 0 (the prompt's real tokens only, no padding),
                so token i sits at (table[i // page_size], i % page_size) and a key is valid
                iff i < the row's stored length
    free stack  the free pages; allocation pops, release pushes (fixed-size scatters, in the loop)

    admission   a row is admitted only when its prompt's pages plus one are free. The first
                running row of a prompt copies the prompt's full pages from the prompt pool
                into fresh pages that every running sample of the prompt then points at
                (reference counted); the partly filled last prompt page is copied per row (copy
                on write: each row appends its own tokens there)
    growth      before each decode step, a slot whose length reaches a page boundary pops a page
    exhaustion  when the free pages do not cover them, the most recently admitted running row
                is preempted: its pages go back and the row returns to the head of the queue
                (rows are admitted lowest index first). It restarts from token 0 later and draws
                the same tokens, because row r draws token t from fold_in(fold_in(key, r), t)
    release     a row that ends hands back its own pages, and its prompt's shared pages when it
                was the prompt's last running row

Attention, by backend (`use_pallas_kernel`).
    CPU, GPU  (`gather_forward`) the step gathers each slot's pages into the contiguous slot
              layout's arrangement (prompt right-aligned in [0, P), generated tokens from P,
              positions -1 elsewhere) and runs the model's own cached forward (`step_forward`,
              `cached_attention`). The arithmetic is the slot layout's, so with `batch_invariant`
              the paged tokens and log-probs equal the slot layout's and the static scheduler's
              bitwise. The gathered view is transient but gathered for every layer before the
              step, so the step briefly holds what a slot cache holds; the pages are what
              persists. Also on TPU for sliding-window models and
              in batch-invariant mode and when recording MoE routes (`record_routes`).
    TPU       (`kernel_forward`) each layer writes the fed token into its page and attends over
              the pages in place with JAX's Pallas kernel
              (`jax.experimental.pallas.ops.tpu.paged_attention`, via `tpu_paged_attention` and
              the model's `kv_attend` hook). The kernel runs on CPU under
              `pltpu.force_tpu_interpret_mode()`, where its matmuls round like the TPU's default
              precision; tests/sampling/test_paged.py checks the step against the gather step there. It
              has not run on a TPU here.

Memory. Persistent KV: pages x page_size tokens per layer plus the prompt pool (every prompt
prefilled up front, G x P, as the slot layout's default). `kv_dtype = "fp8"`: the pages hold
float8_e4m3fn with one f32 scale per (kv head, page, offset), i.e. per token as in the static
sampler's cache, copied from the FP8 pool and gathered with their values. The counters report
the peak pages in use and the preemptions, and the free pages at the end (all of them when
nothing leaks).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from rljax.models import ModelConfig, cache_slot_axes, rope_table, unstack_layers
from rljax.models.fp8 import KV_SCALES
from rljax.sampling.controls import StaticControls
from rljax.sampling.decode import SampleResult, row_keys
from rljax.sampling.paged_attention import gather_forward, kernel_forward, use_pallas_kernel
from rljax.sampling.paged_table import PageTable, pop_pages, release_pages
from rljax.sampling.slots import (PromptPool, SlotLayout, admit_rows, empty_pool, empty_routes, empty_slots,
                                  prefill_into_pool, record_slot_routes, record_step, routes_result, slot_result)
from rljax.sampling.slots import pool_while, slot_rope

__all__ = ["PagedState", "PageTable", "gather_forward", "kernel_forward", "sample_paged", "use_pallas_kernel"]


@flax.struct.dataclass
class PagedState:
    """What the paged continuous loop carries: `SlotState` with pages instead of slot caches."""

    kv: Any  # per layer {"k": [K, pages, page, H], "v": [K, pages, page, H]} (FP8: + "k_scale", "v_scale" [..., 1])
    pages: PageTable
    row_s: jax.Array
    step_s: jax.Array
    live_s: jax.Array
    last_token_s: jax.Array
    next_pos_s: jax.Array  # the fed token's position = tokens stored for the row
    window_sl: jax.Array
    tokens_rn: jax.Array
    logp_rn: jax.Array
    sampling_logp_rn: jax.Array
    length_r: jax.Array
    finish_r: jax.Array
    pending_r: jax.Array  # rows waiting for a slot (never admitted, or preempted)
    pool: PromptPool
    decode_steps: jax.Array
    live_row_steps: jax.Array
    routes_rnlk: Any = None  # `record_routes`: completion token j's experts, written by the step that feeds it


def _copy_prompt_pages(cfg: ModelConfig, kv, pool: PromptPool, src_gp, entry_a, target_ak, page_size: int):
    """Writes logical prompt page k of prompt `entry_a` (its real tokens, `src_gp` their pool slots)
    into physical page target_ak[a, k] (out of range: skipped), in every layer."""
    a_count, k_prompt = target_ak.shape
    prompt_len = src_gp.shape[1]
    logical_ako = jnp.arange(k_prompt)[None, :, None] * page_size + jnp.arange(page_size)
    src_ako = src_gp[entry_a[:, None, None], jnp.clip(logical_ako, 0, prompt_len - 1)]
    offset_o = jnp.arange(page_size)[None, None, :]
    entry = entry_a[:, None, None]

    axes = cache_slot_axes(cfg)

    def put(pages, pooled, name):  # pooled k [G, K, H, P] (or [G, K, P, H]), v [G, K, P, H] -> [K, pages, page, H]
        tokens_akokh = pooled[entry, :, :, src_ako] if axes[name] == 3 else pooled[entry, :, src_ako, :]
        return pages.at[:, target_ak[:, :, None], offset_o, :].set(jnp.moveaxis(tokens_akokh, 3, 0), mode="drop")

    return tuple({name: put(lkv[name], lp[name], name) for name in lkv} for lkv, lp in zip(kv, pool.layers))


def _admit(cfg: ModelConfig, state: PagedState, keys_r, max_new, scalars, src_gp, shared_pages_g, *,
           spec: StaticControls, layout: SlotLayout) -> PagedState:
    """Moves up to `layout.refill` pending rows (lowest index first) into free slots when their
    prompt's pages plus one per row are free, and draws their token 0 (see the module docstring)."""
    s_count, a_count, n, page = layout.slots, layout.refill, layout.num_samples, layout.page_size
    pt, pool = state.pages, state.pool
    groups, k_prompt = pt.group_pages_gk.shape
    rows_total = state.length_r.shape[0]
    free_s = ~state.live_s
    a = jnp.arange(a_count, dtype=jnp.int32)
    slot_a = jnp.searchsorted(jnp.cumsum(free_s, dtype=jnp.int32), a + 1).astype(jnp.int32)
    row_a = jnp.searchsorted(jnp.cumsum(state.pending_r, dtype=jnp.int32), a + 1).astype(jnp.int32)
    row_safe = jnp.minimum(row_a, rows_total - 1)
    valid_a = (a < jnp.sum(free_s, dtype=jnp.int32)) & (a < jnp.sum(state.pending_r, dtype=jnp.int32))
    prompt_a = row_safe // n
    plen_a = pool.next_pos_g[prompt_a]
    full_a, part_a = plen_a // page, (plen_a % page > 0).astype(jnp.int32)
    first_a = jnp.concatenate([jnp.ones((1,), bool), prompt_a[1:] != prompt_a[:-1]])
    new_group_a = first_a & (pt.refs_g[prompt_a] == 0)
    need_a = jnp.where(valid_a, jnp.where(new_group_a, full_a, 0) + part_a, 0)
    # Each row also keeps one page in reserve for its first tokens; in order: a refusal refuses the rest.
    ok_a = valid_a & (jnp.cumsum(need_a + 1) <= pt.free)
    need_a = jnp.where(ok_a, need_a, 0)

    k = jnp.arange(k_prompt)
    page_ak, pt = pop_pages(pt, k[None, :] < need_a[:, None])
    shared_ak = jnp.where((ok_a & new_group_a)[:, None], page_ak, -1)  # new groups' full pages
    group_pages = pt.group_pages_gk.at[jnp.where(ok_a & new_group_a, prompt_a, groups)].set(page_ak, mode="drop")
    own_a = jnp.take_along_axis(page_ak, jnp.maximum(need_a - 1, 0)[:, None], axis=1)[:, 0]  # the partial page
    row_pages_ak = jnp.where(k[None, :] < full_a[:, None], group_pages[prompt_a], own_a[:, None])
    target_ak = jnp.where((k[None, :] < full_a[:, None]) & (shared_ak >= 0), row_pages_ak,
                          jnp.where((k[None, :] == full_a[:, None]) & (part_a[:, None] > 0) & ok_a[:, None],
                                    own_a[:, None], layout.num_pages))
    kv = _copy_prompt_pages(cfg, state.kv, pool, src_gp, prompt_a, target_ak, page)

    slot_tgt = jnp.where(ok_a, slot_a, s_count)
    row_tgt = jnp.where(ok_a, row_a, rows_total)
    put_slot = lambda buf, x: buf.at[slot_tgt].set(x.astype(buf.dtype), mode="drop")
    pt = pt.replace(
        table_sk=pt.table_sk.at[slot_tgt, :k_prompt].set(row_pages_ak, mode="drop"),
        shared_s=put_slot(pt.shared_s, full_a), held_s=put_slot(pt.held_s, full_a + part_a),
        prompt_s=put_slot(pt.prompt_s, prompt_a), prompt_len_s=put_slot(pt.prompt_len_s, plen_a),
        order_s=put_slot(pt.order_s, pt.admitted + a), group_pages_gk=group_pages,
        refs_g=pt.refs_g.at[jnp.where(ok_a, prompt_a, groups)].add(1, mode="drop"),
        admitted=pt.admitted + jnp.sum(ok_a, dtype=jnp.int32))

    state, ended_a = admit_rows(state, pool.logits_gv[prompt_a], keys_r[row_safe], row_a, plen_a, ok_a, slot_tgt,
                                row_tgt, max_new, scalars, spec)
    # A row that ends on token 0 never decodes: its pages go straight back.
    pt = release_pages(pt, jnp.zeros((s_count,), bool).at[slot_tgt].set(ended_a, mode="drop"), shared_pages_g)
    return state.replace(kv=kv, pages=pt, pending_r=state.pending_r.at[row_tgt].set(False, mode="drop"))


def _grow(state: PagedState, shared_pages_g, page_size: int, pool_axes: tuple = ()) -> PagedState:
    """Gives a page to every running slot whose next token starts one, preempting the most
    recently admitted running rows while the free pages fall short."""
    rows_total = state.length_r.shape[0]

    def short(carry):
        pt, live_s, _ = carry
        need = jnp.sum(live_s & (state.next_pos_s % page_size == 0), dtype=jnp.int32)
        return (need > pt.free) & jnp.any(live_s)

    def preempt(carry):
        pt, live_s, pending_r = carry
        victim_s = jnp.arange(live_s.shape[0]) == jnp.argmax(jnp.where(live_s, pt.order_s, -1))
        pt = release_pages(pt, victim_s, shared_pages_g).replace(preemptions=pt.preemptions + 1)
        row = jnp.where(jnp.any(victim_s), jnp.sum(jnp.where(victim_s, state.row_s, 0)), rows_total)
        return pt, live_s & ~victim_s, pending_r.at[row].set(True, mode="drop")

    pt, live_s, pending_r = pool_while(pool_axes, short, preempt, (state.pages, state.live_s, state.pending_r),
                                       guard=True)
    need_s = live_s & (state.next_pos_s % page_size == 0)
    page_s1, pt = pop_pages(pt, need_s[:, None])
    slot_tgt = jnp.where(need_s, jnp.arange(need_s.shape[0]), need_s.shape[0])
    pt = pt.replace(table_sk=pt.table_sk.at[slot_tgt, pt.held_s].set(page_s1[:, 0], mode="drop"),
                    held_s=pt.held_s + need_s)
    return state.replace(pages=pt, live_s=live_s, pending_r=pending_r)


def _decode_step(cfg: ModelConfig, layer_params, state: PagedState, keys_r, max_new, scalars, rope_cos_sin,
                 shared_pages_g, *, spec: StaticControls, layout: SlotLayout) -> PagedState:
    """One forward step over every slot; the fed tokens' keys and values go into their pages, and
    rows that end give their pages back."""
    page = layout.page_size
    state = _grow(state, shared_pages_g, page, layout.pool_axes)
    pt, live_s = state.pages, state.live_s
    rope = slot_rope(rope_cos_sin, state.row_s, layout.num_samples)  # image prompts: each slot's prompt's tables
    args = (cfg, layer_params, state.last_token_s, state.next_pos_s, live_s, state.kv, pt, rope)
    if use_pallas_kernel(cfg, spec) and state.routes_rnlk is None:  # the kernel's forward records no routes
        logits_sv, kv = kernel_forward(*args, page_size=page, num_pages=layout.num_pages)
    else:
        prompt_len = state.pool.pos_gp.shape[1]
        logits_sv, kv, *routes = gather_forward(*args, prompt_len=prompt_len, width=prompt_len + layout.new_bucket,
                                                page_size=page, num_pages=layout.num_pages,
                                                batch_invariant=spec.batch_invariant,
                                                record_routes=state.routes_rnlk is not None)
        if routes:  # a running slot fed its row's token step - 1
            state = record_slot_routes(state, routes[0])

    state, ended_s = record_step(state, logits_sv, keys_r, max_new, scalars, spec)
    return state.replace(kv=kv, pages=release_pages(pt, ended_s, shared_pages_g))


def _empty_pages(cfg: ModelConfig, layout: SlotLayout, groups: int, prompt_len: int,
                 kv_dtype: str = "model") -> tuple[Any, PageTable]:
    """Empty page pools, and the page table with every page free. `kv_dtype = "fp8"`: pages of
    float8_e4m3fn with one f32 scale per (kv head, page, offset), [K, pages, page, 1], written
    with their values (`gather_forward`, `_copy_prompt_pages`)."""
    page, pages = layout.page_size, layout.num_pages
    shape = (cfg.num_kv_heads, pages, page, cfg.head_dim)
    dtype = jnp.float8_e4m3fn if kv_dtype == "fp8" else cfg.compute_jnp_dtype
    scales = {name: jnp.ones(shape[:3] + (1,), jnp.float32) for name in KV_SCALES.values()} if kv_dtype == "fp8" else {}
    kv = tuple(dict({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}, **scales)
               for _ in range(cfg.num_layers))
    s_count = layout.slots
    per_row = -(-(prompt_len + layout.new_bucket) // page)
    zeros_s = jnp.zeros((s_count,), jnp.int32)
    scalar = jnp.zeros((), jnp.int32)
    pt = PageTable(table_sk=jnp.zeros((s_count, per_row), jnp.int32), shared_s=zeros_s, held_s=zeros_s,
                   prompt_s=zeros_s + groups, prompt_len_s=zeros_s, order_s=zeros_s,
                   group_pages_gk=jnp.zeros((groups, -(-prompt_len // page)), jnp.int32),
                   refs_g=jnp.zeros((groups,), jnp.int32), stack_p=jnp.arange(pages, dtype=jnp.int32),
                   free=jnp.asarray(pages, jnp.int32), admitted=scalar, peak=scalar, preemptions=scalar)
    return kv, pt


def sample_paged(cfg: ModelConfig, params, prompt_bp, mask_bp, key, max_new, scalars, num_rows, *,
                 prompt=None, prompt_rope=None,
                 spec: StaticControls, layout: SlotLayout, row_offset=0) -> SampleResult:
    """`rljax.sampling.continuous.sample_continuous` over the paged layout (same arguments, same
    result, plus the page counters). Every prompt is prefilled up front into the prompt pool; the
    pool, the token draws and the row outputs are the slot layout's (`rljax.sampling.slots`); image
    prompts' `prompt` and `prompt_rope` as there."""
    layer_params = unstack_layers(params, cfg)
    mask_bp = mask_bp.astype(bool)
    b, prompt_len = prompt_bp.shape
    n, s_count, new_bucket = layout.num_samples, layout.slots, layout.new_bucket
    rows_total = b * n
    pool = prefill_into_pool(cfg, layer_params, empty_pool(cfg, b, prompt_len, spec.kv_dtype), prompt_bp, mask_bp, b,
                             batch_invariant=spec.batch_invariant, prompt=prompt, chunk=spec.prefill_chunk)
    # Pool slot of each prompt's i-th real token (the pages store real tokens only, from position 0).
    pos_gp = pool.pos_gp
    src_gp = jnp.zeros_like(pos_gp).at[jnp.arange(b)[:, None], jnp.where(pos_gp >= 0, pos_gp, prompt_len)].set(
        jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), pos_gp.shape), mode="drop")
    shared_pages_g = pool.next_pos_g // layout.page_size
    kv, pt = _empty_pages(cfg, layout, b, prompt_len, spec.kv_dtype)
    num_rows = jnp.minimum(jnp.asarray(num_rows, jnp.int32), rows_total)
    routes = empty_routes(cfg, spec, rows_total, new_bucket)
    state = empty_slots(PagedState, spec, s_count, rows_total, new_bucket, kv=kv, pages=pt,
                        pending_r=jnp.arange(rows_total) < num_rows, pool=pool, routes_rnlk=routes)
    keys_r = row_keys(key, rows_total, row_offset)  # row_offset: this device's first row (row_shards)
    rope_cos_sin = rope_table(cfg, prompt_len + new_bucket)
    rope_cos_sin = rope_cos_sin if prompt_rope is None else prompt_rope

    def body(st: PagedState) -> PagedState:
        st = _admit(cfg, st, keys_r, max_new, scalars, src_gp, shared_pages_g, spec=spec, layout=layout)
        return _decode_step(cfg, layer_params, st, keys_r, max_new, scalars, rope_cos_sin, shared_pages_g,
                            spec=spec, layout=layout)

    state = pool_while(layout.pool_axes, lambda st: jnp.any(st.live_s) | jnp.any(st.pending_r), body, state)
    pt = state.pages
    result = slot_result(state, s_count, state.decode_steps * s_count, preemptions=pt.preemptions, peak_pages=pt.peak,
                         free_pages=pt.free)
    if routes is None:
        return result
    return routes_result(cfg, layer_params, result, state.routes_rnlk, prompt_bp, mask_bp, n)
