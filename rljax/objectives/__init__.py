"""RL objectives as pure functions: advantage estimators, policy losses, aggregation, KL, value
loss, off-policy corrections and reward transforms, each registered by name.

    from rljax import objectives as obj
    adv_bt = obj.ADVANTAGES.get("grpo")(rewards_b, group_ids_b, loss_mask_bt)
    loss_bt, stats = obj.POLICY_LOSSES.get("ppo_clip")(logp_bt, old_logp_bt, adv_bt, loss_mask_bt)
    loss = obj.aggregate(loss_bt, loss_mask_bt, "token-mean")
"""

from rljax.objectives.advantages import (dense_rewards, dr_grpo, gae, gae_from_rewards, grpo,
                                         prompt_major_group_ids, reinforce, reinforce_pp,
                                         reinforce_pp_baseline, remax, rloo, turn_group_advantages,
                                         whiten_advantages, zero_variance_groups)
from rljax.objectives.aggregation import aggregate, aggregate_parts
from rljax.objectives.config import PRESETS, AlgorithmConfig, RolloutNeeds, check_turn_credit
from rljax.objectives.kl import abs_kl, k1, k2, k3, k3_plus, kl
from rljax.objectives.losses import (LOG_RATIO_CLAMP, cispo, clamped_ratio, decoupled_ppo, gspo, masked_is,
                                     policy_gradient, ppo_clip, topr, truncated_is, value_loss)
from rljax.objectives.registry import (ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, OFF_POLICY,
                                       POLICY_LOSSES, ROLLOUT_NEEDS, ROLLOUT_READS, Registry)
from rljax.objectives.shaping import RewardShaping, length_penalty, overlong_penalty

__all__ = [
    "ADVANTAGES", "POLICY_LOSSES", "AGGREGATIONS", "KL_ESTIMATORS", "OFF_POLICY", "Registry",
    "ROLLOUT_NEEDS", "ROLLOUT_READS", "AlgorithmConfig", "RolloutNeeds", "PRESETS", "RewardShaping",
    "check_turn_credit",
    "grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae",
    "gae_from_rewards", "whiten_advantages", "dense_rewards", "prompt_major_group_ids",
    "zero_variance_groups", "turn_group_advantages",
    "ppo_clip", "policy_gradient", "gspo", "cispo", "topr", "value_loss", "truncated_is", "masked_is",
    "decoupled_ppo",
    "clamped_ratio", "LOG_RATIO_CLAMP",
    "kl", "k1", "k2", "k3", "k3_plus", "abs_kl", "aggregate", "aggregate_parts", "overlong_penalty",
    "length_penalty",
]
