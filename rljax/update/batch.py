"""The rollout -> update contract: the typed batches a rollout hands the update step, and the
one the update derives from it before any gradient is taken.

    RolloutBatch   (from a sampler, a replay buffer, or a notebook)
        --prepare_batch(state, batch)-->  PreparedBatch + metrics      (rljax.update.advantages)
            shaped rewards; old, reference and behaviour log-probs; old values; advantages;
            off-policy weights. Everything here is computed once, without gradients.

Both are pytrees of [B, ...] arrays (rows prompt-major when groups come from a sampler), so the
update step shuffles and splits them with one `tree.map`. Optional fields are None when the
objective does not need them; `AlgorithmConfig.needs` says which are needed, from the registry
entries' declarations, and `prepare_batch` fails with one line when a needed one is missing.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from rljax.models import values


@flax.struct.dataclass
class TurnReturns:
    """Turn-level credit's inputs from a multi-turn rollout (`env.credit = "turn"`).

    turn_bt: int32 [B, T], the model turn (0..K-1) each token belongs to, -1 on the prompt, the
    environment's tokens and padding; returns_bk: f32 [B, K], each turn's discounted return-to-go
    G_k = sum_{j >= k} gamma^(j - k) r_j (`rljax.envs.discounted_turn_returns`).
    """

    turn_bt: jax.Array
    returns_bk: jax.Array


@flax.struct.dataclass
class RolloutBatch:
    """One batch of scored rollouts: prompt (left-padded) then completion, in every [B, T] array.

    tokens_bt: int; attn_mask_bt: True on real tokens; loss_mask_bt: True on the completion tokens
    to train on (an all-False row is a filler and weighs nothing); sampler_logp_bt: f32 log-probs
    of the policy that drew each token (column t scores token t; 0 off the completion);
    rewards_b: f32 verifier rewards; group_ids_b: int in [0, B), one id per prompt group;
    completion_len: the completion budget in tokens (the sampler's `max_new_tokens`, static), the
    constant length of Dr. GRPO's aggregation and the scale of the length penalty.
    Declared needs (`AlgorithmConfig.needs`): baseline_rewards_b, the greedy response's reward
    (ReMax); old_values_bt, V(state before token t) from the rollout's value model (computed by
    `prepare_batch` when absent). turn_returns: turn-level credit (`TurnReturns`), from a
    multi-turn rollout with `env.credit = "turn"`, for an estimator whose registry entry reads it
    (`reads=("turn_returns",)`; `rljax.objectives.check_turn_credit`); None: one reward per row.
    verifier_rewards_b: the verifier's unweighted correctness part (the composer's `correct`),
    which a learned reward's agreement metric compares with (None: `rewards_b` serves).
    routes_btlk: int8/int16 [B, T, L, k], the sampler's experts of every token per MoE layer
    (prompt from the prefill, completion from decode; -1 where it recorded none: padding, a row's
    last token), which every trainer forward replays with `algorithm.routing_replay = "rollout"`
    (`rljax.models.moe`; None: replay off). B * T * L * k * itemsize bytes.
    """

    tokens_bt: jax.Array
    attn_mask_bt: jax.Array
    loss_mask_bt: jax.Array
    sampler_logp_bt: jax.Array
    rewards_b: jax.Array
    group_ids_b: jax.Array
    completion_len: int = flax.struct.field(pytree_node=False)
    baseline_rewards_b: jax.Array | None = None
    old_values_bt: jax.Array | None = None
    turn_returns: TurnReturns | None = None
    verifier_rewards_b: jax.Array | None = None
    routes_btlk: jax.Array | None = None
    vision: Any = None  # rljax.update.vision.VisionRows: each row's prompt images (None: text rows)


@flax.struct.dataclass
class PreparedBatch:
    """What the loss reads, per row: the rollout plus everything derived from it without gradients.

    loss_mask_bt: f32, the rollout's mask less any tokens the off-policy correction dropped;
    old_logp_bt: the ratio's denominator (the sampler's log-probs, or the trainer's own when
    `recompute_old_logp`); is_weight_bt: the off-policy weight (1 without a correction);
    advantages_bt: per-token advantages (0 off the mask); ref_logp_bt: the reference policy's
    log-probs (KL term); old_values_bt / returns_bt: the value model's targets (PPO);
    teacher_hidden_btd: a distillation teacher's final hidden states (a full-vocabulary loss);
    reward_model_scores_b: a learned reward model's raw score of each row (its running moments
    are updated from them); behaviour_logp_bt / correction_kl_bt: the sampler's log-probs and the
    tokens a `mask_kl` correction zeroed, for its KL term. Per mini-batch, set by the update
    step's token controls (`rljax.update.controls`): select_bt, the policy loss's selected tokens
    (Clip-Cov, KL-Cov); entropy_keep_bt, the high-entropy tokens that keep the policy loss.
    routes_btlk: the rollout's routing record, replayed by the loss's forward (routing replay).
    """

    tokens_bt: jax.Array
    attn_mask_bt: jax.Array
    loss_mask_bt: jax.Array
    old_logp_bt: jax.Array
    is_weight_bt: jax.Array
    advantages_bt: jax.Array
    ref_logp_bt: jax.Array | None = None
    old_values_bt: jax.Array | None = None
    returns_bt: jax.Array | None = None
    teacher_hidden_btd: jax.Array | None = None
    reward_model_scores_b: jax.Array | None = None
    behaviour_logp_bt: jax.Array | None = None
    correction_kl_bt: jax.Array | None = None
    select_bt: jax.Array | None = None
    entropy_keep_bt: jax.Array | None = None
    routes_btlk: jax.Array | None = None
    vision: Any = None  # the rollout's VisionRows, spliced into every trainer forward (None: text rows)


def state_values(cfg, value_params, tokens_bt, attn_mask_bt, *, remat: bool = False, unroll: bool = False):
    """V(state before token t): the value head on the hidden state at t - 1 (column 0 is 0)."""
    v_bt = values(cfg, value_params, tokens_bt, attn_mask_bt, remat=remat, unroll=unroll)
    return jnp.concatenate([jnp.zeros_like(v_bt[:, :1]), v_bt[:, :-1]], axis=1)


# Needs the rollout itself must provide, by the `RolloutBatch` field that carries each (values
# and reference log-probs are scored by `prepare_batch` from the train state instead).
ROLLOUT_FIELDS = {"greedy_baseline": "baseline_rewards_b"}


def replayed_routes(routes_btlk):
    """A routing record [B, T, L, k] as the model's `routes_lbtk` (int32 [L, B, T, k]), or None."""
    return None if routes_btlk is None else routes_btlk.astype(jnp.int32).transpose(2, 0, 1, 3)


def rows(tree: Any, n: int):
    """Splits every [B, ...] leaf into [n, B // n, ...] (mini- or micro-batches)."""
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), tree)
