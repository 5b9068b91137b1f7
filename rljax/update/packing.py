"""Padding-free updates: a mini-batch's rows packed end to end into buffers, micro-batches of a
fixed number of buffers (a token budget), and the loss still computed on the padded rows.

A rollout row is a left-padded prompt and a right-padded completion, `bucket(prompt) +
max_new_tokens` columns wide; with long-tailed completions most of those columns are padding
(about three quarters on `bench/longtail.py`'s distribution). Packing (as verl's
`use_remove_padding`, TRL's `padding_free`, Tunix, AReaL and OpenRLHF do) runs the model on

    buffers [N, pack_length]: each row's real tokens copied to a slot range of one buffer,
    with the row's own positions (RoPE restarts at each row) and its index as segment id,

so attention stays inside a row (`rljax.models.attention`: the reference masks by segment,
splash takes segment ids, cuDNN a segment mask), and the per-token outputs (log-probs, entropy,
values) are gathered back to the padded [B, T] layout. Everything downstream (every policy loss,
aggregation, KL, value loss, off-policy weight and metric) then runs on the padded rows exactly
as without packing: packing changes which tokens the model is run on, never what the objective
reads. Rows are placed first-fit decreasing (longest first, each into the first buffer with
room; Johnson, 1973), whole: a row never spans two buffers.

Micro-batches are `buffers` consecutive buffers, `update.max_tokens_per_microbatch` tokens;
their number follows the data (the buffers the rows fill), so the accumulation runs as a loop
with a data-dependent trip count inside ONE compiled program: no bucket of batch sizes, no
recompilation when lengths change. Each micro-batch's loss is its rows' numerator over the whole
mini-batch's denominator (`rljax.update.loss`), so accumulated gradients are the single-batch
gradient, never a mean of micro-batch means (the error MaxText found in Tunix's ragged
accumulation).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PackPlan:
    """Where each row of a [B, T] mini-batch goes: buffer_b (-1: not packed, the row has no loss
    token), offset_b (the buffer slot of the row's first real column), start_b (that column),
    span_b (first to last real column, inclusive; a row's real tokens need not be contiguous),
    num_buffers (buffers used, a traced scalar). `pack_length` is static."""

    buffer_b: jax.Array
    offset_b: jax.Array
    start_b: jax.Array
    span_b: jax.Array
    num_buffers: jax.Array
    pack_length: int = flax.struct.field(pytree_node=False)


def pack_rows(attn_mask_bt, loss_mask_bt, pack_length: int) -> PackPlan:
    """First-fit decreasing placement of every row with a loss token into buffers of
    `pack_length` slots (traceable; B steps of O(B) work). A row longer than `pack_length` cannot
    be placed: `pack_length` must be at least the row width (UpdateConfig checks it)."""
    b, t = attn_mask_bt.shape
    attn = attn_mask_bt.astype(bool)
    cols = jnp.arange(t, dtype=jnp.int32)
    start_b = jnp.min(jnp.where(attn, cols, t), axis=1)
    last_b = jnp.max(jnp.where(attn, cols, -1), axis=1)
    trained_b = jnp.any(loss_mask_bt.astype(bool), axis=1) & (last_b >= 0)
    span_b = jnp.where(trained_b, last_b - start_b + 1, 0).astype(jnp.int32)
    order = jnp.argsort(-span_b, stable=True)

    def place(i, carry):
        fill, buffer_b, offset_b = carry
        r = order[i]
        need = span_b[r]
        fits = fill + need <= pack_length
        slot = jnp.argmax(fits)
        take = need > 0
        buffer_b = buffer_b.at[r].set(jnp.where(take, slot, -1))
        offset_b = offset_b.at[r].set(jnp.where(take, fill[slot], 0))
        return fill.at[slot].add(jnp.where(take, need, 0)), buffer_b, offset_b

    init = (jnp.zeros((b,), jnp.int32), jnp.full((b,), -1, jnp.int32), jnp.zeros((b,), jnp.int32))
    _, buffer_b, offset_b = jax.lax.fori_loop(0, b, place, init)
    return PackPlan(buffer_b=buffer_b, offset_b=offset_b, start_b=start_b.astype(jnp.int32), span_b=span_b,
                    num_buffers=jnp.max(buffer_b) + 1, pack_length=pack_length)


def _slots(plan: PackPlan, t: int, first, buffers: int):
    """For every (row, column): its (buffer - first, slot) and whether it lands in buffers
    [first, first + buffers)."""
    col_t = jnp.arange(t, dtype=jnp.int32)
    buf_bt = jnp.broadcast_to((plan.buffer_b - first)[:, None], (plan.buffer_b.shape[0], t))
    slot_bt = plan.offset_b[:, None] + col_t[None, :] - plan.start_b[:, None]
    inside = (plan.buffer_b[:, None] >= 0) & (buf_bt >= 0) & (buf_bt < buffers)
    inside &= (slot_bt >= 0) & (slot_bt < plan.offset_b[:, None] + plan.span_b[:, None])
    return buf_bt, slot_bt, inside


def pack_values(plan: PackPlan, x_bt, attn_mask_bt, first, buffers: int, fill=0):
    """Row-aligned values [B, T, ...] of the real tokens moved to their slots in buffers
    [first, first + buffers): [buffers, pack_length, ...], `fill` on the empty slots."""
    buf_bt, slot_bt, inside = _slots(plan, attn_mask_bt.shape[1], first, buffers)
    buf_bt = jnp.where(inside & attn_mask_bt.astype(bool), buf_bt, buffers)  # out of range: dropped
    empty = jnp.full((buffers, plan.pack_length, *x_bt.shape[2:]), fill, x_bt.dtype)
    return empty.at[buf_bt, slot_bt].set(x_bt, mode="drop")


def pack_tables(plan: PackPlan, table_bph, attn_mask_bt, first, buffers: int):
    """Per-row rotary tables [B, P, H] by mask position (an image row's M-RoPE,
    `rljax.models.mrope.mrope_table`) as per-buffer tables [buffers, pack_length, H] by the
    buffer's running mask position: the real token of row b at its mask position p lands in
    buffer n at running position q, and entry q of buffer n is row b's entry p. A decoder given
    the running positions (`default_positions` of the buffer's mask) and the segment ids then
    rotates each token as in its own row and masks causally within each row (positions are
    only compared inside a segment, where both orders agree)."""
    mask_nl = pack_values(plan, attn_mask_bt.astype(bool), attn_mask_bt, first, buffers, False)
    run_nl = jnp.cumsum(mask_nl, axis=1, dtype=jnp.int32) - 1
    buf_bt, slot_bt, inside = _slots(plan, attn_mask_bt.shape[1], first, buffers)
    inside &= attn_mask_bt.astype(bool)
    q_bt = run_nl[jnp.clip(buf_bt, 0, buffers - 1), jnp.clip(slot_bt, 0, plan.pack_length - 1)]
    p_bt = jnp.maximum(jnp.cumsum(attn_mask_bt.astype(jnp.int32), axis=1) - 1, 0)  # `default_positions`
    entries_bth = jnp.take_along_axis(table_bph, p_bt[..., None], axis=1)
    empty = jnp.zeros((buffers, plan.pack_length, table_bph.shape[-1]), table_bph.dtype)
    return empty.at[jnp.where(inside, buf_bt, buffers), q_bt].set(entries_bth, mode="drop")


def packed_inputs(plan: PackPlan, tokens_bt, positions_bt, attn_mask_bt, first, buffers: int):
    """Buffers [first, first + buffers) as model inputs, [buffers, pack_length] each: tokens,
    positions (each row's own), attention mask and segment ids (the row index; padding -1)."""
    b, t = tokens_bt.shape
    scatter = lambda x_bt, fill: pack_values(plan, x_bt, attn_mask_bt, first, buffers, fill)  # noqa: E731
    rows_bt = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    return (scatter(tokens_bt, 0), scatter(positions_bt.astype(jnp.int32), 0),
            scatter(attn_mask_bt.astype(bool), False), scatter(rows_bt, -1))


def packed_routes(plan: PackPlan, routes_btlk, attn_mask_bt, first, buffers: int):
    """A routing record [B, T, L, k] moved with its tokens into buffers [first, first + buffers):
    [buffers, pack_length, L, k], -1 (route by the router's own top-k) on the empty slots."""
    b, t = attn_mask_bt.shape
    buf_bt, slot_bt, inside = _slots(plan, t, first, buffers)
    buf_bt = jnp.where(inside & attn_mask_bt.astype(bool), buf_bt, buffers)  # out of range: dropped
    empty = jnp.full((buffers, plan.pack_length, *routes_btlk.shape[2:]), -1, routes_btlk.dtype)
    return empty.at[buf_bt, slot_bt].set(routes_btlk, mode="drop")


def unpack(plan: PackPlan, x_nl, first, t: int):
    """Per-token outputs of buffers [first, first + n) back to the padded rows, [B, T]; 0 where
    a column is not in those buffers. Differentiable (a gather)."""
    n = x_nl.shape[0]
    buf_bt, slot_bt, inside = _slots(plan, t, first, n)
    flat = x_nl.reshape(-1)
    idx = jnp.clip(buf_bt, 0, n - 1) * plan.pack_length + jnp.clip(slot_bt, 0, plan.pack_length - 1)
    return jnp.where(inside, jnp.take(flat, idx), jnp.zeros((), x_nl.dtype))


def rows_in(plan: PackPlan, first, buffers: int):
    """[B] bool: the rows whose buffer is in [first, first + buffers)."""
    return (plan.buffer_b >= first) & (plan.buffer_b < first + buffers)


def pad_fraction(attn_mask_bt, plan: PackPlan, buffers: int) -> tuple[jax.Array, jax.Array]:
    """(padding share of the padded [B, T] rows, padding share of the packed micro-batches that
    run): what packing saves, as `update/pad_fraction_padded|packed`."""
    real = jnp.sum(attn_mask_bt.astype(jnp.float32))
    slabs = -(-plan.num_buffers // buffers)
    packed_slots = (slabs * buffers * plan.pack_length).astype(jnp.float32)
    return 1.0 - real / attn_mask_bt.size, 1.0 - real / jnp.maximum(packed_slots, 1.0)


@flax.struct.dataclass
class Slab:
    """One packed micro-batch: buffers [first, first + buffers) of `plan`."""

    plan: PackPlan
    first: jax.Array
    buffers: int = flax.struct.field(pytree_node=False)

    def rows(self):
        return rows_in(self.plan, self.first, self.buffers)

    def pack(self, x_bt, attn_mask_bt, fill=0):
        """Row-aligned values [B, T, ...] in this slab's buffers (`pack_values`)."""
        return pack_values(self.plan, x_bt, attn_mask_bt, self.first, self.buffers, fill)

    def pack_tables(self, rope_cos_sin, attn_mask_bt):
        """Per-row rotary tables (cos, sin) [B, P, H] as this slab's per-buffer tables (`pack_tables`)."""
        return tuple(pack_tables(self.plan, t, attn_mask_bt, self.first, self.buffers) for t in rope_cos_sin)

    def scores(self, cfg, params, value_params, tokens_bt, attn_mask_bt, *, with_entropy: bool, chunks,
               remat: bool, unroll: bool, routes_btlk=None, return_routing: bool = False, rope_cos_sin=None):
        """(log-probs, entropy or None, state values or None), each [B, T] on the padded rows (0 off
        this slab's rows), from one forward over the slab's buffers. A row's first real token is
        scored from the previous row's last token in its buffer; it is a prompt token (outside
        any loss mask), as in the padded layout, where it is scored from padding. `routes_btlk`:
        a routing record, packed with its tokens and replayed by the policy's forward.
        `return_routing` (an MoE policy) appends (the forward's `MoEAux` [L, buffers,
        pack_length, ...], the buffers' real-token mask [buffers, pack_length]): what the router
        losses and routing metrics read. `rope_cos_sin`: per-buffer tables (`pack_tables`, image
        rows), read at the buffers' running positions in place of each row's own (`params` then
        carry the rows' embeddings packed alike, `rljax.update.vision.VisionRows.splice`)."""
        from rljax.models import default_positions, token_logprobs, values

        t = tokens_bt.shape[1]
        toks, pos, mask, seg = packed_inputs(self.plan, tokens_bt, default_positions(attn_mask_bt), attn_mask_bt,
                                             self.first, self.buffers)
        if rope_cos_sin is not None:
            pos = default_positions(mask)
        routes = None
        if routes_btlk is not None:
            routes = packed_routes(self.plan, routes_btlk, attn_mask_bt, self.first, self.buffers)
            routes = routes.astype(jnp.int32).transpose(2, 0, 1, 3)
        logp_nl, ent_nl, *routing = token_logprobs(cfg, params, toks, mask, pos, with_entropy=with_entropy,
                                                   chunk_size=chunks.time, vocab_chunk=chunks.vocab, remat=remat,
                                                   unroll=unroll, segment_ids_bt=seg, routes_lbtk=routes,
                                                   return_routing=return_routing, rope_cos_sin=rope_cos_sin)
        back = lambda x_nl: unpack(self.plan, x_nl, self.first, t)  # noqa: E731
        state_v = None
        if value_params is not None:
            v_nl = values(cfg, value_params, toks, mask, pos, remat=remat, unroll=unroll, segment_ids_bt=seg)
            state_v = back(jnp.concatenate([jnp.zeros_like(v_nl[:, :1]), v_nl[:, :-1]], axis=1))
        out = back(logp_nl), (None if ent_nl is None else back(ent_nl)), state_v
        return out + ((routing[0], mask),) if return_routing else out
