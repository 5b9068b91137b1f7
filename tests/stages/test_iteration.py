"""The traceable rollout and the compiled iteration: the traced sampler equals `generate`, dynamic
sampling keeps the groups a NumPy reference keeps, ReMax's greedy baseline equals an independent
greedy run's reward, and the stages' metrics never overwrite each other."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import init_params, preset
from rljax.objectives import AlgorithmConfig, RolloutNeeds
from rljax.optim import OptimConfig
from rljax.rewards.base import Rewards
from rljax.sampling import SampleControls, generate, sample
from rljax.stages.iteration import make_iteration, merge_metrics
from rljax.stages.rollout import rollout
from rljax.update import init_train_state

CFG = preset("qwen2-test")
P, T, N, G = 6, 7, 4, 3
CONTROLS = SampleControls(max_new_tokens=5, num_samples=N, temperature=1.0, eos_ids=(3,), pad_id=0)


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, CFG.vocab_size, (P, T)).astype(np.int32)
    mask = np.ones((P, T), bool)
    mask[1, :3] = False  # left padding
    mask[4, :5] = False
    return np.where(mask, tokens, 0), mask, np.arange(P, dtype=np.int32) * 10


def _reward_np(tokens, mask):
    """Reward 1 when the completion's first token is a multiple of 5: varies within some groups, not others."""
    return ((tokens[:, 0] % 5) == 0).astype(np.float32) * mask[:, 0]


def reward_callback(tokens_bt, mask_bt, index_b):
    del index_b
    total = ((tokens_bt[:, 0] % 5) == 0).astype(jnp.float32) * mask_bt[:, 0]
    return Rewards(total, {"even": total}, jnp.zeros(total.shape, bool))


@functools.cache
def _compiled_rollout(num_groups: int, dynamic: bool = False, needs: RolloutNeeds = RolloutNeeds()):
    """`rollout` compiled once per (groups, dynamic sampling, needs): the tests that roll out the
    same way share one program instead of compiling it again (or running it op by op)."""
    return jax.jit(lambda p, t, m, i, k: rollout(CFG, p, t, m, i, k, controls=CONTROLS, reward_callback=reward_callback,
                                                  num_groups=num_groups, dynamic_sampling=dynamic, needs=needs))


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def test_traced_sample_equals_generate(params):
    """`sample` compiled inside a caller's jit gives `generate`'s tokens, log-probs and masks."""
    tokens, mask, _ = _prompts()
    key = jax.random.key(5)
    ref = generate(CFG, params, tokens, mask, key=key, controls=CONTROLS)
    traced = jax.jit(lambda p, t, m, k: sample(CFG, p, t, m, k, CONTROLS))(params, tokens, mask, key)
    np.testing.assert_array_equal(np.asarray(traced.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(traced.mask), np.asarray(ref.mask))
    np.testing.assert_allclose(np.asarray(traced.logprobs), np.asarray(ref.logprobs), atol=1e-6)
    assert traced.tokens.shape == (P * N, CONTROLS.max_new_tokens)


@pytest.mark.parametrize("dynamic", [False, True])
def test_rollout_builds_the_batch_a_numpy_reference_builds(params, dynamic):
    """rollout: prompt | completion rows of the selected groups, with DAPO's dynamic sampling (keep
    groups whose rewards differ, kept first in pool order, then masked fillers) written in NumPy.
    Catches: rows taken from the wrong groups or samples, fillers that keep their loss mask, and
    sampler log-probs or rewards misaligned with their rows."""
    tokens, mask, index = _prompts(1)
    key = jax.random.key(7)
    batch, metrics, preview = _compiled_rollout(G, dynamic)(params, tokens, mask, index, key)
    out = generate(CFG, params, tokens, mask, key=key, controls=CONTROLS)
    comp, cmask, clogp = (np.asarray(x) for x in (out.tokens, out.mask, out.logprobs))
    rewards_pn = _reward_np(comp, cmask).reshape(P, N)
    if dynamic:
        keep = rewards_pn.max(1) > rewards_pn.min(1)
        order = [p for p in range(P) if keep[p]] + [p for p in range(P) if not keep[p]]
        groups, valid = np.array(order[:G]), keep[order[:G]]
        assert float(metrics["rollout/dynamic_kept"]) == keep.sum()
        assert 0 < keep.sum() < P, "the fixture should keep some groups and drop others"
    else:
        groups, valid = np.arange(G), np.ones(G, bool)
    rows = (groups[:, None] * N + np.arange(N)).reshape(-1)
    want_tokens = np.concatenate([np.repeat(tokens[groups], N, 0), comp[rows]], axis=1)
    np.testing.assert_array_equal(np.asarray(batch.tokens_bt), want_tokens)
    want_loss = np.concatenate([np.zeros((G * N, T), bool), cmask[rows] & np.repeat(valid, N)[:, None]], axis=1)
    np.testing.assert_array_equal(np.asarray(batch.loss_mask_bt), want_loss)
    np.testing.assert_allclose(np.asarray(batch.sampler_logp_bt)[:, T:], clogp[rows], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(batch.rewards_b), rewards_pn.reshape(-1)[rows])
    np.testing.assert_array_equal(np.asarray(batch.group_ids_b), np.repeat(np.arange(G), N))
    assert batch.completion_len == CONTROLS.max_new_tokens and batch.baseline_rewards_b is None
    np.testing.assert_allclose(float(metrics["rollout/reward_mean"]), rewards_pn.mean(), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(preview.completion_tokens_kc), comp[np.arange(4) * N])


def test_remax_rollout_carries_the_greedy_baseline(params):
    """With `needs.greedy_baseline` (ReMax), each row's baseline is the reward of its prompt's greedy
    completion, computed here independently with `generate(greedy)`. Catches: a baseline from a
    sampled (not greedy) completion, or one not repeated over the prompt's group."""
    tokens, mask, index = _prompts(2)
    key = jax.random.key(9)
    batch, metrics, _ = _compiled_rollout(P, needs=RolloutNeeds(greedy_baseline=True))(params, tokens, mask, index, key)
    greedy = generate(CFG, params, tokens, mask, key=jax.random.key(123), controls=CONTROLS.greedy_version())
    want = _reward_np(np.asarray(greedy.tokens), np.asarray(greedy.mask))
    np.testing.assert_array_equal(np.asarray(batch.baseline_rewards_b), np.repeat(want, N))
    np.testing.assert_allclose(float(metrics["rollout/baseline_reward_mean"]), want.mean(), rtol=1e-6)


def test_remax_dynamic_sampling_keeps_groups_whose_samples_differ_from_the_greedy_reward(params):
    """Under ReMax (advantage r - greedy reward) a group is informative when any sample's reward
    differs from its prompt's greedy reward, even if the samples agree among themselves. The
    reference mask comes from the same rollout without selection. On these prompts 3 groups pass
    the ReMax test and 1 DAPO's variance test, so the variance test would keep 1 group and pad 2.
    Catches: dynamic sampling that ignores the baseline (drops groups of equal, non-zero advantage)."""
    tokens, mask, index = _prompts(4)
    key = jax.random.key(4)
    needs = RolloutNeeds(greedy_baseline=True)
    full, _, _ = _compiled_rollout(P, needs=needs)(params, tokens, mask, index, key)
    rewards_pn = np.asarray(full.rewards_b).reshape(P, N)
    baseline_p = np.asarray(full.baseline_rewards_b)[::N]
    keep_p = np.abs(rewards_pn - baseline_p[:, None]).max(axis=1) > 0
    assert keep_p.sum() == 3 and (rewards_pn.max(1) > rewards_pn.min(1)).sum() == 1
    batch, metrics, _ = _compiled_rollout(G, True, needs)(params, tokens, mask, index, key)
    want_groups = np.flatnonzero(keep_p)[:G]
    rows = (want_groups[:, None] * N + np.arange(N)).reshape(-1)
    np.testing.assert_array_equal(np.asarray(batch.tokens_bt), np.asarray(full.tokens_bt)[rows])
    np.testing.assert_array_equal(np.asarray(batch.baseline_rewards_b), np.repeat(baseline_p[want_groups], N))
    assert float(metrics["rollout/dynamic_kept"]) == 3 and float(metrics["rollout/dynamic_padded"]) == 0
    assert np.asarray(batch.loss_mask_bt).any(axis=1).all()


def test_remax_iteration_end_to_end(params):
    """ReMax through the compiled iteration: the iteration reads the objective's declared needs
    from the state, and the update consumes the baseline: adv/mean equals the token mean of
    reward - greedy reward computed here from the same rollout (a baseline ignored, or taken as 0,
    gives the plain reward mean instead), and params move. The rollout here is the greedy-baseline
    test's compiled program (remax needs only the baseline), called with the iteration's sampling key.
    Catches: an iteration that ignores the declared needs (no baseline: adv/mean is the reward
    mean), or an update that does not apply its gradient."""
    tokens, mask, index = _prompts(3)
    algo = AlgorithmConfig(algorithm="remax")
    state = init_train_state(CFG, jax.tree.map(jnp.copy, params), algo, OptimConfig(learning_rate=1e-2))
    before = np.asarray(state.params["embed"]).copy()  # (the iteration donates the state's buffers)
    key = jax.random.key(11)
    batch, _, _ = _compiled_rollout(P, needs=algo.needs)(params, tokens, mask, index, jax.random.split(key)[0])
    iteration = make_iteration(CONTROLS, reward_callback, num_groups=P)
    state, metrics, _ = iteration(state, tokens, mask, index, key)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    loss_mask = np.asarray(batch.loss_mask_bt)
    adv_b = np.asarray(batch.rewards_b) - np.asarray(batch.baseline_rewards_b)
    want = (adv_b[:, None] * loss_mask).sum() / loss_mask.sum()
    np.testing.assert_allclose(float(metrics["adv/mean"]), want, atol=1e-6)
    assert abs(want - (np.asarray(batch.rewards_b)[:, None] * loss_mask).sum() / loss_mask.sum()) > 1e-3
    assert not np.array_equal(np.asarray(state.params["embed"]), before)


def test_merge_metrics_refuses_a_shared_name():
    """The old `{**update_metrics, **metrics}` let the rollout's reward overwrite the update's."""
    assert merge_metrics({"rollout/a": 1}, {"train/a": 2}) == {"rollout/a": 1, "train/a": 2}
    with pytest.raises(ValueError, match="reward/mean"):
        merge_metrics({"reward/mean": 1.0}, {"reward/mean": 2.0})
