"""The FP8 KV cache (`rljax.models.fp8`, `sampling.kv_dtype = "fp8"`): quantisation against NumPy,
the cache's bytes, attention over it against the compute-dtype cache (measured), and the Pallas
decode kernel dequantising inside against the reference path (the sampler with it:
tests/sampling/test_fp8.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import rljax.models as M
from rljax.models.attention import cached_attention
from rljax.models.decode_kernel import split_decode_attention
from rljax.models.fp8 import dequantize_kv, quantize_cache_layers, quantize_kv


def test_quantize_kv_equals_numpy_and_halves_the_cache():
    """One scale per (row, kv head, slot): max |x| over the head dimension / 448, the values cast
    to e4m3 as ml_dtypes casts them, for both key layouts; a prefilled bf16 cache quantised holds
    (1 + 4 / H) / 2 of its bytes (e4m3 values plus one f32 scale per H values). Catches a scale
    over the slots or the heads (one outlier token would flatten the others), bf16 storage
    (ratio 1), a scale per element."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(2, 3, 16, 5)) * 10.0 ** rng.uniform(-3, 2, size=(2, 3, 1, 5))).astype(np.float32)
    q, scale = quantize_kv(jnp.asarray(x), 2)  # keys [B, K, H, S]: the head dimension is axis 2
    want_scale = np.abs(x).max(2, keepdims=True) / np.float32(448)
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=2e-7)
    want_q = (x / np.asarray(scale)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), want_q)
    np.testing.assert_array_equal(np.asarray(dequantize_kv(q, scale, jnp.float32)), want_q * np.asarray(scale))

    cfg = M.preset("qwen2-test", compute_dtype="bfloat16")
    cache = M.init_cache(cfg, 2, 16)
    fp8 = quantize_cache_layers(cache["layers"], "bkhs")
    assert fp8[0]["k"].dtype == jnp.float8_e4m3fn and fp8[0]["k_scale"].shape == (2, cfg.num_kv_heads, 1, 16)
    nbytes = lambda layers: sum(x.nbytes for x in jax.tree.leaves(layers))
    assert nbytes(fp8) / nbytes(cache["layers"]) == pytest.approx((1 + 4 / cfg.head_dim) / 2)


def _qkv(seed, b=3, kh=2, g=4, h=32, s=48):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, kh, g, h), jnp.float32)
    k = jax.random.normal(keys[1], (b, kh, s, h), jnp.float32) * jnp.linspace(0.1, 3.0, s)[:, None]
    v = jax.random.normal(keys[2], (b, kh, s, h), jnp.float32)
    return q, k, v


def test_fp8_cache_attention_error_is_bounded():
    """Attention over the FP8 cache against the same keys and values in bf16 (one decode query per
    head, 48 slots, keys growing to 3x: a sharp softmax, outputs up to 3.5): measured mean
    |error| 0.015 and max 0.105 (3 seeds: mean 0.015-0.017, max 0.08-0.19), bounds 0.025 and 0.15;
    the bf16 cache is within 0.006 of f32 (bound 0.01). Catches dequantising without the scale
    (error ~448), the key and value scales swapped (max 1.4)."""
    q, k, v = _qkv(1)
    b, kh, g, h = q.shape
    cfg = M.preset("qwen2-test").replace(num_heads=kh * g, num_kv_heads=kh, head_dim=h)
    q_b1nh = q.reshape(b, 1, kh * g, h)
    pos_b1 = jnp.full((b, 1), k.shape[2] - 1, jnp.int32)
    k_pos_bs = jnp.broadcast_to(jnp.arange(k.shape[2]), (b, k.shape[2]))
    run = lambda kk, vv: cached_attention(q_b1nh, kk, vv, pos_b1, k_pos_bs, 0, cfg, "bksh")
    bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    deq = lambda x: dequantize_kv(*quantize_kv(x, 3), jnp.float32)
    err = np.abs(np.asarray(run(deq(k), deq(v)) - run(bf(k), bf(v))))
    err_bf16 = float(jnp.max(jnp.abs(run(bf(k), bf(v)) - run(k, v))))
    print(f"FP8 cache vs bf16 cache: attention |error| mean {err.mean():.4f} max {err.max():.4f}; "
          f"bf16 vs f32 max {err_bf16:.4f}")
    assert 1e-3 < err.mean() < 0.025 and err.max() < 0.15 and err_bf16 < 0.01


@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_dequantises_the_fp8_cache(splits):
    """The Pallas decode kernel (interpret mode) over an FP8 cache with per-slot scales equals
    attention over the cache dequantised outside it, within 1e-5 (f32), for one split and for 3
    (whose scale blocks start at the split's offset), ragged ranges. Catches the scales not
    loaded, read at the wrong slots (offset by a split), key and value scales swapped."""
    q, k, v = _qkv(2)
    (kq, ks), (vq, vs) = quantize_kv(k, 3), quantize_kv(v, 3)
    start, end = jnp.asarray([0, 5, 30]), jnp.asarray([48, 40, 31])
    got = split_decode_attention(q, kq, vq, start, end, scale=0.25, splits=splits, interpret=True,
                                 k_scale_bks=ks[..., 0], v_scale_bks=vs[..., 0])
    want = split_decode_attention(q, dequantize_kv(kq, ks, jnp.float32), dequantize_kv(vq, vs, jnp.float32),
                                  start, end, scale=0.25, splits=splits, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_decode_step_over_fp8_cache_kernel_equals_reference():
    """One decode step of the model (f32 compute) over an FP8 cache: through the Pallas kernel
    (keys [B, K, S, H], scales passed in) and through the einsum path (keys transposed, cache
    dequantised) the logits agree within 1e-5, and the step writes FP8 keys (the FP8 branch is
    taken). Catches the kernel branch reading the FP8 values without their
    scales, the head axis of the transposed key layout taken as the slot axis."""
    base = M.preset("qwen2-test").replace(num_layers=1)
    tokens, mask = jnp.asarray([[3, 9, 4, 1] * 4, [7, 2, 5, 5] * 4]), jnp.ones((2, 16), bool)
    out = {}
    for impl in ("pallas", "xla"):
        cfg = base.replace(decode_attention=impl)
        params = M.init_params(cfg, jax.random.key(0), std=0.2)
        _, cache = M.prefill_cache(cfg, params, tokens, mask)
        cache = _pad(cfg, cache, 16)
        c = dict(cache, layers=quantize_cache_layers(cache["layers"], M.attention.key_cache_layout(cfg)))
        logits, new = M.forward(cfg, params, jnp.asarray([[6], [8]]), jnp.asarray([[16], [16]]), None, c)
        out[impl] = np.asarray(logits)
        assert new["layers"][0]["k"].dtype == jnp.float8_e4m3fn and new["layers"][0]["k_scale"].dtype == jnp.float32
    np.testing.assert_allclose(out["pallas"], out["xla"], atol=1e-5, rtol=0)


def _pad(cfg, cache, extra):
    """`extra` empty slots after the prompt's (keys and values 0, positions -1)."""
    axes = M.cache_slot_axes(cfg)
    pad = lambda x, axis, fill: jnp.pad(x, [(0, extra) if i == axis else (0, 0) for i in range(x.ndim)],
                                        constant_values=fill)
    return {"layers": tuple({n: pad(x, axes[n], 0) for n, x in lc.items()} for lc in cache["layers"]),
            "pos": pad(cache["pos"], 1, -1), "index": cache["index"]}
