"""The two-pass draw (`rljax.sampling.one_pass`): the filtered law by chi-square, the reference's
log-probs to 1e-6, and the samplers' own guarantees with it switched on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import rljax.models as M
from rljax.sampling import SampleControls, filtered_logprobs, generate, make_filters
from rljax.sampling.filters import sample_logits_from_uniforms
from rljax.sampling.one_pass import draw_one_pass

CONTROLS = [  # (temperature, top_k, top_p, min_p)
    (0.7, 0, 1.0, 0.0), (1.0, 10, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.1), (0.8, 20, 0.9, 0.05),
    (1.2, 0, 0.9, 0.05)]


def _numpy_law(logits, temperature, top_k, top_p, min_p):
    """The filtered softmax in float64, written from the papers in transformers' order: temperature,
    top-k (Fan et al., 2018), top-p (Holtzman et al., 2020: keep a token when the mass of the more
    likely ones is < p), min-p (Nguyen et al., 2024: p >= min_p * max p), renormalised after each."""
    z = np.asarray(logits, np.float64) / temperature
    keep = np.ones(z.shape, bool)
    if top_k:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    for stage in ("p", "min"):
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        p /= p.sum()
        if stage == "p" and top_p < 1:
            order = np.argsort(-p, kind="stable")
            keep[order[(np.cumsum(p[order]) - p[order]) >= top_p]] = False
        if stage == "min" and min_p > 0:
            keep &= p >= min_p * p.max()
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return p / p.sum()


def _chi_square_pvalue(tokens, probs):
    """Chi-square p-value of the token counts against `probs`; 0 when a token off its support was drawn."""
    counts = np.bincount(tokens, minlength=probs.size)
    support = probs > 0
    if counts[~support].sum():
        return 0.0
    return scipy.stats.chisquare(counts[support], len(tokens) * probs[support]).pvalue


def _draws(logits, t, k, p, mp, draws=40_000, *, law_t=None):
    filters = make_filters(t, k, p, mp, False)
    u = jax.random.uniform(jax.random.key(0), (draws,), jnp.float32)
    x = jnp.tile(jnp.asarray(logits, jnp.float32), (draws, 1))
    run = jax.jit(lambda u, x: draw_one_pass(u, x, law_t or t, p, mp, filters=filters))
    return [np.asarray(a) for a in run(u, x)]


# 40 entries: the inverse CDF's blocks (16) do not divide the vocabulary, so its padding is drawn through.
LOGITS = 1.5 * np.asarray(jax.random.normal(jax.random.key(3), (40,)))


@pytest.mark.parametrize("controls", CONTROLS)
def test_one_pass_frequencies_match_filtered_distribution(controls):
    """40k draws (one uniform each, fixed seed) over a 40-token vocabulary match the NumPy filtered
    softmax (chi-square p > 1e-3; no filtered-out token drawn), and each draw's two log-probs are
    log of the NumPy law and of the temperature-1 softmax (1e-5). Catches a wrong block cumsum, a
    filter applied to the wrong distribution (min-p before top-p, top-p on untempered logits), a
    padding entry drawn, the policy log-prob taken at the sampling temperature."""
    t, k, p, mp = controls
    tokens, logp, slp = _draws(LOGITS, t, k, p, mp)
    law = _numpy_law(LOGITS, t, k, p, mp)
    assert _chi_square_pvalue(tokens, law) > 1e-3
    np.testing.assert_allclose(slp, np.log(law[tokens]), atol=1e-5)
    x = LOGITS.astype(np.float64)
    np.testing.assert_allclose(logp, (x - x.max() - np.log(np.exp(x - x.max()).sum()))[tokens], atol=1e-5)


@pytest.mark.parametrize("controls", [(0.7, 0, 1.0, 0.0), (0.8, 20, 0.9, 0.05)])
def test_chi_square_has_power_against_a_wrong_law(controls):
    """The same check rejects a draw that forgets the temperature (samples at T = 1 where the law
    says T): p < 1e-12 with these 40k draws (or a token off the support), so the frequency test
    above can fail."""
    t, k, p, mp = controls
    tokens, _, _ = _draws(LOGITS, t, k, p, mp, law_t=1.0)
    assert _chi_square_pvalue(tokens, _numpy_law(LOGITS, t, k, p, mp)) < 1e-12


@pytest.mark.parametrize("controls", CONTROLS + [(0.0, 0, 1.0, 0.0)])
def test_one_pass_equals_the_reference_draw(controls):
    """Given the same uniforms on 256 rows of a 1000-token vocabulary, the two-pass draw picks the
    reference's token on (almost) every row (a draw on a CDF boundary may round the other way), and
    its policy and sampling log-probs equal the reference's (`logprobs_from_logits`,
    `filtered_logprobs`) at its token within 1e-6 in f32. Greedy: the first arg-max and log-prob 0.
    Catches a log-sum-exp over the wrong axis or blocks, the tempered maximum taken after min-p, the
    policy log-prob from the filtered distribution."""
    t, k, p, mp = controls
    filters = make_filters(t, k, p, mp, False)
    x = 2.0 * jax.random.normal(jax.random.key(1), (256, 1000), jnp.float32)  # |log-sum-exp| < 8: 1e-6 ~ 1 ulp
    u = jax.random.uniform(jax.random.key(2), (256,), jnp.float32)
    tscal = np.float32(t or 1.0)
    tok, logp, slp = jax.jit(lambda u, x: draw_one_pass(u, x, tscal, p, mp, filters=filters))(u, x)
    ref_tok, _ = jax.jit(lambda u, x: sample_logits_from_uniforms(u, x, tscal, p, mp, filters=filters))(u, x)
    assert np.mean(np.asarray(tok) == np.asarray(ref_tok)) >= 0.99
    ref_logp, _ = M.logprobs_from_logits(x[:, None, :], tok[:, None])
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp[:, 0]), atol=1e-6, rtol=0)
    full = filtered_logprobs(x, tscal, p, mp, filters=filters)
    ref_slp = np.asarray(jnp.take_along_axis(full, tok[:, None], axis=1)[:, 0])
    np.testing.assert_allclose(np.asarray(slp), ref_slp, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def tiny():
    cfg = M.preset("qwen2-test")
    return cfg, M.init_params(cfg, jax.random.key(0), std=0.2)


def test_samplers_with_one_pass_keep_their_guarantees(tiny):
    """With `draw="one_pass"`: static and continuous batching agree bitwise in batch-invariant mode
    (tokens, both log-probs, lengths), the policy log-probs equal the trainer's `token_logprobs`
    within 1e-5 (f32), and "auto" resolves to the reference on this CPU (CPU runs keep their
    tokens). Catches the one-pass draw not reached from `decode.draw` (then the slots and static
    loops could differ), or its policy log-prob not the trainer's."""
    cfg, params = tiny
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    mask = np.arange(8)[None, :] >= 8 - np.asarray([5, 2])[:, None]
    tokens = np.where(mask, tokens, 0)
    controls = SampleControls(max_new_tokens=16, num_samples=2, temperature=0.9, min_p=0.02, eos_ids=(3, 7),
                              batch_invariant=True, draw="one_pass")
    assert SampleControls(max_new_tokens=4).static().draw == "reference"
    assert controls.static().draw == "one_pass"
    static = generate(cfg, params, tokens, mask, key=jax.random.key(4), controls=controls)
    cont = generate(cfg, params, tokens, mask, key=jax.random.key(4),
                    controls=controls.replace(scheduler="continuous", slots=2))
    for field in ("tokens", "logprobs", "sampling_logprobs", "lengths", "mask"):
        np.testing.assert_array_equal(np.asarray(getattr(cont, field)), np.asarray(getattr(static, field)), field)
    full = np.concatenate([np.repeat(tokens, 2, 0), np.asarray(static.tokens)], 1)
    full_mask = np.concatenate([np.repeat(mask, 2, 0), np.asarray(static.mask)], 1)
    logp, _ = M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))
    sel = np.asarray(static.mask)
    assert sel.sum() > 20
    np.testing.assert_allclose(np.asarray(static.logprobs)[sel], np.asarray(logp)[:, 8:][sel], atol=1e-5, rtol=0)
