"""Policy losses, aggregation modes, KL estimators, value loss and off-policy corrections against
plain-NumPy references; gradients against finite differences; invariants; config and registries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import objectives as obj
from rljax.errors import ConfigError

B, T = 6, 7


def _case(seed=0, b=B, t=T):
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, t))
    for i in range(b):
        s = rng.integers(0, 3)
        mask[i, s:s + rng.integers(1, t - s + 1)] = 1
    mask[-1] = 0  # an empty row
    logp = -rng.random((b, t)) * 3
    old = logp + rng.normal(scale=0.4, size=(b, t))
    adv = np.repeat(rng.normal(size=(b, 1)), t, 1) * mask
    adv[0, :] = rng.normal(size=t) * mask[0]  # token-level advantages too
    return logp, old, adv, mask


# ----------------------------------------------------------------------------- NumPy references


def np_ppo(logp, old, adv, mask, el, eh, c=None):
    r = np.exp(logp - old)
    loss = np.maximum(-adv * r, -adv * np.clip(r, 1 - el, 1 + eh))
    if c is not None:
        loss = np.where(adv < 0, np.minimum(loss, -c * adv), loss)
    return loss


def np_gspo(logp, old, adv, mask, el, eh):
    n = np.maximum(mask.sum(1, keepdims=True), 1)
    s = np.exp(((logp - old) * mask).sum(1, keepdims=True) / n)
    return np.maximum(-adv * s, -adv * np.clip(s, 1 - el, 1 + eh))


def np_cispo(logp, old, adv, mask, el, eh, at=None):
    """`at`: where the stop-gradient weight is evaluated (the current log-probs by default)."""
    at = logp if at is None else at
    return -np.clip(np.exp(at - old), 1 - el, 1 + eh) * adv * logp


def np_topr(logp, old, adv, mask, el, eh, at=None):
    at = logp if at is None else at
    w = np.where(adv >= 0, 1.0, np.minimum(np.exp(at - old), 1.0))
    return -w * adv * logp


def np_pg(logp, old, adv, mask, el, eh):
    return -adv * np.exp(logp - old)


# clip_cov and kl_cov select no token when called without `select_bt` (their selected-token forms
# are checked in tests/objectives/test_entropy_control.py): PPO's clip and the unclipped -A r
NP_LOSSES = {"ppo_clip": np_ppo, "gspo": np_gspo, "cispo": np_cispo, "topr": np_topr, "pg": np_pg,
             "clip_cov": np_ppo, "kl_cov": np_pg}


def np_aggregate(loss, mask, mode, norm_length=None):
    """verl's agg_loss modes; the seq-mean modes average over rows with at least one token."""
    rows = [(loss[i] * mask[i]).sum() for i in range(len(mask))]
    counts = mask.sum(1)
    nonempty = int((counts > 0).sum())
    if mode == "token-mean":
        return sum(rows) / counts.sum()
    if mode == "token-sum":
        return sum(rows)
    if mode == "seq-mean-token-mean":
        per = [rows[i] / counts[i] for i in range(len(mask)) if counts[i] > 0]
        return sum(per) / len(per)
    if mode == "seq-mean-token-sum":
        return sum(rows) / nonempty
    return sum(rows) / (nonempty * (norm_length or mask.shape[1]))


def _jax_loss(name, logp, old, adv, mask, mode, el, eh, **kw):
    loss, _ = obj.POLICY_LOSSES.get(name)(logp, old, adv, mask, eps_low=el, eps_high=eh, **kw)
    return obj.aggregate(loss, mask, mode)


# ----------------------------------------------------------------------------- values and gradients


def test_registries_cover_the_issue():
    """Every estimator, loss, aggregation mode and KL estimator the issue names is registered."""
    assert set(obj.POLICY_LOSSES.names()) == set(NP_LOSSES)
    assert set(obj.AGGREGATIONS.names()) == {"token-mean", "token-sum", "seq-mean-token-mean",
                                            "seq-mean-token-sum", "seq-mean-token-sum-norm"}
    assert set(obj.KL_ESTIMATORS.names()) == {"k1", "k2", "k3", "abs", "k3+"}
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae",
            "reinforce"} == set(obj.ADVANTAGES.names())


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_aggregation_matches_numpy(mode):
    """Each aggregation mode matches its NumPy formula on ragged masks with a fully masked row.
    Catches the old seq-mean-token-sum(-norm), which divided by every row (B) instead of the
    non-empty ones, and the old registry without token-sum."""
    loss, _, _, mask = _case(1)
    got = obj.aggregate(jnp.asarray(loss, jnp.float32), jnp.asarray(mask), mode)
    np.testing.assert_allclose(float(got), np_aggregate(loss, mask, mode), rtol=1e-5)
    got = obj.aggregate(jnp.asarray(loss, jnp.float32), jnp.asarray(mask), mode, norm_length=20)
    np.testing.assert_allclose(float(got), np_aggregate(loss, mask, mode, 20), rtol=1e-5)


def test_aggregation_parts_add_across_row_splits():
    """(numerator, denominator) pairs summed over row blocks equal the full-batch aggregate exactly;
    token-sum's denominator is the constant 1, so its numerators add and its denominator does not."""
    loss, _, _, mask = _case(2, b=8)
    loss, mask = jnp.asarray(loss, jnp.float32), jnp.asarray(mask)
    for mode in obj.AGGREGATIONS.names():
        parts = [obj.aggregate_parts(loss[i:i + 2], mask[i:i + 2], mode) for i in range(0, 8, 2)]
        whole = obj.aggregate(loss, mask, mode)
        den = 1.0 if mode == "token-sum" else sum(p[1] for p in parts)
        np.testing.assert_allclose(sum(p[0] for p in parts) / den, whole, rtol=1e-6, err_msg=mode)


def test_fully_masked_rows_do_not_dilute_any_mode():
    """Appending fully masked rows (dynamic-sampling filler, sequences dropped by MIS) changes no
    mode's value. Catches the old seq-mean-token-sum and seq-mean-token-sum-norm, whose
    denominator counted every row: 4 filler rows on 6 shrank the loss by 6/10."""
    loss, _, _, mask = _case(9)
    rng = np.random.default_rng(3)
    padded_loss = np.concatenate([loss, rng.normal(size=(4, T))])
    padded_mask = np.concatenate([mask, np.zeros((4, T))])
    for mode in obj.AGGREGATIONS.names():
        a = obj.aggregate(jnp.asarray(loss, jnp.float32), jnp.asarray(mask), mode, norm_length=16)
        b = obj.aggregate(jnp.asarray(padded_loss, jnp.float32), jnp.asarray(padded_mask), mode, norm_length=16)
        np.testing.assert_allclose(float(b), float(a), rtol=1e-6, err_msg=mode)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "k3+"])
def test_kl_estimators_match_schulman(name):
    """k1 = log(pi/ref), k2 = log^2(pi/ref)/2, k3 = r - 1 - log r with r = ref/pi (Schulman 2020);
    abs = |log pi - log ref| and k3+ has k3's value (verl's kl_penalty). Catches the old registry,
    which had neither abs nor k3+."""
    logp, ref, _, _ = _case(3)
    lr = ref - logp
    k3 = np.exp(lr) - 1 - lr
    want = {"k1": -lr, "k2": 0.5 * lr**2, "k3": k3, "abs": np.abs(lr), "k3+": k3}[name]
    np.testing.assert_allclose(np.asarray(obj.kl(jnp.asarray(logp), jnp.asarray(ref), name)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "k3+"])
def test_kl_estimator_gradients(name):
    """d/d log pi of each estimator, written from its formula: k1 -> 1, k2 -> log pi - log ref,
    k3 -> 1 - ref/pi, abs -> sign(log pi - log ref), and k3+ -> k2's gradient (verl's straight-
    through "k3+": k3's value, k2's gradient). Catches an old registry without abs and k3+."""
    logp, ref, _, _ = _case(3)
    d = logp - ref
    want = {"k1": np.ones_like(d), "k2": d, "k3": 1 - np.exp(-d), "abs": np.sign(d), "k3+": d}[name]
    with jax.enable_x64(True):
        g = jax.grad(lambda lp: jnp.sum(obj.kl(lp, jnp.asarray(ref), name)))(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["k1", "k3", "k3+"])
def test_kl_clamp_bounds_the_estimate(name):
    """kl(..., clamp=c) is clip(estimate, -c, c) (verl clamps k3 to +-10), with zero gradient where
    it binds (k1, k3; k3+ keeps k2's gradient there: test_k3_plus_under_a_clamp_keeps_k2_gradient);
    clamp=None leaves the estimate as it is. Catches the old kl(), which had no clamp."""
    logp = np.array([-1.0, -0.5, -20.0, -0.1, -3.0])
    ref = np.array([-1.2, -15.0, -0.5, -14.0, -2.5])  # log r = ref - logp reaches -14.5 and 19.5
    lr = ref - logp
    raw = {"k1": -lr, "k3": np.exp(lr) - 1 - lr, "k3+": np.exp(lr) - 1 - lr}[name]
    with jax.enable_x64(True):
        f = lambda lp, c: obj.kl(lp, jnp.asarray(ref), name, clamp=c)  # noqa: E731
        np.testing.assert_allclose(np.asarray(f(jnp.asarray(logp), 10.0)), np.clip(raw, -10, 10), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(f(jnp.asarray(logp), None)), raw, rtol=1e-12)
        g = np.asarray(jax.grad(lambda lp: jnp.sum(f(lp, 10.0)))(jnp.asarray(logp)))
    if name != "k3+":
        assert np.all(g[np.abs(raw) > 10] == 0)
    assert np.all(g[np.abs(raw) < 10] != 0)


@pytest.mark.parametrize("name", ["k3", "k3+"])
def test_k3_is_finite_at_extreme_log_ratios(name):
    """At log ref - log pi = +-100, k3 and k3+ (clamped or not) have finite values and gradients:
    k3 takes exp of log r clamped to +-20, as verl does. Catches the old k3, whose expm1(100) = inf
    in float32 gave an inf estimate, and a NaN gradient (0 * inf) under clamp=10."""
    logp = jnp.asarray([-100.0, -0.5, -1.0], jnp.float32)
    ref = jnp.asarray([0.0, -100.5, -1.2], jnp.float32)
    for clamp in (None, 10.0):
        f = lambda lp: jnp.sum(obj.kl(lp, ref, name, clamp=clamp))  # noqa: E731
        assert np.isfinite(float(f(logp))), clamp
        assert np.all(np.isfinite(np.asarray(jax.grad(f)(logp)))), clamp


def test_kl_estimators_are_unbiased_where_schulman_says():
    """Sampling x ~ p: mean k1 and mean k3 approach KL(p||q); k2 is >= 0 everywhere."""
    rng = np.random.default_rng(0)
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.5, 0.3])
    x = rng.choice(3, size=200_000, p=p)
    true = float(np.sum(p * np.log(p / q)))
    logp, logq = jnp.asarray(np.log(p)[x]), jnp.asarray(np.log(q)[x])
    for name in ("k1", "k3"):
        assert abs(float(jnp.mean(obj.kl(logp, logq, name))) - true) < 0.01, name
    assert float(jnp.min(obj.kl(logp, logq, "k2"))) >= 0


@pytest.mark.parametrize("name,el,eh,kw", [("ppo_clip", 0.2, 0.28, {}), ("ppo_clip", 0.2, 0.2, {"dual_clip": 3.0}),
                                           ("gspo", 0.05, 0.08, {}), ("cispo", 1.0, 0.28, {}),
                                           ("topr", 0.2, 0.2, {}), ("pg", 0.2, 0.2, {})])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_values_and_gradients(name, el, eh, kw, mode):
    """Loss value matches the paper formula in NumPy; jax.grad matches central finite differences."""
    logp, old, adv, mask = _case(4)
    if name == "gspo":  # GSPO's advantage is per sequence
        adv = np.repeat(adv[:, 2:3], T, 1) * mask
    ref = NP_LOSSES[name]
    c = kw.get("dual_clip")

    def np_total(lp):
        if name == "ppo_clip":
            per = ref(lp, old, adv, mask, el, eh, c)
        elif name in ("cispo", "topr"):  # weights are stop-gradient: frozen at the base point
            per = ref(lp, old, adv, mask, el, eh, at=logp)
        else:
            per = ref(lp, old, adv, mask, el, eh)
        return np_aggregate(per, mask, mode)

    with jax.enable_x64(True):
        f = lambda lp: _jax_loss(name, lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), mode, el, eh, **kw)  # noqa: E731
        np.testing.assert_allclose(float(f(jnp.asarray(logp))), np_total(logp), rtol=1e-10)
        g = np.asarray(jax.grad(f)(jnp.asarray(logp)))
    h = 1e-6
    fd = np.zeros_like(logp)
    for idx in np.ndindex(*logp.shape):
        e = np.zeros_like(logp)
        e[idx] = h
        fd[idx] = (np_total(logp + e) - np_total(logp - e)) / (2 * h)
    np.testing.assert_allclose(g, fd, atol=1e-6)
    assert np.all(g[mask == 0] == 0)  # masked tokens get no gradient


@pytest.mark.parametrize("name,kw", [("ppo_clip", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 2.0}),
                                     ("gspo", {}), ("cispo", {}), ("topr", {})])
def test_on_policy_gradient_equals_plain_policy_gradient(name, kw):
    """At ratio 1 (old = current log-probs) every loss's gradient is the plain -A grad log pi."""
    logp, _, adv, mask = _case(5)
    lp, a, m = jnp.asarray(logp, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32)
    mode = "seq-mean-token-mean"

    def loss(x):
        per, _ = obj.POLICY_LOSSES.get(name)(x, x, a, m, **kw)  # old log-probs = current: ratio 1
        return obj.aggregate(per, m, mode)

    plain = jax.grad(lambda x: obj.aggregate(-a * x, m, mode))(lp)
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(lp)), np.asarray(plain), rtol=1e-5, atol=1e-7)


def test_clip_fractions_are_correct():
    """clip_low counts r < 1 - eps_low with A < 0; clip_high counts r > 1 + eps_high with A > 0."""
    logp, old, adv, mask = _case(6)
    _, st = obj.ppo_clip(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), eps_low=0.1, eps_high=0.3)
    r = np.exp(logp - old)
    np.testing.assert_array_equal(np.asarray(st["clip_low"]) > 0, (r < 0.9) & (adv < 0))
    np.testing.assert_array_equal(np.asarray(st["clip_high"]) > 0, (r > 1.3) & (adv > 0))
    assert 0 < float((np.asarray(st["clip_low"]) * mask).sum()) < mask.sum()


def test_masked_tokens_contribute_nothing():
    """Garbage at masked positions changes neither any loss's aggregate nor its gradient."""
    logp, old, adv, mask = _case(7)
    rng = np.random.default_rng(1)
    noise = np.where(mask > 0, 0.0, rng.normal(scale=50, size=mask.shape))
    for name in obj.POLICY_LOSSES.names():
        for mode in obj.AGGREGATIONS.names():
            def f(lp, o, a):
                per, _ = obj.POLICY_LOSSES.get(name)(lp, o, a, jnp.asarray(mask), eps_low=0.2, eps_high=0.2)
                return obj.aggregate(per, jnp.asarray(mask), mode)
            base = (jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv))
            dirty = (jnp.asarray(logp - np.abs(noise)), jnp.asarray(old + noise), jnp.asarray(adv + noise))
            np.testing.assert_allclose(float(f(*dirty)), float(f(*base)), rtol=1e-6, err_msg=f"{name}/{mode}")
            np.testing.assert_allclose(np.asarray(jax.grad(f)(*dirty)), np.asarray(jax.grad(f)(*base)), atol=1e-6)


def test_value_loss_matches_numpy():
    """Clipped value loss: 1/2 max((v-R)^2, (v_old + clip(v - v_old, -eps, eps) - R)^2)."""
    rng = np.random.default_rng(0)
    v, vo, ret = rng.normal(size=(3, 4, 5))
    want = 0.5 * np.maximum((v - ret) ** 2, (vo + np.clip(v - vo, -0.2, 0.2) - ret) ** 2)
    np.testing.assert_allclose(np.asarray(obj.value_loss(jnp.asarray(v), jnp.asarray(vo), jnp.asarray(ret), 0.2)), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(obj.value_loss(jnp.asarray(v), jnp.asarray(vo), jnp.asarray(ret), None)),
                               0.5 * (v - ret) ** 2, rtol=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_and_mis_match_numpy(level):
    """TIS caps the importance weight pi_old/mu at `cap`; MIS drops tokens/sequences outside [1/cap, cap]."""
    logp, behaviour, _, mask = _case(8)
    lw = (logp - behaviour) * mask
    if level == "sequence":
        lw = np.repeat(lw.sum(1, keepdims=True), T, 1)
    w, m = obj.truncated_is(jnp.asarray(logp), jnp.asarray(behaviour), jnp.asarray(mask), cap=1.5, level=level)
    np.testing.assert_allclose(np.asarray(w), np.minimum(np.exp(lw), 1.5), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(m), mask)
    w, m = obj.masked_is(jnp.asarray(logp), jnp.asarray(behaviour), jnp.asarray(mask), cap=1.5, level=level)
    np.testing.assert_array_equal(np.asarray(w), 1.0)
    np.testing.assert_array_equal(np.asarray(m), mask * (np.abs(lw) <= np.log(1.5)))


def _extreme_case():
    """Log-ratios of +100 and -100 on masked tokens, on tokens the clip range caps, on tokens left
    unclipped (dual clip off) and on a whole row (GSPO's sequence ratio)."""
    logp, old, adv, mask = _case(10)
    mask[:, :2] = 0
    mask[1, 2:] = 1
    adv = np.where(mask > 0, adv, 0.0)
    old = old.copy()
    old[0, 0], old[0, 1] = logp[0, 0] - 100, logp[0, 1] + 100    # masked
    old[1, 3], old[1, 4] = logp[1, 3] - 100, logp[1, 4] + 100    # in the loss
    adv[1, 3], adv[1, 4] = 1.0, -1.0   # r = e^100 with A > 0: clipped; r = e^-100 with A < 0: clipped
    adv[1, 5], old[1, 5] = -1.0, logp[1, 5] - 100  # r = e^100 with A < 0: the unclipped branch
    old[2] = np.where(mask[2] > 0, logp[2] - 100, old[2])  # a whole row at +100: GSPO's s = e^100
    adv[2] = -np.abs(adv[2]) - mask[2]
    return logp, old, adv, mask


@pytest.mark.parametrize("name", ["ppo_clip", "pg", "gspo", "cispo", "topr"])
def test_extreme_log_ratios_give_finite_losses_gradients_and_ratios(name):
    """With log-ratios of +-100, every registered loss's masked-mean value, its jax.grad w.r.t. logp
    and the masked sum of its `ratio` stat (the ratio/mean metric) are finite, because the
    log-ratio is clamped to +-LOG_RATIO_CLAMP before exp (verl: +-20). Catches the old unclamped
    exp(logp - old_logp): e^100 = inf in float32, so inf * 0 on masked tokens gave NaN gradients
    (ppo_clip, pg, gspo) and a NaN ratio metric (all five)."""
    from rljax.objectives.losses import LOG_RATIO_CLAMP
    assert LOG_RATIO_CLAMP == 20.0
    assert name in obj.POLICY_LOSSES
    logp, old, adv, mask = (jnp.asarray(x, jnp.float32) for x in _extreme_case())

    def f(lp):
        per, st = obj.POLICY_LOSSES.get(name)(lp, old, adv, mask)
        return obj.aggregate(per, mask, "token-mean"), st

    (value, st), g = jax.value_and_grad(f, has_aux=True)(logp)
    assert np.isfinite(float(value)), name
    assert np.all(np.isfinite(np.asarray(g))), name
    assert np.all(np.asarray(g)[np.asarray(mask) == 0] == 0), name
    assert np.isfinite(float(jnp.sum(st["ratio"] * mask))), name
    assert float(jnp.max(st["ratio"])) <= np.exp(np.float32(LOG_RATIO_CLAMP)) * (1 + 1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_extreme_off_policy_weights_are_finite(level):
    """TIS and MIS weights and masks stay finite with sampler log-ratios of +-100, an uncapped TIS
    (cap = inf: exp of the clamped log-weight) and -inf sampler log-probs on padding; padding does
    not change MIS's keep decision. Catches the old _log_weights, whose (old - mu) * mask gave
    inf * 0 = NaN on padding, and the old TIS, whose e^100 weight was inf."""
    logp, behaviour, _, mask = _extreme_case()
    behaviour = np.where(mask > 0, behaviour, -np.inf)
    args = (jnp.asarray(logp, jnp.float32), jnp.asarray(behaviour, jnp.float32), jnp.asarray(mask, jnp.float32))
    w, m = obj.truncated_is(*args, cap=float("inf"), level=level)
    assert np.all(np.isfinite(np.asarray(w))) and np.all(np.asarray(m) == mask)
    w, m = obj.masked_is(*args, cap=2.0, level=level)
    lw = np.where(mask > 0, logp - np.where(mask > 0, behaviour, 0.0), 0.0)
    if level == "sequence":
        lw = np.repeat(lw.sum(1, keepdims=True), T, 1)
    np.testing.assert_array_equal(np.asarray(m), mask * (np.abs(lw) <= np.log(2.0)))
    assert np.all(np.asarray(w) == 1.0)


# ----------------------------------------------------------------------------- config


def test_every_algorithm_preset_builds_and_pieces_override():
    """Each preset resolves to registered pieces; explicit fields override the preset."""
    for name in obj.PRESETS:
        cfg = obj.AlgorithmConfig(algorithm=name)
        assert cfg.advantage in obj.ADVANTAGES and cfg.policy_loss in obj.POLICY_LOSSES
    cfg = obj.AlgorithmConfig(algorithm="dapo", clip_eps_high=0.3, aggregation="seq-mean-token-sum")
    assert (cfg.clip_eps_high, cfg.aggregation, cfg.advantage) == (0.3, "seq-mean-token-sum", "grpo")
    assert obj.AlgorithmConfig(algorithm="dr_grpo").aggregation == "seq-mean-token-sum-norm"


@pytest.mark.parametrize("kwargs,needle", [
    (dict(algorithm="grpoo"), "choose one of cispo, dapo, dr_grpo"),
    (dict(advantage="gea"), "unknown advantage estimator 'gea'; choose one of dr_grpo, gae"),
    (dict(policy_loss="ppo"), "unknown policy loss 'ppo'; choose one of cispo, clip_cov, gspo, kl_cov, pg, ppo_clip, topr"),
    (dict(aggregation="mean"), "choose one of seq-mean-token-mean"),
    (dict(kl_estimator="k4"), "choose one of abs, k1, k2, k3, k3+"),
    (dict(off_policy="tis"), "needs recompute_old_logp=True"),
    (dict(advantage="gae"), "set value_coef > 0"),
])
def test_config_errors_are_one_line_and_list_choices(kwargs, needle):
    """Bad names raise a one-line ConfigError naming the valid choices (driven by the registry)."""
    with pytest.raises(ConfigError) as err:
        obj.AlgorithmConfig(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_config_from_dict_rejects_unknown_keys():
    """from_dict names the unknown key and lists valid keys."""
    assert obj.AlgorithmConfig.from_dict({"algorithm": "ppo", "gamma": 0.99}).gamma == 0.99
    with pytest.raises(ConfigError, match="unknown algorithm config key.*clip_eps"):
        obj.AlgorithmConfig.from_dict({"clip_eps": 0.2})
