"""FP8 operands for the sampler's forward: W8A8 layer weights (`Fp8Weight`) and an FP8 KV cache.

Both store float8_e4m3fn (OCP FP8, Micikevicius et al., "FP8 Formats for Deep Learning", 2022;
largest finite value 448) with f32 scales:

    scale = amax / 448       over the values that share it (1 where amax is 0)
    Q     = round_e4m3(x / scale)             (round to nearest, ties to even: a cast)
    x~    = Q * scale

W8A8 (`Fp8Weight.project`). The weight has one scale per output channel, taken once per weight
sync; the activation is quantised at each call with one scale per row (per token, the dynamic
scaling vLLM calls per-token). The matmul multiplies the two FP8 operands with f32 accumulation
and scales its output:

    y_mn = sx_m * sw_n * sum_k Qx_mk Qw_kn

Both scales factor out of the contraction, so the dot itself is `dot_general(f8, f8) -> f32`,
the form XLA's cuBLASLt FP8 GEMM rewrite on Hopper takes (it can fold scalar scales into the
GEMM; per-row and per-channel ones are a multiply on the output, which fuses with it or the next
elementwise op). Per row rather than per tensor: a row's tokens then do not depend on the other
rows of the batch (per-tensor amax would couple them: static and continuous sampling, and
`batch_invariant`, would disagree), and an outlier token costs only its own row's precision.

KV cache (`quantize_kv`, `dequantize_kv`). Keys and values are quantised where they are written,
one scale per (row, kv head, slot) over the head dimension, stored beside them with the slot axis
of their buffer (so the samplers' slot padding and copying treat them as one more buffer), and
dequantised to the compute dtype where attention reads them. A per-token scale is taken from the
token's own values, so writing a slot never rescales the others.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.attention import cached_attention, decode_attention

E4M3_MAX = 448.0
KV_SCALES = {"k": "k_scale", "v": "v_scale"}  # a layer cache's FP8 buffers and their scales


def quantize_fp8(x, reduce_axes: tuple[int, ...]):
    """(Q float8_e4m3fn, scale f32 broadcastable to x): one scale per slice over `reduce_axes`."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=reduce_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jnp.clip(x32 / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q, scale, dtype):
    """Q * scale in `dtype`."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


@flax.struct.dataclass
class Fp8Weight:
    """A dense weight held as float8_e4m3fn `q` [(L,) in..., out...] and f32 per-output-channel
    `scale` (q's shape with 1 on the input axes), for W8A8 matmuls (module docstring).

    A pytree: a stack of layers slices into per-layer weights like a plain array, and
    `rljax.models.layers.project` dispatches to `project` (the `is_adapted` protocol)."""

    q: jax.Array
    scale: jax.Array

    @classmethod
    def quantize(cls, w, in_axes: tuple[int, ...]) -> Fp8Weight:
        return cls(*quantize_fp8(w, in_axes))

    def project(self, x, contract: int, dtype=None):
        """x [..., in...] @ W [in..., out...] -> [..., out...] in f32 as W8A8: each row of x
        quantised to e4m3 with its own scale, an FP8 x FP8 dot accumulated in f32, the row and
        channel scales on the output. `dtype` (the compute dtype) is unused: both operands are FP8."""
        del dtype
        lead, k_shape = x.shape[:x.ndim - contract], x.shape[x.ndim - contract:]
        k = int(np.prod(k_shape))
        xq_mk, sx_m1 = quantize_fp8(x.reshape(-1, k), (1,))
        y_mn = jax.lax.dot_general(xq_mk, self.q.reshape(k, -1), (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        y_mn = y_mn * (sx_m1 * self.scale.reshape(1, -1))
        return y_mn.reshape(*lead, *self.q.shape[contract:])

    def dequantized(self, dtype):
        """Q * scale laid out as the weight, in `dtype`."""
        return dequantize_fp8(self.q, self.scale, dtype)


def quantize_kv(x, head_axis: int):
    """(Q, scale) of keys or values in a cache layout: one scale per (row, kv head, slot), over
    the head-dimension axis `head_axis` (kept as size 1 in the scale)."""
    return quantize_fp8(x, (head_axis,))


def dequantize_kv(q, scale, dtype):
    """Cached FP8 keys or values back in `dtype` (the compute dtype attention reads)."""
    return dequantize_fp8(q, scale, dtype)


def is_fp8_cache(layer_cache) -> bool:
    """Whether a layer's cache holds FP8 keys and values with scales (checked at trace time)."""
    return KV_SCALES["k"] in layer_cache


def head_axes(key_layout: str) -> dict[str, int]:
    """The head-dimension axis of each cache buffer: keys [B, K, H, S] ("bkhs") or [B, K, S, H]."""
    return {"k": 2 if key_layout == "bkhs" else 3, "v": 3}


def quantize_cache_layers(layers, key_layout: str):
    """Every layer cache {k, v} (compute dtype) as {k, v, k_scale, v_scale} in FP8 (`quantize_kv`)."""
    axes = head_axes(key_layout)

    def one(lc):
        out = dict(lc)
        for name, scale_name in KV_SCALES.items():
            out[name], out[scale_name] = quantize_kv(lc[name], axes[name])
        return out
    return tuple(one(lc) for lc in layers)


def fp8_cache_attend(cfg, lc, q, k, v, write, slot_axes, key_layout, positions_bt, k_pos_bs, window,
                     kernel_range=None):
    """`rljax.models.transformer.hidden_states`' cached attention over an FP8 layer cache `lc`:
    the new keys and values (in the cache layout) quantised per (row, kv head, slot) and written
    with their scales at the cache's index, then attention over the dequantised cache: inside the
    Pallas decode kernel when `kernel_range` = (start_b, end_b) is given, else `cached_attention`
    on the cache dequantised to q's dtype. Returns (out f32, the new layer cache)."""
    axes = head_axes(key_layout)
    new = {}
    for name, x in (("k", k), ("v", v)):
        xq, xs = quantize_kv(x, axes[name])
        new[name] = write(lc[name], xq, slot_axes[name])
        new[KV_SCALES[name]] = write(lc[KV_SCALES[name]], xs, slot_axes[name])
    if kernel_range is not None:
        out = decode_attention(q, new["k"], new["v"], *kernel_range, cfg, k_scale=new["k_scale"],
                               v_scale=new["v_scale"])
    else:
        ck, cv = (dequantize_kv(new[name], new[KV_SCALES[name]], q.dtype) for name in ("k", "v"))
        out = cached_attention(q, ck, cv, positions_bt, k_pos_bs, window, cfg, key_layout)
    return out, new
