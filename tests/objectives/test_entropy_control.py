"""Clip-Cov and KL-Cov (Cui et al., 2025) against NumPy written from verl 0.9's
`compute_policy_loss_clip_cov` / `compute_policy_loss_kl_cov`, the high-entropy quantile mask
against TRL's `get_high_entropy_mask` semantics, and the adaptive entropy coefficient against
Skywork-OR1's rule.

Convention differences from verl, by design: the selection runs over the whole mini-batch (verl:
each micro-batch), the random draw comes from a JAX key (verl: torch.randperm, so the tests
inject JAX's selection into the NumPy loss), and every ratio is exp of a log-ratio clamped to
+-20 (verl's clip_cov/kl_cov exponentiate unclamped; no test value comes near the clamp)."""

import jax
import jax.numpy as jnp
import numpy as np

from rljax import objectives as obj
from rljax.objectives import entropy_control as ec


def _case(seed=0, b=8, t=9):
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, t))
    for i in range(b - 1):
        mask[i, : rng.integers(2, t + 1)] = 1  # the last row is empty
    logp = -rng.random((b, t)) * 3
    old = logp + rng.normal(scale=0.3, size=(b, t))
    adv = np.repeat(rng.normal(scale=1.5, size=(b, 1)), t, 1) * mask
    return logp, old, adv, mask


def np_cov(logp, adv, mask):
    """verl: (A - masked_mean(A)) * (logp - masked_mean(logp)) over the response mask."""
    on = mask > 0
    return (adv - adv[on].mean()) * (logp - logp[on].mean())


def np_clip_cov_candidates(logp, old, adv, mask, el, eh, lb, ub):
    """verl's clip_cov: cov set to -inf off the mask and where PPO clipped (pg2 > pg1), then the
    candidates lb < cov < ub on the mask; clip_num = max(int(ratio * N), 1)."""
    r = np.exp(logp - old)
    pg1, pg2 = -adv * r, -adv * np.clip(r, 1 - el, 1 + eh)
    cov = np_cov(logp, adv, mask)
    cov[mask == 0] = -np.inf
    cov[(pg2 > pg1) & (mask > 0)] = -np.inf
    return (cov < ub) & (cov > lb) & (mask > 0)


def np_clip_cov_loss_and_grad(logp, old, adv, mask, el, eh, corr):
    """verl's pg_losses = max(pg1, pg2) * corr, token-mean; its gradient in log pi: -A r where
    the unclipped term is the larger (r's derivative in log pi is r), 0 where clipped, times corr."""
    r = np.exp(logp - old)
    pg1, pg2 = -adv * r, -adv * np.clip(r, 1 - el, 1 + eh)
    n = mask.sum()
    loss = (np.maximum(pg1, pg2) * corr * mask).sum() / n
    grad = np.where(pg1 >= pg2, -adv * r, 0.0) * corr * mask / n
    return loss, grad


def test_clip_cov_selection_loss_and_gradient_match_verl():
    """The selection is min(max(int(ratio N), 1), #candidates) tokens, all among verl's
    candidates; with that selection injected, loss and gradient equal verl's. Fails with a
    flipped bound (cov > ub), with PPO-clipped tokens left eligible, or with the zeroed tokens
    dropped from the denominator."""
    logp, old, adv, mask = _case(0)
    el, eh, lb, ub, ratio = 0.2, 0.28, 0.05, 2.0, 0.3
    cand = np_clip_cov_candidates(logp, old, adv, mask, el, eh, lb, ub)
    assert 3 < cand.sum() < mask.sum()
    sel = np.asarray(ec.clip_cov_select(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                        jax.random.key(3), ratio=ratio, lb=lb, ub=ub, eps_low=el, eps_high=eh))
    want_n = min(max(int(ratio * mask.sum()), 1), int(cand.sum()))
    assert sel.sum() == want_n and np.all(cand[sel])
    corr = 1.0 - sel
    want_loss, want_grad = np_clip_cov_loss_and_grad(logp, old, adv, mask, el, eh, corr)
    m = jnp.asarray(mask)

    def f(lp):
        per, _ = obj.POLICY_LOSSES.get("clip_cov")(lp, jnp.asarray(old), jnp.asarray(adv), m, eps_low=el,
                                                   eps_high=eh, select_bt=jnp.asarray(sel))
        return obj.aggregate(per, m, "token-mean")

    with jax.enable_x64(True):
        loss, grad = jax.value_and_grad(f)(jnp.asarray(logp))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-10, atol=1e-14)
    # another key draws another subset of the same candidates, of the same size
    other = np.asarray(ec.clip_cov_select(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), m,
                                          jax.random.key(4), ratio=ratio, lb=lb, ub=ub, eps_low=el, eps_high=eh))
    assert other.sum() == want_n and np.all(cand[other]) and not np.array_equal(other, sel)


def test_clip_cov_selects_at_least_one_token():
    """verl's max(int(ratio N), 1): the paper's 2e-4 of ~60 tokens still selects one. Fails with
    int(ratio N) alone (0 tokens)."""
    logp, old, adv, mask = _case(1)
    sel = ec.clip_cov_select(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                             jax.random.key(0), ratio=2e-4, lb=-100.0, ub=100.0, eps_low=0.2, eps_high=0.2)
    assert int(np.asarray(sel).sum()) == 1


def np_kl_cov(logp, old, adv, mask, ratio, coef):
    """verl's kl_cov: top max(1, int(N ratio)) valid tokens by cov get -A r + coef |log r|, the
    rest -A r; token-mean. Gradient: -A r + coef sign(log r) on the selected."""
    on = mask > 0
    idx = np.flatnonzero(on.reshape(-1))
    cov = np_cov(logp, adv, mask).reshape(-1)[idx]
    k = max(1, int(len(idx) * ratio))
    sel = np.zeros(mask.size, bool)
    sel[idx[np.argsort(-cov)[:k]]] = True
    sel = sel.reshape(mask.shape)
    lr = logp - old
    r = np.exp(lr)
    n = mask.sum()
    loss = ((-adv * r + sel * coef * np.abs(lr)) * mask).sum() / n
    grad = (-adv * r + sel * coef * np.sign(lr)) * mask / n
    return sel, loss, grad


def test_kl_cov_selection_loss_and_gradient_match_verl():
    """KL-Cov's top-k by covariance, its loss and gradient equal verl's. Fails with a bottom-k
    (argsort without the minus), with the mean over padded tokens in the covariance, or with
    clipping on the unselected tokens."""
    logp, old, adv, mask = _case(2)
    ratio, coef = 0.15, 0.7
    want_sel, want_loss, want_grad = np_kl_cov(logp, old, adv, mask, ratio, coef)
    sel = np.asarray(ec.kl_cov_select(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), ratio=ratio))
    np.testing.assert_array_equal(sel, want_sel)
    m = jnp.asarray(mask)

    def f(lp):
        per, _ = obj.POLICY_LOSSES.get("kl_cov")(lp, jnp.asarray(old), jnp.asarray(adv), m,
                                                 select_bt=jnp.asarray(sel), kl_cov_coef=coef)
        return obj.aggregate(per, m, "token-mean")

    with jax.enable_x64(True):
        loss, grad = jax.value_and_grad(f)(jnp.asarray(logp))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-10, atol=1e-14)


def test_covariance_ignores_padding():
    """Garbage log-probs (even -inf) and advantages on padding change neither the covariance on
    valid tokens nor the selection. Fails with means over the whole [B, T] array."""
    logp, old, adv, mask = _case(3)
    dirty_lp = np.where(mask > 0, logp, -np.inf)
    dirty_adv = np.where(mask > 0, adv, 50.0)
    clean = np.asarray(ec.token_covariance(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask)))
    dirty = np.asarray(ec.token_covariance(jnp.asarray(dirty_lp), jnp.asarray(dirty_adv), jnp.asarray(mask)))
    np.testing.assert_allclose(dirty, clean, rtol=1e-6)
    np.testing.assert_allclose(clean[mask > 0], np_cov(logp, adv, mask)[mask > 0], rtol=1e-5, atol=1e-6)


def test_entropy_quantile_mask_matches_numpy_over_valid_tokens():
    """rho's mask keeps the valid tokens with entropy >= the (1 - rho) linear quantile of the VALID
    tokens' entropies (TRL's get_high_entropy_mask). Padding holds entropy 0 on more than half
    the array here, so a quantile over padded tokens gives a lower threshold and keeps more.
    rho = 1 keeps every valid token."""
    rng = np.random.default_rng(5)
    mask = np.zeros((6, 10))
    mask[:, :4] = 1
    ent = np.where(mask > 0, rng.random((6, 10)) * 3, 0.0)
    for rho in (0.2, 0.5):
        thr = np.quantile(ent[mask > 0], 1 - rho)
        want = (mask > 0) & (ent >= thr)
        got = np.asarray(ec.entropy_quantile_mask(jnp.asarray(ent, jnp.float32), jnp.asarray(mask), rho))
        np.testing.assert_array_equal(got > 0, want)
        wrong = (mask > 0) & (ent >= np.quantile(ent, 1 - rho))  # the quantile over padded tokens
        assert not np.array_equal(wrong, want)
    assert np.array_equal(np.asarray(ec.entropy_quantile_mask(jnp.asarray(ent), jnp.asarray(mask), 1.0)), mask)


def test_adaptive_entropy_coefficient_moves_toward_the_target():
    """Skywork-OR1's update, step by step against NumPy: +step while entropy < target, -step above,
    never below 0. Fails with the sign flipped (the coefficient would grow as entropy rises)."""
    c, target, step = 0.002, 0.5, 1e-3
    want = c
    for e in (0.3, 0.2, 0.6, 0.9, 0.9, 0.9, 0.4):
        want = max(want + step * np.sign(target - e), 0.0)
        c = ec.adaptive_entropy_coef(jnp.float32(c), jnp.float32(e), target, step)
        np.testing.assert_allclose(float(c), want, atol=1e-9)
    assert float(ec.adaptive_entropy_coef(jnp.float32(0.0), jnp.float32(1.0), target, step)) == 0.0
