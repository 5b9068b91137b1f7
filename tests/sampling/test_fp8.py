"""FP8 rollout weights (`rljax.sampling.fp8`): the e4m3 round trip against NumPy, what it touches,
the sampler/trainer mismatch it adds (measured), and TIS weights on that mismatch against NumPy;
the W8A8 form (`rljax.models.fp8.Fp8Weight`) against a NumPy W8A8 matmul, its bytes, and its FP8
dots in the decode step lowered for cuda."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import rljax.models as M
from rljax.errors import ConfigError
from rljax.objectives.losses import truncated_is
from rljax.sampling import SampleControls, generate
from rljax.models.fp8 import Fp8Weight
from rljax.sampling.fp8 import E4M3_MAX, dequantize_fp8, fp8_sampler_params, quantize_fp8, w8a8_sampler_params


def _numpy_e4m3(x):
    """Round to the nearest float8_e4m3fn value, ties to even (|x| <= 448): 3 mantissa bits, so the
    spacing is 2^(e - 3) for |x| in [2^e, 2^(e+1)), e >= -6, and 2^-9 below (subnormals)."""
    a = np.abs(x).astype(np.float64)
    e = np.maximum(np.floor(np.log2(np.maximum(a, 2.0**-9))), -6)
    step = 2.0 ** (e - 3)
    return np.sign(x) * np.round(a / step) * step


@pytest.mark.parametrize("shape,in_axes", [((2, 16, 3, 4), (1,)), ((2, 3, 4, 16), (1, 2))])
def test_round_trip_equals_numpy(shape, in_axes):
    """Per-output-channel scales (max |w| over the input axes / 448) and e4m3 rounding equal NumPy's
    (scales to an f32 ulp, the rounded values bit for bit in f32), with weights spanning 6 decades (subnormals included); each channel's
    largest weight maps to +-448 exactly and no value errs by more than half a spacing (2^-4
    relative). Catches a per-tensor scale, a scale over the output axes, truncation instead of
    rounding, e5m2 instead of e4m3, values past 448 turned to NaN."""
    rng = np.random.default_rng(0)
    w = (rng.normal(size=shape) * 10.0 ** rng.uniform(-4, 2, size=shape)).astype(np.float32)
    q, scale = quantize_fp8(jnp.asarray(w), in_axes)
    assert q.dtype == jnp.float8_e4m3fn
    amax = np.max(np.abs(w), axis=in_axes, keepdims=True)
    np.testing.assert_allclose(np.asarray(scale), amax / np.float32(E4M3_MAX), rtol=2e-7)  # XLA: x * (1 / 448)
    np_scale = np.asarray(scale)
    scaled = (w / np_scale).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), _numpy_e4m3(scaled).astype(np.float32))
    back = np.asarray(dequantize_fp8(q, scale, jnp.float32))
    np.testing.assert_array_equal(back, (_numpy_e4m3(scaled) * np_scale).astype(np.float32))
    assert np.all(np.max(np.abs(np.asarray(q.astype(jnp.float32))), axis=in_axes) == E4M3_MAX)
    normal = np.abs(scaled) >= 2.0**-6
    assert np.all(np.abs(back - w)[normal] <= 2.0**-4 * np.abs(w)[normal] + 1e-30)


_MISMATCH = {}


@pytest.fixture(scope="module")
def tiny():
    cfg = M.preset("qwen2-test")
    return cfg, M.init_params(cfg, jax.random.key(0), std=0.2)


def test_only_the_dense_layer_weights_change(tiny):
    """The FP8 copy changes q, k, v, o, gate, up, down and nothing else (embedding, norms, biases,
    LM head are the trainer's), stacked or split per layer alike; a bad weight_dtype is one
    ConfigError line."""
    cfg, params = tiny
    fp8 = fp8_sampler_params(params)
    for name, w in params["layers"].items():
        same = np.array_equal(np.asarray(fp8["layers"][name]), np.asarray(w))
        assert same == (name not in ("q", "k", "v", "o", "gate", "up", "down")), name
    for name in params:
        if name != "layers":
            np.testing.assert_array_equal(np.asarray(fp8[name]), np.asarray(params[name]))
    split = fp8_sampler_params(M.unstack_layers(params))
    np.testing.assert_array_equal(np.asarray(split["layers"][1]["down"]), np.asarray(fp8["layers"]["down"][1]))
    with pytest.raises(ConfigError, match="weight_dtype"):
        SampleControls(max_new_tokens=4, weight_dtype="int4")


@pytest.mark.parametrize("weight_dtype,kv_dtype", [("fp8", "model"), ("fp8_w8a8", "model"), ("fp8_w8a8", "fp8")])
def test_fp8_mismatch_is_measured_and_tis_weights_equal_numpy(tiny, weight_dtype, kv_dtype):
    """Sampling with FP8 weights: the sampler's policy log-probs differ from the f32 trainer's on
    the same tokens by a measured amount (BENCHMARKS.md; far above the 1e-5 of the model-dtype
    sampler; this random model with 0.2-std weights is sharper than a trained one), and token-level TIS (cap 2) on that mismatch gives
    min(exp(logp_trainer - logp_sampler), 2) as NumPy computes it. Catches the FP8 copy not
    reaching the sampler (the mismatch would be ~1e-6), or the trainer scoring with it; for W8A8
    also the activation rounding adding nothing (its mean must exceed weight-only's); with the FP8
    KV cache (`kv_dtype = "fp8"`, static scheduler) the option not reaching the prefill (the
    mismatch would equal W8A8's bitwise). The continuous layouts' FP8 cache:
    tests/sampling/test_fp8_kv_layouts.py."""
    cfg, params = tiny
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (4, 8)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    controls = SampleControls(max_new_tokens=16, num_samples=2, temperature=1.0, weight_dtype=weight_dtype,
                              kv_dtype=kv_dtype)
    res = generate(cfg, params, tokens, mask, key=jax.random.key(4), controls=controls)
    full = np.concatenate([np.repeat(tokens, 2, 0), np.asarray(res.tokens)], 1)
    full_mask = np.concatenate([np.repeat(mask, 2, 0), np.asarray(res.mask)], 1)
    trainer, _ = M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))
    trainer = np.asarray(trainer)[:, 8:]
    sampler = np.asarray(res.logprobs)
    sel = np.asarray(res.mask)
    diff = np.abs(sampler - trainer)[sel]
    print(f"{weight_dtype} weights, {kv_dtype} KV sampler vs f32 trainer: mean {diff.mean():.3e} max "
          f"{diff.max():.3e} nats over {sel.sum()} tokens")
    assert 1e-3 < diff.mean() < 0.5
    _MISMATCH[weight_dtype, kv_dtype] = diff.mean()
    if ("fp8_w8a8", "model") in _MISMATCH and ("fp8", "model") in _MISMATCH:
        assert _MISMATCH["fp8_w8a8", "model"] > _MISMATCH["fp8", "model"]
    if ("fp8_w8a8", "fp8") in _MISMATCH and ("fp8_w8a8", "model") in _MISMATCH:
        assert _MISMATCH["fp8_w8a8", "fp8"] != _MISMATCH["fp8_w8a8", "model"]
    w, m = truncated_is(jnp.asarray(trainer), jnp.asarray(sampler), jnp.asarray(sel, jnp.float32), cap=2.0)
    want = np.where(sel, np.minimum(np.exp(trainer.astype(np.float64) - sampler), 2.0), 1.0)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(m), sel.astype(np.float32))


def _numpy_w8a8(x_mk, w_kn):
    """W8A8 written from its definition with ml_dtypes' e4m3 cast: x per row and w per column
    scaled to amax 448, both cast to float8_e4m3fn, the integer-exact products summed in float64,
    times both scales."""
    sx = np.abs(x_mk).max(1, keepdims=True) / np.float32(448)
    sw = np.abs(w_kn).max(0, keepdims=True) / np.float32(448)
    qx = (x_mk / sx).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    qw = (w_kn / sw).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (qx @ qw) * sx * sw


@pytest.mark.parametrize("contract", [1, 2])
def test_w8a8_project_equals_numpy(contract):
    """`project` on an `Fp8Weight` equals the NumPy W8A8 matmul within f32 rounding (the dot's
    operands are exact e4m3 values; only the f32 accumulation and the scale multiply round), for
    a plain [D, F] weight and the output projection's two contracted axes [N, H, D]; the rows span
    5 decades. Catches one activation scale for the whole tensor (the small rows lose their
    mantissa), a missing row or channel scale, scales over the wrong axes, activations left in
    the compute dtype (no FP8 rounding: off by up to 2^-4 relative)."""
    rng = np.random.default_rng(0)
    in_shape = (8, 16) if contract == 2 else (64,)
    x = rng.normal(size=(3, 4, *in_shape)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-3, 2, size=(3, 4) + (1,) * len(in_shape))).astype(np.float32)
    w = (rng.normal(size=(*in_shape, 24)) * 10.0 ** rng.uniform(-2, 1, size=24)).astype(np.float32)
    fw = Fp8Weight.quantize(jnp.asarray(w), tuple(range(contract)))
    assert fw.q.dtype == jnp.float8_e4m3fn and fw.scale.shape == (1,) * contract + (24,)
    got = np.asarray(M.layers.project(jnp.asarray(x), fw, contract, jnp.bfloat16))
    want = _numpy_w8a8(x.reshape(12, -1), w.reshape(-1, 24)).reshape(3, 4, 24)
    err = np.abs(got - want) / np.abs(want).max(-1, keepdims=True)  # relative to each row's scale
    assert err.max() < 1e-5, err.max()


def _layer_bytes(layers):
    return sum(x.nbytes for name in ("q", "k", "v", "o", "gate", "up", "down") for x in jax.tree.leaves(layers[name]))


def test_w8a8_sampler_weights_are_fp8_and_half_the_bytes():
    """The W8A8 copy of a bf16 model holds every dense layer weight as e4m3 values plus f32
    channel scales: (D + 4) / 2D of the bf16 bytes (0.53 at D = 64), and the rest of the params
    unchanged. Catches weights kept in bf16 (ratio 1), a scale per element (ratio 2.5)."""
    cfg = M.preset("qwen2-test", compute_dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), M.init_params(cfg, jax.random.key(0)))
    fp8 = w8a8_sampler_params(params)
    assert all(isinstance(fp8["layers"][n], Fp8Weight) and fp8["layers"][n].q.dtype == jnp.float8_e4m3fn
               for n in ("q", "k", "v", "o", "gate", "up", "down"))
    ratio = _layer_bytes(fp8["layers"]) / _layer_bytes(params["layers"])
    assert 0.5 < ratio < 0.55, ratio
    np.testing.assert_array_equal(np.asarray(fp8["embed"]), np.asarray(params["embed"]))


def _f8_dots(text: str) -> tuple[int, int]:
    """(dots with two float8_e4m3fn operands, all dots) in a lowered module's text."""
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    f8 = [d for d in dots if len(re.findall(r"tensor<[0-9x]*f8E4M3FN>", d.split(":")[-1].split("->")[0])) == 2]
    return len(f8), len(dots)


def test_w8a8_decode_step_lowers_fp8_dots_for_cuda():
    """The decode step with W8A8 weights, lowered for cuda (no GPU needed), multiplies FP8 x FP8 in
    all 7 dense projections of each of its 2 layers (the operands of a cuBLASLt FP8 GEMM); the
    LM head and attention stay bf16. Catches a dequantise-then-bf16-dot regression (0 FP8 dots),
    which a Hopper GPU would run at bf16 speed."""
    cfg = M.preset("qwen2-test", compute_dtype="bfloat16")
    params = w8a8_sampler_params(M.unstack_layers(M.init_params(cfg, jax.random.key(0))))
    rows = 8
    cache = M.init_cache(cfg, rows, 32)
    step = lambda p, c, tok: M.forward(cfg, p, tok, jnp.zeros((rows, 1), jnp.int32), None, c)[0]
    text = jax.jit(step).trace(params, cache, jnp.zeros((rows, 1), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    f8, total = _f8_dots(text)
    assert f8 == 7 * cfg.num_layers, (f8, total)
    assert total > f8  # the LM head and attention are still there, in bf16
