"""The compiled update step and its typed contract: one compilation per batch shape, multi-epoch PPO
in one call, exact micro-batch accumulation, reference reset, declared rollout needs, off-policy
corrections, clamped log-ratios, metrics that name their population, and learning tests (GRPO on
a bandit task, PPO whose critic learns)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.errors import ConfigError
from rljax.models import forward, init_params, preset, token_logprobs
from rljax.objectives import ADVANTAGES, POLICY_LOSSES, AlgorithmConfig, gae_from_rewards, prompt_major_group_ids
from rljax.objectives.advantages import dense_rewards
from rljax.objectives.shaping import RewardShaping
from rljax.optim import OptimConfig
from rljax.update import (RolloutBatch, TrainState, UpdateConfig, init_train_state, prepare_batch,
                          reset_reference, update_step)

CFG = preset("qwen2-test")
PROMPT = 5


def _params(seed=0):
    return init_params(CFG, jax.random.key(seed))


def _batch(seed, b=8, t=12, prompt=PROMPT, noise=0.05):
    """Left-padded prompts of ragged length, completions of ragged length, sampler log-probs equal
    to the trainer's at `_params()` plus `noise` (0: exactly on-policy)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, CFG.vocab_size, (b, t))
    attn = np.ones((b, t), bool)
    loss = np.zeros((b, t), bool)
    for i in range(b):
        attn[i, :rng.integers(0, 3)] = False
        n = rng.integers(1, t - prompt + 1)
        loss[i, prompt:prompt + n] = True
        attn[i, prompt + n:] = False  # right padding after the completion
    toks = np.where(attn, toks, 0)
    logp, _ = token_logprobs(CFG, _params(), jnp.asarray(toks), jnp.asarray(attn))
    logp = logp + rng.normal(scale=noise, size=(b, t)).astype(np.float32) if noise else logp
    rewards = rng.integers(0, 2, b).astype(np.float32)
    return RolloutBatch(tokens_bt=jnp.asarray(toks), attn_mask_bt=jnp.asarray(attn), loss_mask_bt=jnp.asarray(loss),
                        sampler_logp_bt=jnp.where(jnp.asarray(loss), logp, 0.0), rewards_b=jnp.asarray(rewards),
                        group_ids_b=prompt_major_group_ids(b, 4), completion_len=t - prompt)


def _state(algo, optim=OptimConfig(learning_rate=1e-3), **kw):
    return init_train_state(CFG, _params(), algo, optim, key=jax.random.key(1), **kw)


def test_ppo_multi_epoch_multi_minibatch_compiles_once():
    """A 2-epoch x 2-minibatch x 2-microbatch PPO update runs in one call; a second batch of the
    same shape (new values, new rng) reuses the compiled program. The batch is exactly on-policy,
    so the first mini-batch's ratios are 1 (to f32 rounding) and any spread is the moved policy:
    a one-step update of the same batch keeps every ratio within 1e-5 of 1, the 4-step one does not.
    Fails if the update did not move the policy between mini-batches, or if the metrics came from
    a stale (unmoved) copy of the params."""
    algo = AlgorithmConfig(algorithm="ppo", gamma=0.99, lam=0.95, entropy_coef=0.01)
    sched = UpdateConfig(num_epochs=2, num_minibatches=2, num_microbatches=2)
    state = _state(algo, update_cfg=sched)
    p0 = np.asarray(state.params["embed"]).copy()
    v0 = np.asarray(state.value_params["value_head"]).copy()
    before = update_step._cache_size()
    state, m1 = update_step(state, _batch(0, noise=0), jax.random.key(0))
    state, m2 = update_step(state, _batch(1, noise=0), jax.random.key(1))
    assert update_step._cache_size() - before == 1
    assert int(state.step) == 8 and int(m1["num_updates"]) == 4
    for m in (m1, m2):
        assert all(np.isfinite(float(v)) for v in m.values()), m
    assert float(m1["loss/value"]) > 0 and float(m1["grad_norm"]) > 0
    assert not np.allclose(np.asarray(state.params["embed"]), p0)
    assert not np.allclose(np.asarray(state.value_params["value_head"]), v0)  # the critic trains too
    assert float(m1["update/logp_diff_max"]) < 1e-5  # on-policy start
    one_step = _state(algo, update_cfg=UpdateConfig())
    _, m_one = update_step(one_step, _batch(0, noise=0), jax.random.key(0))
    assert abs(float(m_one["ratio/max"]) - 1) < 1e-5 and abs(float(m_one["ratio/min"]) - 1) < 1e-5
    spread = float(m1["ratio/max"]) - float(m1["ratio/min"])
    assert spread > 1e-3, spread  # later mini-batches see a moved policy


def test_microbatch_accumulation_equals_single_batch():
    """Four accumulated micro-batches give the same gradient norm, loss parts, metrics and update as
    one batch (GRPO with a k3 KL loss to the reference, seq-mean-token-mean aggregation)."""
    # eps=1e3 makes Adam's first step ~ lr * g / eps, linear in the gradient, so params compare g.
    optim = OptimConfig(learning_rate=1.0, eps=1e3, max_grad_norm=None)
    batch = _batch(2)
    results = []
    for k in (1, 4):
        state = _state(AlgorithmConfig(algorithm="grpo", kl_coef=0.1), optim, update_cfg=UpdateConfig(num_microbatches=k))
        state = state.replace(ref_params=_params(seed=7))  # a reference that differs from the policy
        results.append(update_step(state, batch, jax.random.key(0)))
    (s1, m1), (s4, m4) = results
    for name in m1:
        np.testing.assert_allclose(float(m4[name]), float(m1[name]), rtol=2e-5, atol=1e-7, err_msg=name)
    assert float(m1["loss/kl"]) > 0 and float(m1["kl_ref"]) > 0
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_token_sum_loss_metric_equals_the_loss_with_micro_batches():
    """`token-sum` has a constant denominator, so micro-batches must share the mini-batch's: the
    reported policy loss equals the NumPy token sum of -A * ratio (ratio 1 on-policy) for 1 and 4
    micro-batches. Fails if each micro-batch reported its own denominator (4x too small)."""
    batch = _batch(3, noise=0)
    algo = AlgorithmConfig(algorithm="dr_grpo", aggregation="token-sum", policy_loss="pg")
    prepared, _ = prepare_batch(_state(algo), batch)
    want = -np.sum(np.asarray(prepared.advantages_bt) * np.asarray(prepared.loss_mask_bt))
    for k in (1, 4):
        _, m = update_step(_state(algo, update_cfg=UpdateConfig(num_microbatches=k)), batch, jax.random.key(0))
        np.testing.assert_allclose(float(m["loss/policy"]), want, rtol=1e-5, atol=1e-6)


def test_reset_reference_copies_policy_and_restarts_optimizer():
    """ProRL reset: the reference equals the policy and Adam's count is 0. The copy is real: after a
    donating update the reference keeps the pre-update values while the policy moved (a reference
    aliasing the policy's buffers would be deleted by the donation, or move with it), and the
    first update after a reset sees KL = 0 to the reference."""
    algo = AlgorithmConfig(algorithm="grpo", kl_coef=0.1)
    state = _state(algo, OptimConfig(learning_rate=1e-2))
    state = state.replace(ref_params=_params(seed=3), opt_state=jax.tree.map(lambda x: x + 1, state.opt_state))
    new = reset_reference(state)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(new.ref_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adam = [x for x in jax.tree.leaves(new.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(x, optax.ScaleByAdamState)]
    assert [int(a.count) for a in adam] == [0]  # the moments restart ...
    assert all(float(jnp.abs(m).max()) == 0 for a in adam for m in jax.tree.leaves((a.mu, a.nu)))
    sched = [x for x in jax.tree.leaves(new.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
             if isinstance(x, optax.ScaleByScheduleState)]
    assert [int(c.count) for c in sched] == [1]  # ... but the schedule keeps its step (no second warmup)
    before = jax.tree.map(np.asarray, new.params)
    after, metrics = update_step(new, _batch(4), jax.random.key(0))
    assert float(metrics["kl_ref"]) < 1e-9  # float rounding only; the seed-3 reference gave ~1e-2
    for ref, old, moved in zip(jax.tree.leaves(after.ref_params), jax.tree.leaves(before),
                               jax.tree.leaves(after.params)):
        np.testing.assert_array_equal(np.asarray(ref), old)
    assert any(not np.array_equal(np.asarray(m), o) for m, o in zip(jax.tree.leaves(after.params),
                                                                     jax.tree.leaves(before)))


def test_bad_batch_size_and_missing_remax_baseline_are_config_errors():
    """Indivisible batch sizes and ReMax without greedy baselines fail with one clear line."""
    state = _state(AlgorithmConfig(algorithm="dapo"), update_cfg=UpdateConfig(num_minibatches=3))
    with pytest.raises(ConfigError, match="divisible by update.num_minibatches"):
        update_step(state, _batch(0), jax.random.key(0))
    state = _state(AlgorithmConfig(algorithm="remax"))
    with pytest.raises(ConfigError, match="baseline_rewards_b"):
        update_step(state, _batch(0), jax.random.key(0))
    with pytest.raises(ConfigError, match="gamma=0.9 has no effect"):
        AlgorithmConfig(algorithm="grpo", gamma=0.9)
    with pytest.raises(ConfigError, match="lam=0.9 has no effect on advantage='reinforce_pp'"):
        AlgorithmConfig(algorithm="reinforce_pp", lam=0.9)


def test_algorithms_declare_their_rollout_needs(monkeypatch):
    """Needs come from registry declarations: ReMax's greedy baseline, GAE's values, a KL term's
    reference. A new estimator that declares a need is picked up with no other change."""
    assert AlgorithmConfig(algorithm="remax").needs.greedy_baseline
    assert not AlgorithmConfig(algorithm="grpo", kl_coef=0.0).needs.greedy_baseline
    assert AlgorithmConfig(algorithm="ppo").needs.values
    assert AlgorithmConfig(algorithm="grpo", kl_coef=0.04).needs.reference_logp
    assert not AlgorithmConfig(algorithm="dapo").needs.reference_logp

    with pytest.raises(ValueError, match="cannot declare rollout needs"):
        POLICY_LOSSES.register("test_loss_with_needs", needs=("reference_logp",))  # it would never receive them

    name = "test_greedy_minus_mean"
    # Registered for this test only: the registry entries are restored afterwards, so a test
    # that lists the registered estimators never sees it.
    monkeypatch.setattr(ADVANTAGES, "_fns", dict(ADVANTAGES._fns))
    monkeypatch.setattr(ADVANTAGES, "_needs", dict(ADVANTAGES._needs))

    @ADVANTAGES.register(name, needs=("greedy_baseline",))
    def _estimator(rewards_b, group_ids_b, loss_mask_bt, *, baseline_b=None, **_):
        return (rewards_b - baseline_b)[:, None] * loss_mask_bt
    algo = AlgorithmConfig(algorithm="grpo", advantage=name)
    assert algo.needs.greedy_baseline
    batch = _batch(5)
    with pytest.raises(ConfigError, match="baseline_rewards_b"):
        prepare_batch(_state(algo), batch)
    baseline = jnp.full(batch.rewards_b.shape, 0.25)
    prepared, _ = prepare_batch(_state(algo), batch.replace(baseline_rewards_b=baseline))
    np.testing.assert_allclose(np.asarray(prepared.advantages_bt),
                               np.asarray((batch.rewards_b - 0.25)[:, None] * batch.loss_mask_bt), atol=1e-7)


def _np_k3(log_r):
    return np.exp(log_r) - 1 - log_r


def test_approx_kl_estimates_kl_old_to_new():
    """approx_kl is k3 with r = pi / pi_old (Schulman 2020), the estimator of KL(pi_old || pi) for
    tokens drawn from pi_old. Written from the formula in NumPy; the old direction (r = pi_old / pi)
    differs by about 0.1 nats here."""
    batch = _batch(6, noise=0.5)
    _, m = update_step(_state(AlgorithmConfig(algorithm="dapo")), batch, jax.random.key(0))
    logp, _ = token_logprobs(CFG, _params(), batch.tokens_bt, batch.attn_mask_bt)
    mask = np.asarray(batch.loss_mask_bt)
    log_r = (np.asarray(logp) - np.asarray(batch.sampler_logp_bt))[mask]
    np.testing.assert_allclose(float(m["approx_kl"]), _np_k3(log_r).mean(), rtol=1e-4)
    assert abs(_np_k3(log_r).mean() - _np_k3(-log_r).mean()) > 0.05


def test_dr_grpo_normalises_by_the_completion_budget():
    """seq-mean-token-sum-norm's constant defaults to the rollout's completion budget (Dr. GRPO
    2025, verl), not the padded prompt + completion width: the loss equals the one with
    norm_length = completion_len set explicitly and differs from norm_length = T."""
    batch = _batch(7)
    losses = {}
    for norm in (None, batch.completion_len, batch.tokens_bt.shape[1]):
        _, m = update_step(_state(AlgorithmConfig(algorithm="dr_grpo", norm_length=norm)), batch, jax.random.key(0))
        losses[norm] = float(m["loss/policy"])
    assert losses[None] == losses[batch.completion_len]
    assert abs(losses[None] - losses[batch.tokens_bt.shape[1]]) > 1e-4


def test_negative_advantage_scale_shrinks_only_the_negative_side():
    """`negative_advantage_scale` (asymmetric credit, Zhu et al. 2025) under ReMax: the prepared
    advantage is (r - b) on rows that beat the greedy reward and 0.25 (r - b) on rows below it, on
    every completion token (NumPy reference); the update with scale 1 keeps -1. Catches: scaling
    both sides, scaling the positive side, or a scale applied before the baseline is subtracted."""
    batch = dataclasses.replace(_batch(3), baseline_rewards_b=jnp.asarray([1, 0, 1, 0, 0, 1, 1, 0], jnp.float32))
    r, b = np.asarray(batch.rewards_b), np.asarray(batch.baseline_rewards_b)
    mask = np.asarray(batch.loss_mask_bt, np.float32)
    for scale in (1.0, 0.25):
        prepared, _ = prepare_batch(_state(AlgorithmConfig(algorithm="remax", negative_advantage_scale=scale)), batch)
        diff = r - b
        want = np.where(diff < 0, scale * diff, diff)[:, None] * mask
        assert (diff < 0).any() and (diff > 0).any()
        np.testing.assert_allclose(np.asarray(prepared.advantages_bt) * mask, want, atol=1e-6)
    with pytest.raises(ConfigError, match="negative_advantage_scale=1.5 must lie in"):
        AlgorithmConfig(algorithm="remax", negative_advantage_scale=1.5)


def test_ppo_whitens_advantages_after_taking_value_targets():
    """PPO's preset whitens GAE advantages over the batch's completion tokens (verl, OpenAI
    baselines); the value targets are the raw advantages plus old values, as verl computes them."""
    batch = _batch(8)
    state = _state(AlgorithmConfig(algorithm="ppo", lam=0.9))
    prepared, _ = prepare_batch(state, batch)
    mask = np.asarray(batch.loss_mask_bt, np.float32)
    values = np.asarray(prepared.old_values_bt)
    raw = np.asarray(gae_from_rewards(dense_rewards(batch.rewards_b, jnp.asarray(mask)), jnp.asarray(values),
                                      jnp.asarray(mask), 1.0, 0.9))
    np.testing.assert_allclose(np.asarray(prepared.returns_bt), raw + values, atol=1e-6)
    on = mask > 0
    mean, var = raw[on].mean(), raw[on].var(ddof=1)
    np.testing.assert_allclose(np.asarray(prepared.advantages_bt)[on], (raw[on] - mean) / np.sqrt(var + 1e-8),
                               atol=1e-5)


def test_truncated_and_masked_importance_sampling_through_update_step():
    """With `recompute_old_logp`, TIS weights min(pi_old / mu, cap) and MIS drops tokens whose ratio
    leaves [1/cap, cap] (token and sequence level), as written in NumPy from the definitions; the
    sampler/trainer gap is reported as update/logp_diff_*. With mu = pi_old, TIS's update equals no
    correction's."""
    batch = _batch(9, noise=0.6)
    # Jitted, as the update recomputes it: from jax 0.11 on, op-by-op (eager) scoring differs from
    # the compiled program in the last f32 bit (4.8e-7 here), so mu = pi_old holds only compiled.
    logp, _ = jax.jit(token_logprobs, static_argnums=0)(CFG, _params(), batch.tokens_bt, batch.attn_mask_bt)
    mask = np.asarray(batch.loss_mask_bt)
    log_w = np.where(mask, np.asarray(logp) - np.asarray(batch.sampler_logp_bt), 0.0)
    cap = 1.5
    def run(cap=cap, **kw):
        algo = AlgorithmConfig(algorithm="dapo", recompute_old_logp=True, off_policy_cap=cap, **kw)
        return update_step(_state(algo), batch, jax.random.key(0))[1]

    m = run(off_policy="tis")
    np.testing.assert_allclose(float(m["train/is_weight_mean"]), np.minimum(np.exp(log_w), cap)[mask].mean(),
                               rtol=1e-5)
    np.testing.assert_allclose(float(m["update/logp_diff_max"]), np.abs(log_w[mask]).max(), rtol=1e-5)
    m = run(off_policy="mis")
    np.testing.assert_allclose(float(m["train/is_dropped_frac"]), (np.abs(log_w[mask]) > np.log(cap)).mean(),
                               rtol=1e-6)
    m = run(cap=3.0, off_policy="mis", off_policy_level="sequence")
    seq = np.abs(log_w.sum(axis=1)) > np.log(3.0)
    dropped_tokens = (mask * seq[:, None]).sum() / mask.sum()
    np.testing.assert_allclose(float(m["train/is_dropped_frac"]), dropped_tokens, rtol=1e-6)
    assert 0 < dropped_tokens < 1

    on_policy = batch.replace(sampler_logp_bt=jnp.where(batch.loss_mask_bt, logp, 0.0))
    # TIS at the cap above: the program compiled for the first check runs again (no new compile).
    outs = [update_step(_state(AlgorithmConfig(algorithm="dapo", recompute_old_logp=True, off_policy=c,
                                               off_policy_cap=cap)), on_policy, jax.random.key(0))[0]
            for c in ("none", "tis")]
    for a, b in zip(jax.tree.leaves(outs[0].params), jax.tree.leaves(outs[1].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)


def test_extreme_log_ratios_give_finite_updates():
    """Sampler log-probs 150 nats off on some tokens (masked, clipped or not) would overflow
    exp(logp - old_logp) without verl's +-20 log-ratio clamp and give NaN gradients; every
    ratio-based loss and the off-policy weights must keep the update finite."""
    batch = _batch(10)
    extreme = batch.sampler_logp_bt.at[:, PROMPT].add(-150.0).at[:, PROMPT + 1].add(150.0)
    batch = batch.replace(sampler_logp_bt=extreme)
    for algo in (AlgorithmConfig(algorithm="grpo"), AlgorithmConfig(algorithm="remax", advantage="grpo"),
                 AlgorithmConfig(algorithm="gspo"), AlgorithmConfig(algorithm="cispo"),
                 AlgorithmConfig(algorithm="topr"),
                 AlgorithmConfig(algorithm="dapo", recompute_old_logp=True, off_policy="tis")):
        state, m = update_step(_state(algo), batch, jax.random.key(0))
        bad = [k for k, v in m.items() if not np.isfinite(float(v)) and not k.startswith("ratio/")]
        assert not bad, (algo.policy_loss, bad)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params)), algo.policy_loss


def test_shaping_is_applied_and_train_metrics_cover_trained_rows():
    """Overlong shaping changes train/reward_mean by the DAPO formula; a fully masked (filler) row
    is left out of the train/ averages."""
    batch = _batch(11)
    mask = np.array(batch.loss_mask_bt)
    mask[0] = False  # a filler row
    batch = batch.replace(loss_mask_bt=jnp.asarray(mask))
    shaping = RewardShaping(overlong_max_length=5, overlong_buffer=2)
    _, m = prepare_batch(_state(AlgorithmConfig(algorithm="dapo"), shaping=shaping), batch)
    lengths = mask.sum(1)
    pen = np.where(lengths <= 3, 0.0, np.where(lengths <= 5, (3 - lengths) / 2, -1.0))
    rows = lengths > 0
    np.testing.assert_allclose(float(m["train/reward_mean"]), (np.asarray(batch.rewards_b) + pen)[rows].mean(),
                               rtol=1e-6)
    np.testing.assert_allclose(float(m["train/length_mean"]), lengths[rows].mean(), rtol=1e-6)
    assert float(m["train/rows"]) == rows.sum() == 7


# ----------------------------------------------------------------------------- learning tests

PROMPTS, SAMPLES, PROMPT_LEN, GEN_LEN = 4, 8, 3, 6
SEED = 0
TARGETS = jnp.arange(16)  # reward 1 when any completion token is in this set (~55% at random)


@jax.jit
def _sample(params, prompts_pt, key):
    """A plain scan sampler (no KV cache): re-run the model on the buffer and sample the next token."""
    toks = jnp.repeat(prompts_pt, SAMPLES, axis=0)
    toks = jnp.concatenate([toks, jnp.zeros((toks.shape[0], GEN_LEN), toks.dtype)], axis=1)

    def step(toks, xs):
        i, k = xs
        logits_btv, _ = forward(CFG, params, toks)  # causal: the unfilled tail cannot leak backwards
        logits_bv = jax.lax.dynamic_index_in_dim(logits_btv, PROMPT_LEN + i - 1, axis=1, keepdims=False)
        return toks.at[:, PROMPT_LEN + i].set(jax.random.categorical(k, logits_bv)), None

    toks, _ = jax.lax.scan(step, toks, (jnp.arange(GEN_LEN), jax.random.split(key, GEN_LEN)))
    return toks


def _bandit_run(state: TrainState, iterations: int):
    prompts = jax.random.randint(jax.random.key(SEED + 5), (PROMPTS, PROMPT_LEN), 16, CFG.vocab_size)
    b, t = PROMPTS * SAMPLES, PROMPT_LEN + GEN_LEN
    attn = jnp.ones((b, t), bool)
    loss_mask = jnp.arange(t)[None, :].repeat(b, 0) >= PROMPT_LEN
    groups = prompt_major_group_ids(b, SAMPLES)
    means, history = [], []
    for it in range(iterations):
        toks = _sample(state.params, prompts, jax.random.key(SEED + 100 + it))
        rewards = jnp.any(jnp.isin(toks[:, PROMPT_LEN:], TARGETS), axis=1).astype(jnp.float32)
        means.append(float(rewards.mean()))
        logp, _ = token_logprobs(CFG, state.params, toks, attn)
        batch = RolloutBatch(tokens_bt=toks, attn_mask_bt=attn, loss_mask_bt=loss_mask,
                             sampler_logp_bt=jnp.where(loss_mask, logp, 0.0), rewards_b=rewards, group_ids_b=groups,
                             completion_len=GEN_LEN)
        state, metrics = update_step(state, batch, jax.random.key(it))
        history.append({k: float(v) for k, v in metrics.items()})
    return means, history


def test_grpo_learns_a_bandit_task():
    """Under a fixed seed, mean reward over the last 3 GRPO iterations beats the first 3 by a margin."""
    state = init_train_state(CFG, _params(), AlgorithmConfig(algorithm="dapo"), OptimConfig(learning_rate=6e-3))
    means, _ = _bandit_run(state, 16)
    assert np.mean(means[-3:]) > np.mean(means[:3]) + 0.25, means


def test_ppo_with_a_critic_learns_a_bandit_task():
    """PPO with GAE and a learned value model on the same task: reward rises, and the value loss of
    the last iterations is well below the first (the critic fits the returns)."""
    algo = AlgorithmConfig(algorithm="ppo", lam=0.95)
    state = init_train_state(CFG, _params(), algo, OptimConfig(learning_rate=6e-3),
                             update_cfg=UpdateConfig(num_epochs=2, num_minibatches=2), key=jax.random.key(2))
    means, history = _bandit_run(state, 16)
    value_loss = [h["loss/value"] for h in history]
    assert np.mean(means[-3:]) > np.mean(means[:3]) + 0.2, means
    assert np.mean(value_loss[-3:]) < 0.5 * np.mean(value_loss[:3]), value_loss


def test_update_config_rejects_bad_schedules():
    with pytest.raises(ConfigError, match="update.num_epochs=0"):
        UpdateConfig(num_epochs=0)
    assert dataclasses.replace(UpdateConfig(), num_minibatches=2).chunks == 2


def test_chunked_scoring_matches_and_entropy_is_skipped_when_unused():
    """An explicit small chunk gives the unchunked update's metrics and params; with entropy
    neither in the loss nor logged, no entropy metric exists (it was never computed)."""
    batch = _batch(12)
    linear = OptimConfig(learning_rate=1.0, eps=1e3, max_grad_norm=None)  # params step ~ the gradient
    outs = [update_step(_state(AlgorithmConfig(algorithm="grpo", entropy_coef=0.01), linear,
                               update_cfg=UpdateConfig(logprob_chunk=c)), batch, jax.random.key(0)) for c in (None, 3)]
    (s1, m1), (s2, m2) = outs
    for name in m1:
        np.testing.assert_allclose(float(m2[name]), float(m1[name]), rtol=1e-5, atol=1e-6, err_msg=name)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    _, m = update_step(_state(AlgorithmConfig(algorithm="grpo"), update_cfg=UpdateConfig(log_entropy=False)),
                       batch, jax.random.key(0))
    assert "entropy" not in m and "loss/entropy" not in m and "entropy" in m1
