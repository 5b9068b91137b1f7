"""The project's Pallas decode-attention kernel (`rljax.models.decode_kernel`): equal to the
einsum reference and JAX's stock kernel for every key split (interpret mode), splits sized by the
batch, and the decode step's per-layer operation count when lowered for cuda, pinned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_count import op_counts, per_layer

import rljax.models as M
import rljax.models.attention as attn_mod
import rljax.models.transformer as T
from rljax.models import init_cache, init_params, preset
from rljax.models.decode_kernel import key_splits, split_decode_attention


def _einsum(q, k, v, start, end, scale):
    s = jnp.einsum("bkgh,bksh->bkgs", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    idx = jnp.arange(k.shape[2])
    seen = (idx >= start[:, None, None, None]) & (idx < end[:, None, None, None])
    return jnp.einsum("bkgs,bksh->bkgh", jax.nn.softmax(jnp.where(seen, s, -jnp.inf), -1), v.astype(jnp.float32))


@pytest.mark.parametrize("splits", [1, 2, 3, 6])
def test_kernel_equals_einsum_for_every_split(splits):
    """Ragged ranges (a full row, a middle span, a one-key row that sits in one split only), a
    query group of 7 heads padded to the kernel's 16 rows, f32: within 1e-5 of the einsum softmax
    for 1 split (normalised in the kernel) and 2, 3, 6 (merged outside), and equal to JAX's stock
    kernel in bf16 within one bf16 ulp of the outputs. Catches a range taken relative to the wrong
    split, an empty split's floor leaking into the merge, a padded head row written back, the
    scale applied twice."""
    b, kh, g, h, s = 3, 2, 7, 32, 96
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, kh, g, h), jnp.float32)
    k = jax.random.normal(keys[1], (b, kh, s, h), jnp.float32)
    v = jax.random.normal(keys[2], (b, kh, s, h), jnp.float32)
    start, end = jnp.asarray([0, 5, 40]), jnp.asarray([96, 50, 41])
    got = split_decode_attention(q, k, v, start, end, scale=0.3, splits=splits, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_einsum(q, k, v, start, end, 0.3)), atol=1e-5, rtol=0)
    bf = lambda x: x.astype(jnp.bfloat16)
    cfg = preset("qwen2-test").replace(num_heads=kh * g, num_kv_heads=kh, head_dim=h)
    q_b1nh = bf(q).reshape(b, 1, kh * g, h)
    ours = attn_mod.decode_attention(q_b1nh, bf(k), bf(v), start, end, cfg, interpret=True)
    stock = attn_mod.decode_attention_stock(q_b1nh, bf(k), bf(v), start, end, cfg, interpret=True)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(stock), atol=7.8e-3, rtol=0)


def test_key_splits_sized_by_batch():
    """256 rows x 2 kv heads fill the GPU: one split (no merge); 64 rows: 4 splits of 160 slots;
    4 rows: as many as the width allows (6 of 16 slots)."""
    assert key_splits(256, 2, 640) == 1
    assert key_splits(64, 2, 640) == 4
    assert key_splits(4, 2, 96) == 6


def _decode_step_counts(layers, attention_fn, rows=160):
    cfg = preset("qwen2-test", compute_dtype="bfloat16", decode_attention="pallas").replace(num_layers=layers)
    params = init_params(cfg, jax.random.key(0))
    cache = init_cache(cfg, rows, 80)
    step = lambda p, c, tok: M.forward(cfg, p, tok, jnp.zeros((rows, 1), jnp.int32), None, c)[0]
    old = T.decode_attention
    T.decode_attention = attention_fn
    try:
        text = jax.jit(step).trace(params, cache, jnp.zeros((rows, 1), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    finally:
        T.decode_attention = old
    return op_counts(text)


# What one decode layer lowers to for cuda at 160 rows (one key split), BENCHMARKS.md has the table.
LAYER_OPS = 178
LAYER_KINDS = {"custom_call": 1, "reduce": 2, "transpose": 2, "convert": 17, "concatenate": 2,
               "dynamic_update_slice": 2, "dot_general": 7}


def test_decode_layer_operation_count_is_pinned(monkeypatch):
    """One decode layer lowered for cuda at 160 rows holds one kernel call (the Triton kernel), no
    optimisation barrier and no split merge (2 reductions: the two RMS norms), and 178 operations
    in all, against 210 with JAX's stock kernel (its 16-way merge: 3 more reductions, 3 more
    transposes, 6 more converts and a barrier). Catches a regression that adds per-layer work
    around the kernel: a merge for a batch that fills the GPU, a vmap transposing the cache, a
    round trip through the compute dtype."""
    monkeypatch.setattr(attn_mod, "_interpret_here", lambda platform: False)
    try:
        ours = per_layer(_decode_step_counts(1, attn_mod.decode_attention),
                         _decode_step_counts(2, attn_mod.decode_attention))
        stock = per_layer(_decode_step_counts(1, attn_mod.decode_attention_stock),
                          _decode_step_counts(2, attn_mod.decode_attention_stock))
    except RuntimeError as err:  # jax >= 0.11 asks a real GPU for Triton's target when lowering
        if "No supported GPU devices" not in str(err):
            raise
        pytest.skip(f"this jax ({jax.__version__}) lowers Triton kernels only with a GPU present")
    assert {k: ours.get(k, 0) for k in LAYER_KINDS} == LAYER_KINDS
    assert ours.get("optimization_barrier", 0) == 0 and stock["optimization_barrier"] == 1
    assert sum(ours.values()) == LAYER_OPS < sum(stock.values())
    assert stock["reduce"] > ours["reduce"] and stock["transpose"] > ours["transpose"]
