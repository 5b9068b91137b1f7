"""FP8 rollout weights (`rljax.sampling.fp8`): the e4m3 round trip against NumPy, what it touches,
the sampler/trainer mismatch it adds (measured), and TIS weights on that mismatch against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.models as M
from rljax.errors import ConfigError
from rljax.objectives.losses import truncated_is
from rljax.sampling import SampleControls, generate
from rljax.sampling.fp8 import E4M3_MAX, dequantize_fp8, fp8_sampler_params, quantize_fp8


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


def test_fp8_mismatch_is_measured_and_tis_weights_equal_numpy(tiny):
    """Sampling with FP8 weights: the sampler's policy log-probs differ from the f32 trainer's on
    the same tokens by a measured amount (BENCHMARKS.md; far above the 1e-5 of the model-dtype
    sampler; this random model with 0.2-std weights is sharper than a trained one), and token-level TIS (cap 2) on that mismatch gives
    min(exp(logp_trainer - logp_sampler), 2) as NumPy computes it. Catches the FP8 copy not
    reaching the sampler (the mismatch would be ~1e-6), or the trainer scoring with it."""
    cfg, params = tiny
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (4, 8)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    controls = SampleControls(max_new_tokens=16, num_samples=2, temperature=1.0, weight_dtype="fp8")
    res = generate(cfg, params, tokens, mask, key=jax.random.key(4), controls=controls)
    full = np.concatenate([np.repeat(tokens, 2, 0), np.asarray(res.tokens)], 1)
    full_mask = np.concatenate([np.repeat(mask, 2, 0), np.asarray(res.mask)], 1)
    trainer, _ = M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))
    trainer = np.asarray(trainer)[:, 8:]
    sampler = np.asarray(res.logprobs)
    sel = np.asarray(res.mask)
    diff = np.abs(sampler - trainer)[sel]
    print(f"fp8 sampler vs f32 trainer: mean {diff.mean():.3e} max {diff.max():.3e} nats over {sel.sum()} tokens")
    assert 1e-3 < diff.mean() < 0.5
    w, m = truncated_is(jnp.asarray(trainer), jnp.asarray(sampler), jnp.asarray(sel, jnp.float32), cap=2.0)
    want = np.where(sel, np.minimum(np.exp(trainer.astype(np.float64) - sampler), 2.0), 1.0)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(m), sel.astype(np.float32))
