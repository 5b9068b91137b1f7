"""The compiled update step: one compilation per batch shape, multi-epoch PPO in one call, exact
micro-batch accumulation, reference reset, clear errors, and a GRPO learning test on a bandit task."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.models import forward, init_params, preset, token_logprobs
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.update import Batch, TrainState, init_train_state, reset_reference, update_step

CFG = preset("qwen2-test")


def _params(seed=0):
    return init_params(CFG, jax.random.key(seed))


def _batch(seed, b=8, t=12, prompt=5):
    """Left-padded prompts of ragged length, completions of ragged length, sampler log-probs."""
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
    old_logp, _ = token_logprobs(CFG, _params(), jnp.asarray(toks), jnp.asarray(attn))
    old_logp = old_logp + rng.normal(scale=0.05, size=(b, t)).astype(np.float32)  # slightly off-policy
    rewards = rng.integers(0, 2, b).astype(np.float32)
    return Batch(jnp.asarray(toks), jnp.asarray(attn), jnp.asarray(loss), old_logp, jnp.asarray(rewards),
                 prompt_major_group_ids(b, 4))


def test_ppo_multi_epoch_multi_minibatch_compiles_once():
    """A 2-epoch x 2-minibatch x 2-microbatch PPO update runs in one call; a second batch of the
    same shape (new values, new rng) reuses the compiled program."""
    algo = AlgorithmConfig(algorithm="ppo", num_epochs=2, num_minibatches=2, num_microbatches=2,
                           gamma=0.99, lam=0.95, entropy_coef=0.01)
    state = init_train_state(CFG, _params(), algo, OptimConfig(learning_rate=1e-3), key=jax.random.key(1))
    p0 = np.asarray(state.params["embed"]).copy()
    v0 = np.asarray(state.value_params["value_head"]).copy()
    before = update_step._cache_size()
    state, m1 = update_step(state, _batch(0), jax.random.key(0))
    state, m2 = update_step(state, _batch(1), jax.random.key(1))
    assert update_step._cache_size() - before == 1
    assert int(state.step) == 8 and int(m1["num_updates"]) == 4
    for m in (m1, m2):
        assert all(np.isfinite(float(v)) for v in m.values()), m
    assert float(m1["loss/value"]) > 0 and float(m1["grad_norm"]) > 0
    assert not np.allclose(np.asarray(state.params["embed"]), p0)
    assert not np.allclose(np.asarray(state.value_params["value_head"]), v0)  # the critic trains too
    # Later epochs see a moved policy: ratios leave 1 and clipping can engage.
    assert float(m1["ratio/max"]) > 1.0 and float(m1["ratio/min"]) < 1.0


def test_microbatch_accumulation_equals_single_batch():
    """Four accumulated micro-batches give the same gradient norm, loss parts, metrics and update as
    one batch (GRPO with a k3 KL loss to the reference, seq-mean-token-mean aggregation)."""
    # eps=1e3 makes Adam's first step ~ lr * g / eps, linear in the gradient, so params compare g.
    optim = OptimConfig(learning_rate=1.0, eps=1e3, max_grad_norm=None)
    batch = _batch(2)
    results = []
    for k in (1, 4):
        algo = AlgorithmConfig(algorithm="grpo", num_microbatches=k, kl_coef=0.1)
        state = init_train_state(CFG, _params(), algo, optim)
        state = state.replace(ref_params=_params(seed=7))  # a reference that differs from the policy
        results.append(update_step(state, batch, jax.random.key(0)))
    (s1, m1), (s4, m4) = results
    for name in m1:
        np.testing.assert_allclose(float(m4[name]), float(m1[name]), rtol=2e-5, atol=1e-7, err_msg=name)
    assert float(m1["loss/kl"]) > 0 and float(m1["kl_ref"]) > 0
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_reset_reference_copies_policy_and_restarts_optimizer():
    """ProRL reset: the reference equals the policy (in separate buffers) and Adam's count is 0."""
    algo = AlgorithmConfig(algorithm="grpo")
    state = init_train_state(CFG, _params(), algo, OptimConfig())
    state = state.replace(ref_params=_params(seed=3), opt_state=jax.tree.map(lambda x: x + 1, state.opt_state))
    new = reset_reference(state)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(new.ref_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a is not b
    assert all(int(x) == 0 for x in jax.tree.leaves(new.opt_state) if x.dtype == jnp.int32)


def test_bad_batch_size_and_missing_remax_baseline_are_config_errors():
    """Indivisible batch sizes and ReMax without greedy baselines fail with one clear line."""
    state = init_train_state(CFG, _params(), AlgorithmConfig(algorithm="dapo", num_minibatches=3), OptimConfig())
    with pytest.raises(ConfigError, match="divisible by num_minibatches"):
        update_step(state, _batch(0), jax.random.key(0))
    state = init_train_state(CFG, _params(), AlgorithmConfig(algorithm="remax"), OptimConfig())
    with pytest.raises(ConfigError, match="baseline_rewards_b"):
        update_step(state, _batch(0), jax.random.key(0))


# ----------------------------------------------------------------------------- learning test

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


def test_grpo_learns_a_bandit_task():
    """Under a fixed seed, mean reward over the last 3 GRPO iterations beats the first 3 by a margin."""
    algo = AlgorithmConfig(algorithm="dapo", recompute_old_logp=True)
    state: TrainState = init_train_state(CFG, _params(), algo, OptimConfig(learning_rate=6e-3))
    prompts = jax.random.randint(jax.random.key(SEED + 5), (PROMPTS, PROMPT_LEN), 16, CFG.vocab_size)
    b, t = PROMPTS * SAMPLES, PROMPT_LEN + GEN_LEN
    attn = jnp.ones((b, t), bool)
    loss_mask = jnp.arange(t)[None, :].repeat(b, 0) >= PROMPT_LEN
    groups = prompt_major_group_ids(b, SAMPLES)
    means = []
    for it in range(16):
        toks = _sample(state.params, prompts, jax.random.key(SEED + 100 + it))
        rewards = jnp.any(jnp.isin(toks[:, PROMPT_LEN:], TARGETS), axis=1).astype(jnp.float32)
        means.append(float(rewards.mean()))
        batch = Batch(toks, attn, loss_mask, jnp.zeros((b, t)), rewards, groups)
        state, metrics = update_step(state, batch, jax.random.key(it))
    assert np.mean(means[-3:]) > np.mean(means[:3]) + 0.25, means
