"""Context parallelism: each device of the `context` mesh axis holds a share of every row's
tokens, and attention sees the whole row by all-gathering keys and values (Llama 3's long-context
training, Dubey et al., 2024).

Load balance (zig-zag). A row of T slots is cut into 2C chunks of c = T / 2C for C devices;
device d holds chunks d and 2C-1-d (Brandon et al., 2023, "Striped attention", and Llama 3 use
this pairing). Causal attention needs key chunks 0..m for query chunk m, so device d needs
(d + 1) + (2C - d) = 2C + 1 blocks of c x c, the same on every device; the naive split (chunks
2d, 2d+1) needs 4d + 3, and its last device does twice the mean's work.

Why all-gather and not a ring. Our rows carry causality as positions, so attention is correct
over keys in any slot order; gathering K and V once per layer costs 2 T K H bytes per device,
small next to the queries' activations when K << N (Qwen2.5-7B: 4 KV heads, 28 query heads), and
leaves one plain block loop that needs no log-sum-exp from a kernel. A ring (ppermute per block)
would overlap the transfer; the gathered keys are what a ring would stream anyway.

The block loop (`block_attention`) is FlashAttention's online softmax (Dao et al., 2022;
Milakov & Gimelshein, 2018) over a static schedule of (query chunk, key chunk) pairs, each
block's keys walked in tiles of `KEY_TILE`, each step and tile rematerialised in the backward pass,
so no device ever holds more than one [c, KEY_TILE] tile of scores per layer, and the loop's step
count is static (2C + 1), so the SPMD program does exactly the blocks causality needs. Masks are the reference's (`rljax.models.attention.attention`): valid
keys, k_pos <= q_pos, Gemma 2's windows, packed segments, and soft-capping before the mask. Every
row, padded or packed, takes this path under a context axis: per-row lengths (cuDNN) and slot
causality (splash) do not survive the zig-zag permutation, positions do.

The model stays layout-free: `context_mesh()` reads the surrounding `jax.set_mesh(mesh)` context,
and `rljax.models.transformer.hidden_states` permutes a row into zig-zag order (`zigzag`), runs
the layers with `context_attention`, and permutes the hidden states back, only when that mesh has
a `context` axis of more than one device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from rljax.models.attention import softcap
from rljax.models.config import ModelConfig

CONTEXT_AXIS = "context"
ROW_AXES = ("data", "fsdp", "expert")  # axes a batch's rows may be split over, in mesh order
_NEG = -1e30
KEY_TILE = 1024  # keys per score tile inside a block: a tile holds [B, K, G, c, tile] scores


def context_mesh():
    """The surrounding `jax.set_mesh` mesh when it has a `context` axis of more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
        return None
    return mesh if mesh.shape[CONTEXT_AXIS] > 1 else None


# ----------------------------------------------------------------------------- the layout


def padded_length(t: int, degree: int) -> int:
    """T rounded up to 2C chunks (two per device) of c slots, c a multiple of `KEY_TILE` when it
    is longer (so a chunk splits into whole key tiles)."""
    c = -(-t // (2 * degree))
    if c > KEY_TILE:
        c = -(-c // KEY_TILE) * KEY_TILE
    return 2 * degree * c


def chunk_owner(degree: int, layout: str = "zigzag") -> list[tuple[int, int]]:
    """The natural chunk indices each device holds, [(first, second)] per device: zig-zag
    (d, 2C-1-d), or the naive contiguous split (2d, 2d+1), kept as the load-balance test's foil."""
    if layout == "zigzag":
        return [(d, 2 * degree - 1 - d) for d in range(degree)]
    return [(2 * d, 2 * d + 1) for d in range(degree)]


def zigzag_order(t: int, degree: int, layout: str = "zigzag") -> np.ndarray:
    """Slot order [T] (T a multiple of 2C): position i of the permuted row holds natural slot
    order[i]; device d's shard is [d 2c, (d + 1) 2c)."""
    c = t // (2 * degree)
    chunks = [m for pair in chunk_owner(degree, layout) for m in pair]
    return np.concatenate([np.arange(m * c, (m + 1) * c) for m in chunks])


def zigzag(x_bt, degree: int):
    """[B, T, ...] in natural slot order -> zig-zag order (T a multiple of 2C)."""
    return jnp.take(x_bt, jnp.asarray(zigzag_order(x_bt.shape[1], degree)), axis=1)


def unzigzag(x_bt, degree: int):
    """The inverse of `zigzag`."""
    return jnp.take(x_bt, jnp.asarray(np.argsort(zigzag_order(x_bt.shape[1], degree))), axis=1)


def schedule(degree: int, device: int, layout: str = "zigzag") -> list[tuple[int, int]]:
    """The causal blocks device `device` computes: (local query chunk 0 or 1, natural key chunk)
    pairs, every key chunk at or before each of its query chunks."""
    first, second = chunk_owner(degree, layout)[device]
    return [(0, m) for m in range(first + 1)] + [(1, m) for m in range(second + 1)]


def _key_offset(m, degree: int, c: int, layout: str = "zigzag"):
    """Where natural chunk m sits in the gathered keys: for zig-zag, device m's first half for
    m < C, device 2C-1-m's second half otherwise (m an int or a traced scalar); naive: m c."""
    if layout != "zigzag":
        return m * c
    first_half = m < degree
    return jnp.where(first_half, m * 2 * c, (2 * degree - 1 - m) * 2 * c + c) if not isinstance(m, int) else (
        m * 2 * c if first_half else (2 * degree - 1 - m) * 2 * c + c)


# ----------------------------------------------------------------------------- the block loop


def _block_step(carry, q_ckgh, k_cskh, v_cskh, qpos_c, kpos_s, qseg_c, kseg_s, window, cfg: ModelConfig):
    """One online-softmax step of one query chunk against one key chunk (`_tile_step`), over key
    tiles of `KEY_TILE` (a `lax.scan`, each tile rematerialised) where the chunk is longer."""
    c = k_cskh.shape[1]
    if c <= KEY_TILE:
        return _tile_step(carry, q_ckgh, k_cskh, v_cskh, qpos_c, kpos_s, qseg_c, kseg_s, window, cfg)
    split = lambda x: x.reshape(x.shape[0], c // KEY_TILE, KEY_TILE, *x.shape[2:]).swapaxes(0, 1)
    xs = (split(k_cskh), split(v_cskh), split(kpos_s)) + (() if kseg_s is None else (split(kseg_s),))
    tile = jax.checkpoint(lambda st, x: (_tile_step(st, q_ckgh, x[0], x[1], qpos_c, x[2], qseg_c,
                                                    x[3] if len(x) > 3 else None, window, cfg), None))
    return jax.lax.scan(tile, carry, xs)[0]


def _tile_step(carry, q_ckgh, k_cskh, v_cskh, qpos_c, kpos_s, qseg_c, kseg_s, window, cfg: ModelConfig):
    """One online-softmax step of a query chunk against key tile k: (running max m, sum l,
    accumulator acc) updated with this tile's masked scores."""
    m, l, acc = carry
    logits = jnp.einsum("btkgh,bskh->bkgts", q_ckgh, k_cskh, preferred_element_type=jnp.float32) * cfg.query_scale
    logits = softcap(logits, cfg.attn_logit_softcap)
    dist = qpos_c[:, :, None] - kpos_s[:, None, :]
    visible = (kpos_s[:, None, :] >= 0) & (dist >= 0) & ((window == 0) | (dist < window))
    if qseg_c is not None:
        visible &= qseg_c[:, :, None] == kseg_s[:, None, :]
    logits = jnp.where(visible[:, None, None], logits, _NEG)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    p = jnp.exp(logits - m_new[..., None])
    scale = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v_cskh.dtype), v_cskh, preferred_element_type=jnp.float32)
    return m_new, l * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv


def _block_args(q, qpos, qseg, k_bskh, v_bskh, k_pos_bs, k_seg_bs, qi, m, c: int, degree: int, layout: str):
    """One step's operands: local query chunk qi (of q [B, 2, c, ...]) and natural key chunk m
    sliced from the gathered keys."""
    off = _key_offset(m, degree, c, layout)
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, off, c, axis=1)
    pick = (lambda x: x[:, qi]) if isinstance(qi, int) else (lambda x: jax.lax.dynamic_index_in_dim(x, qi, 1, False))
    return (pick(q), sl(k_bskh), sl(v_bskh), pick(qpos), sl(k_pos_bs),
            None if qseg is None else pick(qseg), None if k_seg_bs is None else sl(k_seg_bs))


def block_attention(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, window, cfg: ModelConfig, steps, degree: int,
                    q_seg_bt=None, k_seg_bs=None, layout: str = "zigzag"):
    """Attention of one device's two query chunks (q [B, 2c, N, H], natural chunks per `schedule`)
    over the zig-zag-gathered keys [B, 2C c, K, H]: `steps` is a list of (local query chunk, key
    chunk) int pairs (a per-device program, unrolled), or a pair of int arrays [S] (the SPMD
    program, whose schedule depends on the device index: a `lax.scan`), walked with an online
    softmax. Returns f32 [B, 2c, N, H]: `rljax.models.attention.attention`'s values."""
    b, t2, n, h = q_btnh.shape
    kh = k_bskh.shape[2]
    g, c = n // kh, t2 // 2
    q = q_btnh.reshape(b, 2, c, kh, g, h)
    qpos = q_pos_bt.reshape(b, 2, c)
    qseg = None if q_seg_bt is None else q_seg_bt.reshape(b, 2, c)
    init = (jnp.full((b, kh, g, c), _NEG, jnp.float32), jnp.zeros((b, kh, g, c), jnp.float32),
            jnp.zeros((b, kh, g, c, h), jnp.float32))
    step = jax.checkpoint(_block_step, static_argnums=(9,))
    blocks = lambda qi, m: _block_args(q, qpos, qseg, k_bskh, v_bskh, k_pos_bs, k_seg_bs, qi, m, c, degree, layout)
    if isinstance(steps, list):  # a per-device program: the schedule is static, unrolled
        state = [init, init]  # per local query chunk
        for qi, m in steps:
            state[qi] = step(state[qi], *blocks(qi, m), window, cfg)
    else:  # the SPMD program: (query chunk [S], key chunk [S]) are data; a scan updates one chunk's state
        def body(st, xs):
            qi, m = xs
            cur = jax.tree.map(lambda x: x[qi], st)
            new = step(cur, *blocks(qi, m), window, cfg)
            return jax.tree.map(lambda x, n_: x.at[qi].set(n_), st, new), None
        st, _ = jax.lax.scan(body, jax.tree.map(lambda x: jnp.stack([x, x]), init), steps)
        state = [jax.tree.map(lambda x, j=j: x[j], st) for j in range(2)]
    outs = [acc / l[..., None] for _, l, acc in state]  # [B, K, G, c, H] each
    out = jnp.stack(outs, axis=1)  # [B, 2, K, G, c, H]
    return out.transpose(0, 1, 4, 2, 3, 5).reshape(b, t2, n, h)


def _row_axes(mesh, rows: int):
    present = tuple(a for a in ROW_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    for drop in range(len(present) + 1):
        axes = present[drop:]
        if rows % math.prod(mesh.shape[a] for a in axes) == 0:
            return axes or None
    return None


def spread_rows(rows_tree):
    """The sampler's rows under a context mesh: every leaf's leading (row) dim constrained over the
    batch axes and `context` together (the longest trailing run of them, `context` included, that
    divides the rows), so each device of a context group decodes rows of its own; unchanged
    without a context axis or when no such run divides the rows.

    Decoding has no sequence to split: a new token attends to its own row's cache, and the cached
    forward takes no context-parallel path. Left as the prompts arrive (rows over the batch axes
    only), the C devices of a context group would decode the same rows and each hold their whole
    KV cache. The update reshards the rollout into its own rows x tokens layout."""
    mesh = context_mesh()
    leaves = jax.tree.leaves(rows_tree)
    axes = None if mesh is None or not leaves else spread_axes(mesh, leaves[0].shape[0])
    if axes is None:
        return rows_tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P(axes)), rows_tree)


def spread_axes(mesh, rows: int) -> tuple[str, ...] | None:
    """The axes `spread_rows` splits `rows` over: the longest trailing run of (data, fsdp, expert,
    context), those of the mesh with more than one device, that contains `context` and divides
    the rows; None if none does."""
    present = tuple(a for a in (*ROW_AXES, CONTEXT_AXIS) if a in mesh.axis_names and mesh.shape[a] > 1)
    runs = [present[i:] for i in range(len(present)) if CONTEXT_AXIS in present[i:]]
    return next((r for r in runs if rows % math.prod(mesh.shape[a] for a in r) == 0), None)


def context_attention(mesh, cfg: ModelConfig):
    """attend(q, k, v, window, rows) for `rljax.models.attention.fresh_attention`'s slot: rows in
    zig-zag order, split over `context` (and rows over the batch axes, heads over `tensor` where
    they divide), keys and values all-gathered over `context` inside `shard_map`, then the
    `schedule`'s blocks (2C + 1 per device) through `block_attention`."""
    degree = mesh.shape[CONTEXT_AXIS]
    tp = mesh.shape["tensor"] if "tensor" in mesh.axis_names else 1
    heads = "tensor" if tp > 1 and cfg.num_kv_heads % tp == 0 else None

    def attend(q, k, v, window, rows):
        rows_ax = _row_axes(mesh, q.shape[0])
        x4 = P(rows_ax, CONTEXT_AXIS, heads, None)
        x2 = P(rows_ax, CONTEXT_AXIS)
        seg = rows["packed_bt"]

        def body(q, k, v, q_pos, k_pos, window, *seg):
            gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)
            d = jax.lax.axis_index(CONTEXT_AXIS)
            s = jnp.arange(2 * degree + 1)
            steps = (jnp.where(s <= d, 0, 1), jnp.where(s <= d, s, s - d - 1))  # `schedule(degree, d)`
            q_seg, k_seg = (seg[0], gather(seg[0])) if seg else (None, None)
            return block_attention(q, gather(k), gather(v), q_pos, gather(k_pos), window, cfg, steps, degree,
                                   q_seg, k_seg)

        args = (q, k, v, rows["q_pos_bt"], rows["k_pos_bt"], jnp.asarray(window, jnp.int32)) + (
            () if seg is None else (seg,))
        specs = (x4, x4, x4, x2, x2, P()) + (() if seg is None else (x2,))
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=x4, check_vma=False)(*args)

    return attend
