"""Advantage estimators and reward transforms against plain-NumPy references written from the papers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import objectives as obj
from rljax.errors import ConfigError
from rljax.objectives.registry import DISTILLATION

B, T, N = 12, 9, 4  # rows, time, group size


def _ragged_mask(rng, b=B, t=T):
    """Right-aligned completions of random lengths 0..t-2 after a random prompt length."""
    m = np.zeros((b, t), np.float32)
    for i in range(b):
        start = rng.integers(1, 4)
        length = rng.integers(0, t - start + 1)
        m[i, start:start + length] = 1
    m[0, :] = 0  # one empty completion
    m[1, 2:] = 1
    return m


def _shuffled_groups(rng):
    ids = np.repeat(np.arange(B // N), N)
    return rng.permutation(ids).astype(np.int32) + 1  # ids need not start at 0 or be contiguous rows


def np_grpo(r, g, std=True, eps=1e-6):
    out = np.zeros_like(r)
    for gid in np.unique(g):
        idx = g == gid
        x = r[idx]
        if np.all(x == x[0]):
            continue
        a = x - x.mean()
        if std:
            a = a / (x.std(ddof=1) + eps)
        out[idx] = a
    return out


def np_rloo(r, g):
    out = np.zeros_like(r)
    for i in range(len(r)):
        others = r[(g == g[i]) & (np.arange(len(r)) != i)]
        if len(others) and not np.all(r[g == g[i]] == r[i]):
            out[i] = r[i] - others.mean()
    return out


def np_returns_and_gae(r_seq, mask, values=None, dense=None, gamma=1.0, lam=1.0):
    """Per row: dense rewards on masked steps (sequence reward on the last), then reverse recursions."""
    ret = np.zeros_like(mask)
    adv = np.zeros_like(mask)
    for i in range(mask.shape[0]):
        idx = np.nonzero(mask[i])[0]
        if len(idx) == 0:
            continue
        rew = np.zeros(len(idx))
        rew[-1] = r_seq[i]
        if dense is not None:
            rew += dense[i, idx]
        v = values[i, idx] if values is not None else np.zeros(len(idx))
        g, a = 0.0, 0.0
        for k in reversed(range(len(idx))):
            g = rew[k] + gamma * g
            v_next = v[k + 1] if k + 1 < len(idx) else 0.0
            a = rew[k] + gamma * v_next - v[k] + gamma * lam * a
            ret[i, idx[k]], adv[i, idx[k]] = g, a
    return ret, adv


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    mask = _ragged_mask(rng)
    rewards = rng.normal(size=B).astype(np.float32)
    groups = _shuffled_groups(rng)
    return rng, mask, rewards, groups


@pytest.mark.parametrize("name,std", [("grpo", True), ("dr_grpo", False)])
def test_grpo_family_matches_numpy(data, name, std):
    """GRPO (std-normalised) and Dr. GRPO (mean-centred) match the NumPy group formula on shuffled groups."""
    _, mask, r, g = data
    got = obj.ADVANTAGES.get(name)(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask))
    want = np_grpo(r, g, std=std)[:, None] * mask
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_grpo_without_std_option_equals_dr_grpo(data):
    """grpo(std_normalize=False) is exactly the Dr. GRPO advantage."""
    _, mask, r, g = data
    a = obj.grpo(r, jnp.asarray(g), mask, std_normalize=False)
    np.testing.assert_allclose(np.asarray(a), np.asarray(obj.dr_grpo(r, jnp.asarray(g), mask)), atol=0)


def test_rloo_matches_numpy(data):
    """RLOO is r_i minus the mean of the other rewards in its group."""
    _, mask, r, g = data
    got = obj.rloo(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), np_rloo(r, g)[:, None] * mask, rtol=1e-5, atol=1e-6)


def test_remax_and_reinforce_match_numpy(data):
    """ReMax subtracts the greedy baseline; REINFORCE subtracts the batch mean."""
    rng, mask, r, g = data
    base = rng.normal(size=B).astype(np.float32)
    got = obj.remax(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask), baseline_b=jnp.asarray(base))
    np.testing.assert_allclose(np.asarray(got), (r - base)[:, None] * mask, rtol=1e-6)
    got = obj.reinforce(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), (r - r.mean())[:, None] * mask, rtol=1e-5, atol=1e-6)


def test_reinforce_pp_matches_numpy_with_kl_in_reward(data):
    """REINFORCE++: return-to-go of (last-token reward + dense -beta*KL), normalised over valid tokens."""
    rng, mask, r, g = data
    dense = (-0.1 * rng.random((B, T))).astype(np.float32) * mask
    ret, _ = np_returns_and_gae(r, mask, dense=dense)
    valid = mask > 0
    want = (ret - ret[valid].mean()) / (ret[valid].std(ddof=1) + 1e-6) * mask
    got = obj.reinforce_pp(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask), token_rewards_bt=jnp.asarray(dense))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_reinforce_pp_discounts_with_gamma(data):
    """REINFORCE++ with gamma = 0.9: G_t = r_t + 0.9 G_{t+1} over each row's masked steps (a NumPy
    loop), then whitened over the batch's valid tokens. Catches the old `reinforce_pp(..., **_)`,
    which swallowed gamma and returned the undiscounted (gamma = 1) return-to-go."""
    rng, mask, r, g = data
    dense = (-0.1 * rng.random((B, T))).astype(np.float32) * mask
    ret, _ = np_returns_and_gae(r, mask, dense=dense, gamma=0.9)
    valid = mask > 0
    want = (ret - ret[valid].mean()) / (ret[valid].std(ddof=1) + 1e-6) * mask
    got = obj.ADVANTAGES.get("reinforce_pp")(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask),
                                             token_rewards_bt=jnp.asarray(dense), gamma=0.9)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def np_masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """verl's `masked_whiten` (OpenAI baselines' whitening): mean and unbiased variance over valid
    tokens, (x - mean) / sqrt(var + eps), the mean added back when shift_mean is False."""
    valid = mask > 0
    mean = x[valid].mean()
    var = x[valid].var(ddof=1)
    out = (x - mean) / np.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return np.where(valid, out, 0.0)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_advantages_matches_masked_whiten(data, shift_mean):
    """whiten_advantages equals verl's masked_whiten over valid tokens (unbiased variance, eps inside
    the square root) and is zero off the mask, whatever sits there. Catches its absence in the old
    code (no whitening for PPO/GAE advantages existed)."""
    from rljax.objectives.advantages import whiten_advantages
    rng, mask, _, _ = data
    x = rng.normal(loc=0.7, scale=3.0, size=(B, T)).astype(np.float32)
    dirty = np.where(mask > 0, x, 1e4).astype(np.float32)  # garbage off the mask must not leak in
    got = whiten_advantages(jnp.asarray(dirty), jnp.asarray(mask), shift_mean=shift_mean)
    np.testing.assert_allclose(np.asarray(got), np_masked_whiten(x, mask, shift_mean), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[mask == 0] == 0)


def np_reinforce_pp_baseline(r, g, mask, dense=None):
    """REINFORCE++-baseline (Hu et al. 2025; verl's compute_reinforce_plus_plus_baseline_outcome_advantage):
    sequence score minus its group mean, on every valid token, then masked_whiten over the batch.
    rljax's convention: groups with one sample or all-equal scores give 0 before whitening."""
    s = r.astype(np.float64) + (0.0 if dense is None else (dense * mask).sum(1))
    a = np.zeros_like(s)
    for gid in np.unique(g):
        idx = g == gid
        if idx.sum() > 1 and not np.all(s[idx] == s[idx][0]):
            a[idx] = s[idx] - s[idx].mean()
    return np_masked_whiten(a[:, None] * mask, mask)


def test_reinforce_pp_baseline_matches_numpy(data):
    """Group-mean subtraction of the sequence reward (+ the row sum of dense -beta*KL), broadcast to
    tokens, then whitened over the batch's valid tokens; a flat group and a one-sample group give
    0 before whitening. Catches its absence in the old registry."""
    rng, mask, r, g = data
    dense = (-0.1 * rng.random((B, T))).astype(np.float32) * mask
    fn = obj.ADVANTAGES.get("reinforce_pp_baseline")
    got = fn(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask), token_rewards_bt=jnp.asarray(dense))
    np.testing.assert_allclose(np.asarray(got), np_reinforce_pp_baseline(r, g, mask, dense), rtol=1e-4, atol=1e-5)
    r2, g2 = r.copy(), g.copy()
    r2[g2 == g2[0]] = 0.1  # a zero-variance group whose float mean is inexact
    g2[-1] = 0             # a group of one (ids in use are 1..3)
    got = fn(jnp.asarray(r2), jnp.asarray(g2), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), np_reinforce_pp_baseline(r2, g2, mask), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
def test_gae_matches_numpy(data, gamma, lam):
    """GAE by reverse scan equals the textbook recursion run on each row's masked steps."""
    rng, mask, r, g = data
    v = rng.normal(size=(B, T)).astype(np.float32)
    _, want = np_returns_and_gae(r, mask, values=v, gamma=gamma, lam=lam)
    got = obj.gae(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask), values_bt=jnp.asarray(v), gamma=gamma, lam=lam)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_gae_lambda1_gamma1_is_return_minus_value(data):
    """With lambda = gamma = 1, A_t = (sum of rewards from t on) - V_t on every completion token."""
    rng, mask, r, g = data
    v = rng.normal(size=(B, T)).astype(np.float32)
    dense = rng.normal(size=(B, T)).astype(np.float32) * mask
    rew_bt = obj.dense_rewards(jnp.asarray(r), jnp.asarray(mask), jnp.asarray(dense))
    adv = obj.gae_from_rewards(rew_bt, jnp.asarray(v), jnp.asarray(mask), 1.0, 1.0)
    rtg = np.flip(np.cumsum(np.flip(np.asarray(rew_bt), 1), 1), 1)
    np.testing.assert_allclose(np.asarray(adv), (rtg - v) * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_zero_variance_groups_give_zero_advantage_no_nan(name):
    """Groups with equal rewards (including rewards like 0.1 whose mean is inexact) give A = 0, no NaN."""
    r = jnp.asarray([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 3.0], jnp.float32)
    g = jnp.asarray([0, 0, 0, 1, 1, 1, 2], jnp.int32)  # group 2 has a single sample
    m = jnp.ones((7, 3))
    a = np.asarray(obj.ADVANTAGES.get(name)(r, g, m))
    assert np.all(np.isfinite(a))
    np.testing.assert_array_equal(a[[0, 1, 2, 6]], 0.0)
    assert np.abs(a[3:6]).sum() > 0
    assert int(obj.zero_variance_groups(r, g)) == 2


def test_prompt_major_group_ids():
    """Row i*n + j belongs to prompt i."""
    np.testing.assert_array_equal(np.asarray(obj.prompt_major_group_ids(6, 3)), [0, 0, 0, 1, 1, 1])


def test_every_registered_estimator_jits_and_is_zero_off_mask(data):
    """Every registered estimator runs under jit with the shared signature and is zero off the mask."""
    rng, mask, r, g = data
    kw = dict(baseline_b=jnp.zeros(B), values_bt=jnp.asarray(rng.normal(size=(B, T)), jnp.float32))
    for name in obj.ADVANTAGES.names():
        fn = jax.jit(lambda r, g, m, fn=obj.ADVANTAGES.get(name): fn(r, g, m, **kw))
        a = np.asarray(fn(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask)))
        assert np.all(np.isfinite(a)) and np.all(a[mask == 0] == 0), name


def test_overlong_penalty_matches_dapo_formula():
    """DAPO soft overlong punishment: 0, then a linear ramp to -1 over the buffer, then -1."""
    lengths = np.array([0, 10, 12, 14, 16, 17, 30])
    got = np.asarray(obj.overlong_penalty(jnp.asarray(lengths), max_length=16, buffer=4))
    want = [0.0 if n <= 12 else ((12 - n) / 4 if n <= 16 else -1.0) for n in lengths]
    np.testing.assert_allclose(got, want, atol=1e-7)
    np.testing.assert_allclose(np.asarray(obj.length_penalty(jnp.asarray(lengths), 0.5, 16)), -0.5 * lengths / 16)


def test_registry_declarations_match_what_each_estimator_reads(data):
    """Each estimator's declared `params` and `reads` are exactly the config fields and optional
    rollout fields that change its output: moving one off its default changes the advantages iff
    the entry declares it. The declarations replace a side list of discounting estimators and a
    signature inspection, so this is what keeps them from drifting from the code.

    Catches: an estimator that starts reading gamma, lam, std_normalize, eps or turn returns
    without declaring it (AlgorithmConfig would refuse a setting it uses, or the update would
    let turn returns be silently ignored), and a stale declaration."""
    rng, mask, r, g = data
    k = 3
    turn_bt = np.where(mask > 0, rng.integers(0, k, size=(B, T)), -1).astype(np.int32)
    base = dict(baseline_b=jnp.zeros(B), values_bt=jnp.asarray(rng.normal(size=(B, T)), jnp.float32),
                gamma=1.0, lam=1.0, std_normalize=True, eps=1e-6)
    moved = dict(gamma=dict(gamma=0.5), lam=dict(lam=0.5), std_normalize=dict(std_normalize=False),
                 eps=dict(eps=0.5), turn_returns=dict(turn_bt=jnp.asarray(turn_bt),
                                                      turn_returns_bk=jnp.asarray(rng.normal(size=(B, k)), jnp.float32)))
    for name in obj.ADVANTAGES.names():
        fn = obj.ADVANTAGES.get(name)
        ref = np.asarray(fn(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask), **base))
        declared = obj.ADVANTAGES.params(name) | obj.ADVANTAGES.reads(name)
        for what, change in moved.items():
            got = np.asarray(fn(jnp.asarray(r), jnp.asarray(g), jnp.asarray(mask), **{**base, **change}))
            assert (not np.array_equal(got, ref)) == (what in declared), (name, what)


def test_declared_params_are_config_fields_and_drive_the_checks():
    """Every registry entry's params name AlgorithmConfig fields, and the gamma / lam checks and
    their messages come from the advantage entries' declarations."""
    fields = {f.name for f in dataclasses.fields(obj.AlgorithmConfig)}
    for reg in (obj.ADVANTAGES, obj.POLICY_LOSSES, obj.AGGREGATIONS, obj.KL_ESTIMATORS, obj.OFF_POLICY,
                DISTILLATION):
        for name in reg.names():
            assert reg.params(name) <= fields, (reg.kind, name)
    assert obj.ADVANTAGES.declaring("gamma") == ("gae", "reinforce_pp")
    assert obj.ADVANTAGES.declaring("lam") == ("gae",)
    assert obj.AlgorithmConfig(algorithm="reinforce_pp", gamma=0.9).gamma == 0.9
    for kwargs, needle in ((dict(algorithm="grpo", gamma=0.9), "discounting applies to gae, reinforce_pp: set gamma=1"),
                           (dict(algorithm="reinforce_pp", lam=0.9), "only gae uses lambda: set lam=1")):
        with pytest.raises(ConfigError, match=needle):
            obj.AlgorithmConfig(**kwargs)


def test_check_turn_credit_is_one_line_per_refusal():
    """`check_turn_credit`, the one turn-credit check (config loader and update): an estimator that
    does not read turn returns, the KL folded into the reward, a PRM's per-token rewards and the
    length shaping are each refused in one line; grpo and dr_grpo without them pass."""
    none = obj.RewardShaping()
    for adv in obj.ADVANTAGES.reading("turn_returns"):
        obj.check_turn_credit(obj.AlgorithmConfig(advantage=adv), none)
    cases = ((obj.AlgorithmConfig(algorithm="rloo"), none, False, "needs an advantage that takes turn returns "
              "\\(dr_grpo, grpo\\), not algorithm.advantage='rloo'"),
             (obj.AlgorithmConfig(kl_coef=0.01, kl_in_reward=True), none, False, "algorithm.kl_in_reward"),
             (obj.AlgorithmConfig(), none, True, "reward.model.credit='token'"),
             (obj.AlgorithmConfig(), obj.RewardShaping(length_penalty=0.1), False, "\\[shaping\\]"))
    for algo, shaping, token_rewards, needle in cases:
        with pytest.raises(ConfigError, match=needle) as err:
            obj.check_turn_credit(algo, shaping, token_rewards=token_rewards)
        assert "\n" not in str(err.value)
