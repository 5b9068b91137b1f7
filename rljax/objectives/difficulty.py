"""VL-Cogito's progressive curriculum (Yuan et al., 2025, "VL-Cogito: Progressive Curriculum
Reinforcement Learning for Advanced Multimodal Reasoning"), as two pure, generic pieces that read
only a batch's per-row correctness, lengths and prompt groups (text and image rows alike):

- Online difficulty soft weighting (ODSW): each prompt's rollout accuracy ``Acc`` (the share of
  its rollouts the verifier calls correct) is mapped by the current stage's function ``F`` to a
  weight, and every advantage of the prompt's rows is multiplied by it: ``A_i <- F(Acc) * A_i``.
  The paper weighs the prompt's GRPO advantages this way (its released trainer scales them per
  prompt id), instead of filtering prompts by difficulty. The stage functions (`STAGES`):

      easy:    F(Acc) = 1                      if Acc > 1/2,   cos(pi (Acc - 1/2))  otherwise
      medium:  F(Acc) = cos(pi (Acc - 1/2))                    (peaks at Acc = 1/2)
      hard:    F(Acc) = 1                      if Acc <= 1/2,  cos(pi (Acc - 1/2))  otherwise
               with F(0) = w_0 (`zero_weight`, 0.25 in the paper's release)

  so the easy stage keeps the gradient of prompts the policy mostly solves and fades the hard
  ones, the medium stage favours Acc near 1/2 (the most informative, Bae et al., 2025), and the
  hard stage keeps the hard ones and fades the solved. In easy and medium ``F(0) = cos(-pi/2) = 0``
  (set exactly). A prompt none of whose rollouts is correct has zero GRPO advantage unless a
  length term separates its rollouts; the hard stage keeps such prompts at ``w_0`` because it
  runs with DyLR, which does.

- Dynamic length reward (DyLR): a per-prompt target length

      L_tgt(x) = mean length of x's correct rollouts                 (at least one correct)
      L_tgt(x) = L_fallback  (default: the completion budget)         (none correct)

  and, for an incorrect rollout of length L (tokens), with alpha = `coef`,

      r_len = -alpha/2 * (1 + cos(pi * min(L / L_tgt, 2)))          (some rollout correct)
      r_len = -alpha/2 * (1 + cos(pi * min(L / L_tgt, 1)))          (none correct)

  a correct rollout gets 0. With a correct rollout to imitate, a wrong one is penalised the
  further its length is from theirs (-alpha at 0 and at >= 2 L_tgt, 0 at L_tgt): short targets
  for easy prompts, long ones for hard prompts. With none correct, the target is the (long)
  fallback and lengths at or past it cost nothing, which pushes an unsolved prompt toward longer
  reasoning. The paper uses DyLR in its last, hard stage only; here, with a stage schedule, DyLR
  applies while the stage is "hard", and without one in every iteration. (The release scales the
  no-correct branch by a further 1/2 and adds a repetition penalty; one alpha here.)

`CurriculumTerms` carries both into `rljax.update.advantages.prepare_batch`: the length reward is
added to the shaped rewards before the estimator, the weight multiplies the estimator's
advantages (before a distillation term, whitening or negative-advantage scaling; the value
targets keep the unweighted advantages). The config lives in `RewardShaping` (``[shaping]``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax.objectives.registry import Registry

# A row is correct when its verifier's `correct` part (`RolloutBatch.verifier_rewards_b`; the total
# reward when the rollout carries no parts) reaches this (the threshold `group_stats` uses).
CORRECT_AT = 1.0

STAGES: Registry = Registry("difficulty weighting stage")


def _bell(acc):
    return jnp.cos(math.pi * (acc - 0.5))


@STAGES.register("easy")
def easy_weight(acc, zero_weight: float):
    """F(Acc) = 1 for Acc > 1/2, cos(pi (Acc - 1/2)) below (0 at Acc = 0)."""
    return jnp.where(acc == 0, 0.0, jnp.where(acc > 0.5, 1.0, _bell(acc)))


@STAGES.register("medium")
def medium_weight(acc, zero_weight: float):
    """F(Acc) = cos(pi (Acc - 1/2)) (0 at Acc = 0)."""
    return jnp.where(acc == 0, 0.0, _bell(acc))


@STAGES.register("hard")
def hard_weight(acc, zero_weight: float):
    """F(Acc) = 1 for 0 < Acc <= 1/2, cos(pi (Acc - 1/2)) above, w_0 at Acc = 0."""
    return jnp.where(acc == 0, zero_weight, jnp.where(acc <= 0.5, 1.0, _bell(acc)))


class CurriculumTerms(NamedTuple):
    """weight_b: f32 [B], each row's prompt weight F(Acc) (1 with ODSW off); length_reward_b: f32
    [B], DyLR's term (0 with it off); metrics: `train/...` scalars over the trained rows."""

    weight_b: jax.Array
    length_reward_b: jax.Array
    metrics: dict


def prompt_accuracy(correct_b, group_ids_b, trained_b):
    """Each row's prompt accuracy: correct rows over trained rows of its group (0 for fillers)."""
    b = correct_b.shape[0]
    seg = lambda v: jax.ops.segment_sum(v, group_ids_b, num_segments=b)[group_ids_b]  # noqa: E731
    return seg(correct_b * trained_b) / jnp.maximum(seg(trained_b), 1.0)


def length_targets(correct_b, lengths_b, group_ids_b, trained_b, fallback: float):
    """(L_tgt per row, whether its prompt has a correct rollout): the mean length of the group's
    correct rollouts, or `fallback` when none is correct."""
    b = correct_b.shape[0]
    seg = lambda v: jax.ops.segment_sum(v, group_ids_b, num_segments=b)[group_ids_b]  # noqa: E731
    hits = correct_b * trained_b
    n_b = seg(hits)
    solved_b = n_b > 0
    return jnp.where(solved_b, seg(hits * lengths_b) / jnp.maximum(n_b, 1.0), fallback), solved_b


def dynamic_length_reward(correct_b, lengths_b, group_ids_b, trained_b, *, coef: float, fallback: float):
    """DyLR's r_len per row (module doc), and the per-row target L_tgt."""
    target_b, solved_b = length_targets(correct_b, lengths_b, group_ids_b, trained_b, fallback)
    ratio_b = jnp.minimum(lengths_b / jnp.maximum(target_b, 1.0), jnp.where(solved_b, 2.0, 1.0))
    r_b = -0.5 * coef * (1.0 + jnp.cos(math.pi * ratio_b))
    return jnp.where(correct_b > 0, 0.0, r_b) * trained_b, target_b


def stage_weights(acc_b, stages: tuple[str, ...], stage_index, zero_weight: float):
    """F_stage(Acc) per row for the stage `stages[stage_index]` (a traced index)."""
    table = jnp.stack([STAGES.get(s)(acc_b, zero_weight) for s in stages])
    return jnp.take(table, stage_index, axis=0)


def curriculum_terms(shaping, correct_b, lengths_b, group_ids_b, trained_b, completion_len: int,
                     iteration) -> CurriculumTerms:
    """ODSW weights and DyLR rewards of one batch under `shaping` (a `RewardShaping`), at RL
    iteration `iteration` (traced int; picks the stage by `difficulty_boundaries`)."""
    f32 = jnp.float32
    correct_b, lengths_b, trained_b = (x.astype(f32) for x in (correct_b, lengths_b, trained_b))
    stages = shaping.difficulty_stages
    stage = jnp.zeros((), jnp.int32)
    if len(stages) > 1:  # stage k from iteration boundaries[k - 1] on (the `schedule` policy's rule)
        stage = jnp.searchsorted(jnp.asarray(shaping.difficulty_boundaries, jnp.int32), iteration,
                                 side="right").astype(jnp.int32)
    acc_b = prompt_accuracy(correct_b, group_ids_b, trained_b)
    n = jnp.maximum(jnp.sum(trained_b), 1.0)
    metrics = {"train/prompt_accuracy_mean": jnp.sum(acc_b * trained_b) / n}
    weight_b = jnp.ones_like(acc_b)
    if stages:
        weight_b = stage_weights(acc_b, stages, stage, shaping.difficulty_zero_weight)
        metrics["train/difficulty_stage"] = stage.astype(f32)
        metrics["train/difficulty_weight_mean"] = jnp.sum(weight_b * trained_b) / n
    length_b = jnp.zeros_like(acc_b)
    if shaping.length_reward_coef > 0:
        fallback = float(shaping.length_reward_fallback or completion_len)
        length_b, target_b = dynamic_length_reward(correct_b, lengths_b, group_ids_b, trained_b,
                                                   coef=shaping.length_reward_coef, fallback=fallback)
        if stages:  # the paper's DyLR belongs to the hard stage
            length_b = length_b * jnp.asarray([s == "hard" for s in stages], f32)[stage]
        metrics["train/length_reward_mean"] = jnp.sum(length_b) / n
        metrics["train/length_target_mean"] = jnp.sum(target_b * trained_b) / n
    return CurriculumTerms(weight_b=weight_b, length_reward_b=length_b, metrics=metrics)
