"""A Pallas GPU decode-attention kernel that writes the finished output: one program per
(row, kv head, key split), every query head of the kv head's group in one block.

Flash-Decoding (Dao et al., 2023) splits the key axis so that a few rows still fill the GPU, then
merges the splits' partial softmaxes: o = sum_j exp(m_j - m) o_j / sum_j exp(m_j - m) l_j with
m = max_j m_j. JAX's stock kernel (`jax.experimental.pallas.ops.gpu.decode_attention.mqa`, the
reference `rljax.models.attention.decode_attention` keeps) always splits 16 ways where the cache
allows, writes its partial outputs in the compute dtype, and merges them after an optimisation
barrier: per layer and step, a handful of small kernels (a max, the barrier, a rescale, two sums,
a divide, the f32 convert) on top of the attention itself, and a vmap over kv heads.

Here the splits are sized by the batch (`key_splits`): the fewest that give the GPU enough
programs (B x K x splits >= `PROGRAMS`). From 132 rows x 1 kv head up (an H100/H200 has 132 SMs)
that is one split, and the kernel divides by the softmax's mass itself and stores the f32 output:
no merge at all. With more than one split the partials are f32 and the merge is one fusion of
tiny arrays (no barrier). The grid runs over (row, kv head, split) directly, so nothing is vmapped
or transposed around the call; the group's query heads are padded to the 16 rows a Triton dot
needs by masked loads inside the kernel, not by a copy outside it.

Each program walks its key range [max(start, split begin), min(end, split end)) in blocks of
`block_k` slots with an online softmax (f32 scores and statistics, probabilities rounded to the
values' dtype for the PV product, as FlashAttention does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

PROGRAMS = 264  # two per SM on a 132-SM H100/H200: enough programs that one split fills the card
_BLOCK_H = 16  # a Triton dot's least row count
_FLOOR = float(jnp.finfo(jnp.float32).min)


def key_splits(rows: int, kv_heads: int, slots: int) -> int:
    """The fewest splits of `slots` (a multiple of 16) into equal parts of >= 16 slots, each a
    multiple of 16, that give rows x kv_heads x splits >= PROGRAMS (at most 16)."""
    fits = [s for s in range(1, 17) if slots % s == 0 and (slots // s) % 16 == 0]
    want = -(-PROGRAMS // max(rows * kv_heads, 1))
    return min((s for s in fits if s >= want), default=max(fits))


def _kernel(q_ref, k_ref, v_ref, *refs, scale: float, group: int, split_len: int, block_k: int, normalize: bool,
            fp8: bool):
    from jax.experimental.pallas import triton as plgpu

    if fp8:  # an FP8 cache: per-slot key and value scales, dequantised block by block below
        ks_ref, vs_ref, start_ref, end_ref, *out_refs = refs
    else:
        start_ref, end_ref, *out_refs = refs

    j = pl.program_id(2)
    rows_h = (jnp.arange(_BLOCK_H) < group)[:, None]
    q = plgpu.load(q_ref, mask=rows_h, other=0)
    base = j * split_len
    lo = jnp.maximum(start_ref[()], base) - base
    hi = jnp.minimum(end_ref[()], base + split_len) - base
    offsets = jnp.arange(block_k)

    def body(t, carry):
        o, m, l = carry
        keys = pl.ds(t * block_k, block_k)
        k = k_ref[keys, :]
        if fp8:
            k = (k.astype(jnp.float32) * ks_ref[keys][:, None]).astype(q.dtype)
        s = plgpu.dot(q, k.T).astype(jnp.float32) * scale
        idx = t * block_k + offsets
        s = jnp.where(((idx >= lo) & (idx < hi))[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        v = v_ref[keys, :]
        if fp8:
            v = (v.astype(jnp.float32) * vs_ref[keys][:, None]).astype(q.dtype)
        o = corr[:, None] * o + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return o, m_new, corr * l + p.sum(axis=-1)

    init = (jnp.zeros((_BLOCK_H, q.shape[-1]), jnp.float32), jnp.full((_BLOCK_H,), _FLOOR, jnp.float32),
            jnp.zeros((_BLOCK_H,), jnp.float32))
    first = jnp.maximum(lo, 0) // block_k
    last = jnp.maximum(pl.cdiv(hi, block_k), first)
    o, m, l = jax.lax.fori_loop(first, last, body, init)
    if normalize:
        plgpu.store(out_refs[0], o / l[:, None], mask=rows_h)
        return
    o_ref, m_ref, l_ref = out_refs
    plgpu.store(o_ref, o, mask=rows_h)
    plgpu.store(m_ref, m, mask=rows_h[:, 0])
    plgpu.store(l_ref, l, mask=rows_h[:, 0])


def split_decode_attention(q_bkgh, k_bksh, v_bksh, start_b, end_b, *, scale: float, splits: int | None = None,
                           interpret: bool = False, k_scale_bks=None, v_scale_bks=None):
    """Attention of each row's query group over its cache slots [start_b, end_b): q [B, K, G, H],
    keys and values [B, K, S, H] with S a multiple of 16 and H a power of two >= 16. Returns f32
    [B, K, G, H]. `splits` defaults to `key_splits(B, K, S)`. With `k_scale_bks` and `v_scale_bks`
    (f32 [B, K, S]) the keys and values are FP8 (`rljax.models.fp8`): each block is dequantised
    in the kernel, x * scale rounded to q's dtype, before its dot."""
    b, kh, g, h = q_bkgh.shape
    s = k_bksh.shape[2]
    if g > _BLOCK_H:
        raise ValueError(f"split_decode_attention: query group {g} > {_BLOCK_H} heads per kv head")
    splits = key_splits(b, kh, s) if splits is None else splits
    split_len = s // splits
    block_k = max(x for x in (16, 32, 64, 128) if split_len % x == 0)
    normalize = splits == 1
    fp8 = k_scale_bks is not None
    kernel = functools.partial(_kernel, scale=scale, group=g, split_len=split_len, block_k=block_k,
                               normalize=normalize, fp8=fp8)
    from jax.experimental.pallas import triton as plgpu

    row = pl.BlockSpec((None,), lambda i, k, j: (i,))
    in_specs = [pl.BlockSpec((None, None, _BLOCK_H, h), lambda i, k, j: (i, k, 0, 0)),
                pl.BlockSpec((None, None, split_len, h), lambda i, k, j: (i, k, j, 0)),
                pl.BlockSpec((None, None, split_len, h), lambda i, k, j: (i, k, j, 0))]
    scales = (k_scale_bks, v_scale_bks) if fp8 else ()
    in_specs += [pl.BlockSpec((None, None, split_len), lambda i, k, j: (i, k, j))] * len(scales) + [row, row]
    if normalize:
        out_shape = [jax.ShapeDtypeStruct((b, kh, g, h), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, _BLOCK_H, h), lambda i, k, j: (i, k, 0, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, kh, splits, g, h), jnp.float32),
                     jax.ShapeDtypeStruct((b, kh, splits, g), jnp.float32),
                     jax.ShapeDtypeStruct((b, kh, splits, g), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, _BLOCK_H, h), lambda i, k, j: (i, k, j, 0, 0)),
                     pl.BlockSpec((None, None, None, _BLOCK_H), lambda i, k, j: (i, k, j, 0)),
                     pl.BlockSpec((None, None, None, _BLOCK_H), lambda i, k, j: (i, k, j, 0))]
    outs = pl.pallas_call(kernel, grid=(b, kh, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
                          name="rljax_decode_attention")(q_bkgh, k_bksh, v_bksh, *scales, start_b.astype(jnp.int32),
                                                         end_b.astype(jnp.int32))
    if normalize:
        return outs[0]
    o, m, l = outs  # the Flash-Decoding merge, in f32, one small fusion
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))
    return jnp.sum(w[..., None] * o, axis=2) / jnp.sum(w * l, axis=2)[..., None]
