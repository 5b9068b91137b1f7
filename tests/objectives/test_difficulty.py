"""VL-Cogito's ODSW stage weights and dynamic length reward equal NumPy written from the paper's
formulas (rljax.objectives.difficulty's docstring), on a fixed batch with a prompt none of whose
rollouts is correct, one all correct, a tie at Acc = 1/2 and a rollout exactly at its target; and
both reach the update's advantages through `prepare_batch`, by stage and iteration."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.models import init_params, preset
from rljax.objectives import ADVANTAGES, AlgorithmConfig, prompt_major_group_ids
from rljax.objectives.difficulty import dynamic_length_reward, prompt_accuracy, stage_weights
from rljax.objectives.shaping import RewardShaping
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, init_train_state, prepare_batch

# 5 prompts x 4 rollouts: Acc = 0 (none correct), 1 (all), 1/2 (the tie), 1/4, 3/4.
CORRECT_GN = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 1]], np.float32)
LENGTH_GN = np.array([[2, 9, 5, 12], [3, 5, 4, 8], [6, 2, 10, 8], [1, 7, 14, 20], [4, 4, 8, 2]], np.float32)
GROUPS_B = np.repeat(np.arange(5), 4)
BUDGET = 20


def np_stage_weight(stage, acc, w0):
    """F(Acc) from the paper's stage functions."""
    bell = np.cos(np.pi * (acc - 0.5))
    f = {"easy": np.where(acc > 0.5, 1.0, bell), "medium": bell, "hard": np.where(acc <= 0.5, 1.0, bell)}[stage]
    return np.where(acc == 0, w0 if stage == "hard" else 0.0, f)


def np_dylr(correct_gn, length_gn, coef, fallback):
    """r_len per rollout: target = mean length of the prompt's correct rollouts (fallback if none);
    -coef/2 (1 + cos(pi min(L/L_tgt, 2))) for a wrong rollout, min(L/L_tgt, 1) with no correct one."""
    out = np.zeros_like(length_gn)
    target = np.zeros_like(length_gn)
    for g in range(correct_gn.shape[0]):
        hit = correct_gn[g] > 0
        tgt = length_gn[g][hit].mean() if hit.any() else fallback
        cap = 2.0 if hit.any() else 1.0
        target[g] = tgt
        for i in range(correct_gn.shape[1]):
            if not hit[i]:
                out[g, i] = -coef / 2 * (1 + np.cos(np.pi * min(length_gn[g, i] / tgt, cap)))
    return out, target


@pytest.mark.parametrize("stage", ["easy", "medium", "hard"])
def test_stage_weights_equal_the_paper(stage):
    """Catches: a stage's function flipped (easy <-> hard differ at Acc = 1/4 and 3/4), the medium
    bell centred off 1/2, F(0) not 0 in easy/medium or not w_0 in hard, or Acc counted over a
    filler row (one is appended to prompt 2: with it, its Acc would be 2/5)."""
    correct_b = np.append(CORRECT_GN.reshape(-1), 0.0)
    groups_b = np.append(GROUPS_B, 2)
    trained_b = np.append(np.ones(20, np.float32), 0.0)
    acc_b = prompt_accuracy(jnp.asarray(correct_b), jnp.asarray(groups_b), jnp.asarray(trained_b))
    np.testing.assert_allclose(np.asarray(acc_b)[:20], CORRECT_GN.mean(1).repeat(4), atol=0)
    got = stage_weights(acc_b, ("easy", "medium", "hard"), ["easy", "medium", "hard"].index(stage), 0.3)
    want = np_stage_weight(stage, CORRECT_GN.mean(1), 0.3).repeat(4)
    np.testing.assert_allclose(np.asarray(got)[:20], want, atol=1e-6)


@pytest.mark.parametrize("fallback", [BUDGET, 6])
def test_dynamic_length_reward_equals_the_paper(fallback):
    """Catches: the target as the mean over all rollouts instead of the correct ones (prompts 2, 3,
    4 differ), a no-correct prompt's target as 0 or its own mean instead of the fallback, a
    length past the fallback penalised (fallback 6: prompt 0 has rollouts of 9 and 12), a correct
    rollout given a length term, or the ratio left uncapped at 2 (prompt 3: 20 / 7 > 2). Prompt 4's
    wrong rollout has length 8 vs target 10/3; prompt 2's wrong rollout of 8 is exactly at its target."""
    got, target = dynamic_length_reward(jnp.asarray(CORRECT_GN.reshape(-1)), jnp.asarray(LENGTH_GN.reshape(-1)),
                                        jnp.asarray(GROUPS_B), jnp.ones(20), coef=0.5, fallback=float(fallback))
    want, want_target = np_dylr(CORRECT_GN, LENGTH_GN, 0.5, float(fallback))
    np.testing.assert_allclose(np.asarray(target), want_target.reshape(-1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got), want.reshape(-1), atol=1e-6)
    assert float(got.reshape(5, 4)[2, 3]) == pytest.approx(0.0, abs=1e-6)  # at its target: no cost


CFG = preset("qwen2-test")
PROMPT, T = 3, 3 + BUDGET


def _batch():
    """Rows of the fixed batch: completion lengths LENGTH_GN, verifier rewards CORRECT_GN."""
    rng = np.random.default_rng(0)
    toks = rng.integers(0, CFG.vocab_size, (20, T))
    loss = np.zeros((20, T), bool)
    for i, n in enumerate(LENGTH_GN.reshape(-1).astype(int)):
        loss[i, PROMPT:PROMPT + n] = True
    attn = loss.copy()
    attn[:, :PROMPT] = True
    return RolloutBatch(tokens_bt=jnp.asarray(toks * attn), attn_mask_bt=jnp.asarray(attn),
                        loss_mask_bt=jnp.asarray(loss), sampler_logp_bt=jnp.zeros((20, T)),
                        rewards_b=jnp.asarray(CORRECT_GN.reshape(-1)), group_ids_b=prompt_major_group_ids(20, 4),
                        completion_len=BUDGET)


@pytest.fixture(scope="module")
def base_state():
    return init_train_state(CFG, init_params(CFG, jax.random.key(0)), AlgorithmConfig(algorithm="grpo"),
                            OptimConfig(learning_rate=1e-3))


def test_prepare_batch_weights_advantages_and_adds_the_length_reward(base_state):
    """A_i = F_hard(Acc) * GRPO(r + r_len)_i in the hard stage with DyLR; in the easy stage of a
    3-stage schedule (iteration 0) F_easy and no DyLR; at iteration 5 (>= both boundaries, 2
    optimiser steps an iteration) the hard stage again. Catches: the weight applied to the rewards
    instead of the advantages, DyLR outside the hard stage, the stage read off the optimiser step
    instead of the iteration. Off (the default), advantages are bitwise those of a plain state."""
    batch = _batch()
    grpo = lambda r: np.asarray(ADVANTAGES.get("grpo")(jnp.asarray(r, jnp.float32), batch.group_ids_b,  # noqa: E731
                                                       batch.loss_mask_bt.astype(jnp.float32), std_normalize=True,
                                                       eps=1e-6))
    acc = CORRECT_GN.mean(1)
    r_len, _ = np_dylr(CORRECT_GN, LENGTH_GN, 0.5, float(BUDGET))
    mask = np.asarray(batch.loss_mask_bt, np.float32)

    hard = base_state.replace(shaping=RewardShaping(difficulty_stages=("hard",), length_reward_coef=0.5))
    prepared, metrics = prepare_batch(hard, batch)
    want = grpo(CORRECT_GN.reshape(-1) + r_len.reshape(-1)) * np_stage_weight("hard", acc, 0.25).repeat(4)[:, None]
    np.testing.assert_allclose(np.asarray(prepared.advantages_bt), want * mask, atol=1e-5)
    assert float(metrics["train/length_reward_mean"]) == pytest.approx(r_len.mean(), abs=1e-6)

    schedule = RewardShaping(difficulty_stages=("easy", "medium", "hard"), difficulty_boundaries=(2, 4),
                             length_reward_coef=0.5)
    two_steps = dataclasses.replace(base_state.update_cfg, num_minibatches=2)
    staged = base_state.replace(shaping=schedule, update_cfg=two_steps)
    prepared, metrics = prepare_batch(staged.replace(step=jnp.asarray(3, jnp.int32)), batch)  # iteration 1
    want = grpo(CORRECT_GN.reshape(-1)) * np_stage_weight("easy", acc, 0.25).repeat(4)[:, None]
    np.testing.assert_allclose(np.asarray(prepared.advantages_bt), want * mask, atol=1e-5)
    assert float(metrics["train/difficulty_stage"]) == 0 and float(metrics["train/length_reward_mean"]) == 0
    _, metrics = prepare_batch(staged.replace(step=jnp.asarray(10, jnp.int32)), batch)  # iteration 5
    assert float(metrics["train/difficulty_stage"]) == 2
    assert float(metrics["train/length_reward_mean"]) == pytest.approx(r_len.mean(), abs=1e-6)

    plain, _ = prepare_batch(base_state, batch)
    off, off_metrics = prepare_batch(base_state.replace(shaping=RewardShaping()), batch)
    assert np.array_equal(np.asarray(plain.advantages_bt), np.asarray(off.advantages_bt))
    assert "train/difficulty_weight_mean" not in off_metrics


def test_bad_curriculum_options_are_one_line():
    with pytest.raises(ConfigError, match="difficulty weighting stage"):
        RewardShaping(difficulty_stages=("medim",))
    with pytest.raises(ConfigError, match="one fewer than"):
        RewardShaping(difficulty_stages=("easy", "hard"))
