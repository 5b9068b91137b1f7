"""IcePop, sequence rejection (arithmetic and geometric mean) and DPPO-style mask-KL against NumPy
written from their definitions (Ring-1T's IcePop, 2025; verl's rollout-correction rejection;
prime-rl's masked loss with a KL on the log-ratio), and verl 0.9.1's k3+ under a clamp."""

import jax
import jax.numpy as jnp
import numpy as np

from rljax import objectives as obj
from rljax.objectives import rollout_correction as rc

# per-token trainer/sampler ratios k = pi_old / mu on one row, chosen around the bounds
K = np.array([[0.4, 0.6, 1.0, 4.0, 6.0, 1.0],
              [1.1, 1.2, 1.3, 0.0, 0.0, 0.0],
              [0.3, 3.0, 1.0, 1.0, 0.0, 0.0],
              [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
MASK = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], float)


def _logps(k=K, mask=MASK):
    mu = np.where(mask > 0, -np.linspace(0.5, 2.0, k.size).reshape(k.shape), -np.inf)  # padding: -inf
    old = np.where(mask > 0, mu + np.log(np.where(mask > 0, k, 1.0)), 0.0)
    return jnp.asarray(old), jnp.asarray(mu)


def test_icepop_weights_are_the_ratio_inside_asymmetric_bounds():
    """w = k inside [0.5, 5], 0 outside; the mask is unchanged, so a zeroed token stays in a
    token-mean's denominator. Fails with a flipped bound (k > high kept), with MIS's weight 1
    inside, with a symmetric band [1/5, 5] (keeps k = 0.4), or with zeroed tokens dropped from
    the mask (the denominator would shrink)."""
    with jax.enable_x64(True):
        old, mu = _logps()
        w, m = rc.icepop(old, mu, jnp.asarray(MASK), low=0.5, high=5.0)
    want = np.where((K >= 0.5) & (K <= 5.0) & (MASK > 0), K, 0.0)
    np.testing.assert_allclose(np.asarray(w) * MASK, want, rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(m), MASK)
    loss_bt = np.ones_like(K)  # a unit per-token loss: the token-mean is sum(w) / #mask tokens
    with jax.enable_x64(True):
        got = float(obj.aggregate(jnp.asarray(loss_bt) * w, m, "token-mean"))
    np.testing.assert_allclose(got, want.sum() / MASK.sum(), rtol=1e-12)


def test_icepop_and_mask_kl_at_sequence_level_gate_the_row_product():
    """level = "sequence": every token of a row gets the row's product of ratios prod_t k_t
    (icepop) or 1 (mask_kl) when that product lies in [0.5, 5], else 0. Row 0's product is 5.76
    (zeroed, though four of its six tokens are inside), row 1's 1.716, row 2's 0.9. Fails with the
    per-token gate at sequence level, or with a product over padded tokens (k = 0 there)."""
    prod = np.prod(np.where(MASK > 0, K, 1.0), axis=1, keepdims=True)
    inside = (prod >= 0.5) & (prod <= 5.0)
    with jax.enable_x64(True):
        old, mu = _logps()
        w_ice, m_ice = rc.icepop(old, mu, jnp.asarray(MASK), level="sequence", low=0.5, high=5.0)
        w_mkl, _ = rc.mask_kl(old, mu, jnp.asarray(MASK), level="sequence", low=0.5, high=5.0)
    np.testing.assert_allclose(np.asarray(w_ice) * MASK, np.where(inside, prod, 0.0) * MASK, rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(w_mkl) * MASK, inside * MASK)
    np.testing.assert_array_equal(np.asarray(m_ice), MASK)
    assert list(inside[:3, 0]) == [False, True, True]


def np_seq_ratio(k, mask, mean):
    n = np.maximum(mask.sum(1), 1)
    if mean == "arithmetic":
        return (k * mask).sum(1) / n
    return np.exp((np.log(np.where(mask > 0, k, 1.0)) * mask).sum(1) / n)


def test_sequence_rejection_arithmetic_and_geometric():
    """A row is rejected (its tokens leave the mask) when its mean ratio is outside [low, high].
    Row 2 (k = 0.3, 3, 1, 1) has arithmetic mean 1.325 and geometric mean 0.97: with [0.8, 1.25]
    the arithmetic rule rejects it and the geometric keeps it, so swapping the means fails; row 1
    (1.2 either way) is kept and row 0 (2.17, 1.34) rejected by both, so a flipped bound fails."""
    low, high = 0.8, 1.25
    for mean in ("arithmetic", "geometric"):
        s = np_seq_ratio(K, MASK, mean)
        keep = (s >= low) & (s <= high)
        with jax.enable_x64(True):
            old, mu = _logps()
            w, m = rc.sequence_rejection(old, mu, jnp.asarray(MASK), low=low, high=high, mean=mean)
        np.testing.assert_array_equal(np.asarray(m), MASK * keep[:, None], err_msg=mean)
        np.testing.assert_array_equal(np.asarray(w), np.ones_like(K))
    arith = np_seq_ratio(K, MASK, "arithmetic")[:3]
    geo = np_seq_ratio(K, MASK, "geometric")[:3]
    assert list((arith >= low) & (arith <= high)) != list((geo >= low) & (geo <= high))


def test_mask_kl_masks_out_of_band_tokens_and_penalises_them_with_k2():
    """mask_kl: weight 1 inside [0.5, 5], 0 outside (mask kept); its loss term is
    coef * 1/2 (log pi - log mu)^2 on the zeroed tokens only, with gradient coef (log pi - log mu)
    there. Fails with the KL on the kept tokens, a flipped bound, or prime-rl's first-order term
    (whose gradient is coef on every zeroed token, pushing log pi down even where pi < mu)."""
    with jax.enable_x64(True):
        old, mu = _logps()
        w, m = rc.mask_kl(old, mu, jnp.asarray(MASK), low=0.5, high=5.0)
    inside = (K >= 0.5) & (K <= 5.0)
    np.testing.assert_array_equal(np.asarray(w) * MASK, (inside & (MASK > 0)).astype(float))
    zeroed = np.asarray(rc.mask_kl_tokens(w, m))
    np.testing.assert_array_equal(zeroed, (~inside & (MASK > 0)).astype(float))
    rng = np.random.default_rng(0)
    logp = np.asarray(old) + rng.normal(scale=0.2, size=K.shape)
    mu_np = np.asarray(mu)
    coef = 0.3
    with jax.enable_x64(True):
        f = lambda lp: coef * jnp.sum(rc.mask_kl_penalty(lp, mu, jnp.asarray(zeroed)))  # noqa: E731
        val, grad = jax.value_and_grad(f)(jnp.asarray(logp))
    d = np.where(zeroed > 0, logp - mu_np, 0.0)
    np.testing.assert_allclose(float(val), coef * 0.5 * np.sum(d ** 2), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(grad), coef * d, rtol=1e-12)
    assert np.any(d < 0) and np.any(d > 0)  # tokens on both sides of mu are pulled back


def np_verl_kl_penalty_k3_plus(logp, ref, clamp):
    """verl 0.9.1 kl_penalty(..., 'k3+'): forward = clamp(exp(clamp(ref - logp, -20, 20)) - (ref - logp)
    - 1, -c, c); backward = 0.5 (logp - ref)^2; returned backward - sg(backward) + sg(forward):
    value = forward, gradient = logp - ref everywhere."""
    kl = np.clip(ref - logp, -20, 20)
    forward = np.clip(np.exp(kl) - kl - 1, -clamp, clamp)
    return forward, logp - ref


def test_k3_plus_under_a_clamp_keeps_k2_gradient():
    """kl(..., 'k3+', clamp=10) has verl's value clip(k3, -10, 10) and keeps k2's gradient on the
    clamped tokens: 25 where log pi - log ref = 25 (k3 = 24 > 10), which the old clip of the whole
    straight-through sum made 0."""
    logp = np.array([-1.0, -0.5, -2.0, -0.3])
    ref = np.array([-26.0, -0.7, -1.0, -12.0])
    want_v, want_g = np_verl_kl_penalty_k3_plus(logp, ref, 10.0)
    with jax.enable_x64(True):
        f = lambda lp: obj.kl(lp, jnp.asarray(ref), "k3+", clamp=10.0)  # noqa: E731
        v = np.asarray(f(jnp.asarray(logp)))
        g = np.asarray(jax.grad(lambda lp: jnp.sum(f(lp)))(jnp.asarray(logp)))
    np.testing.assert_allclose(v, want_v, rtol=1e-12)
    np.testing.assert_allclose(g, want_g, rtol=1e-12)
    assert v[0] == 10.0 and g[0] == 25.0
