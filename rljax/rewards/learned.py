"""A learned reward inside the compiled update: a frozen reward model scores every rollout row on
device, with no host round trip, and its (normalised, weighted) score is added to the verifier's
total.

    r_b = verifier total_b (host composer, `reward.correct_weight` on its correctness part)
          + weight * normalise(RM(prompt + completion)_b)

Three kinds. `judge`: a generative judge (`rljax.rewards.judge`), a causal LM that reads a
template holding the prompt and the completion and greedily decodes a verdict, parsed into a
score (the update runs the sampler for it). `bt`: a Bradley-Terry outcome reward model (a sequence-classification head read at the
row's last real token). `prm`: a process reward model (a token-classification head, the format
of TRL's PRMTrainer and Math-Shepherd, Wang et al., 2024): each step of the completion ends with
the separator token, and the step's score is the head's probability of its label 1 ("good") at
that token. A PRM's steps become either token-level rewards (`credit = "token"`: the weighted
step score lands on the step's separator token, `token_rewards_bt`, for the dense estimators
REINFORCE++ and GAE; the sequence-level estimators sum them) or one outcome reward per row
(`credit = "outcome"`), aggregated over its K steps as `min` (Lightman et al., 2023's choice),
`last`, or a discounted `sum`_k gamma^k p_k. A row without a separator has no step and scores 0.

normalise: `none`; `group` (the score minus its prompt group's mean, over the group's std: the
RM's absolute scale does not matter, only its ranking within a group, as GRPO's own
normalisation); `running` (over every row scored so far, Welford's running mean and variance,
as OpenRLHF's `normalize_reward`, updated with the batch before it is normalised).
"""

from __future__ import annotations

from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp

from rljax.models.auxiliary import FrozenModel
from rljax.models.heads import sequence_scores, token_scores
from rljax.rewards.judge import JudgeSpec

NORMALIZATIONS = ("none", "group", "running")
STEP_AGGREGATIONS = ("min", "last", "sum")


@flax.struct.dataclass
class RunningMoments:
    """Welford's running count, mean and sum of squared deviations (f32 scalars)."""

    count: jax.Array
    mean: jax.Array
    m2: jax.Array

    @classmethod
    def zeros(cls) -> RunningMoments:
        # three buffers, not one shared: the train state is donated leaf by leaf
        return cls(*(jnp.zeros((), jnp.float32) for _ in range(3)))

    def add(self, x_b, weight_b) -> RunningMoments:
        """The moments with the rows of `x_b` whose weight is 1 added (Chan et al.'s batch merge)."""
        n_b = jnp.sum(weight_b)
        mean_b = jnp.sum(x_b * weight_b) / jnp.maximum(n_b, 1.0)
        m2_b = jnp.sum(jnp.square(x_b - mean_b) * weight_b)
        n = self.count + n_b
        delta = mean_b - self.mean
        mean = self.mean + delta * n_b / jnp.maximum(n, 1.0)
        m2 = self.m2 + m2_b + jnp.square(delta) * self.count * n_b / jnp.maximum(n, 1.0)
        return RunningMoments(n, mean, m2)

    @property
    def std(self) -> jax.Array:
        return jnp.sqrt(self.m2 / jnp.maximum(self.count - 1.0, 1.0))


@flax.struct.dataclass
class LearnedReward:
    """A reward model held in the train state (`TrainState.reward_model`): the frozen model, its
    running moments (for `normalize = "running"`), and the static weight and normalisation."""

    model: FrozenModel
    moments: RunningMoments
    weight: float = flax.struct.field(pytree_node=False, default=1.0)
    normalize: Literal["none", "group", "running"] = flax.struct.field(pytree_node=False, default="none")
    eps: float = flax.struct.field(pytree_node=False, default=1e-6)
    kind: Literal["bt", "prm"] = flax.struct.field(pytree_node=False, default="bt")
    step_token: int | None = flax.struct.field(pytree_node=False, default=None)
    step_aggregation: Literal["min", "last", "sum"] = flax.struct.field(pytree_node=False, default="min")
    step_discount: float = flax.struct.field(pytree_node=False, default=1.0)
    credit: Literal["outcome", "token"] = flax.struct.field(pytree_node=False, default="outcome")
    judge: JudgeSpec | None = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, model: FrozenModel, *, weight: float = 1.0, normalize: str = "none", kind: str = "bt",
               step_token: int | None = None, step_aggregation: str = "min", step_discount: float = 1.0,
               credit: str = "outcome", judge: JudgeSpec | None = None) -> LearnedReward:
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize={normalize!r}; choose one of {', '.join(NORMALIZATIONS)}")
        if step_aggregation not in STEP_AGGREGATIONS:
            raise ValueError(f"step_aggregation={step_aggregation!r}; choose one of {', '.join(STEP_AGGREGATIONS)}")
        if kind == "prm" and step_token is None:
            raise ValueError("a process reward model needs the step separator's token id (step_token)")
        if (kind == "judge") != (judge is not None):
            raise ValueError("a generative judge (kind='judge') and only it takes a JudgeSpec")
        return cls(model, RunningMoments.zeros(), weight=weight, normalize=normalize, kind=kind, step_token=step_token,
                   step_aggregation=step_aggregation, step_discount=step_discount, credit=credit, judge=judge)

    def raw_scores(self, tokens_bt, attn_mask_bt) -> jax.Array:
        """`bt`: the reward model's score of each row (label 0 at its last real token), [B] f32.
        `prm`: the probability of label 1 at every position, [B, T] f32 (read at the steps)."""
        cfg, params = self.model.cfg, self.model.params
        if self.kind == "prm":
            return jax.lax.stop_gradient(jax.nn.softmax(token_scores(cfg, params, tokens_bt, attn_mask_bt), -1)[..., 1])
        return jax.lax.stop_gradient(sequence_scores(cfg, params, tokens_bt, attn_mask_bt)[:, 0])

    def steps(self, tokens_bt, loss_mask_bt) -> jax.Array:
        """Where the completion's steps end: its separator tokens, [B, T] bool."""
        return (tokens_bt == self.step_token) & (loss_mask_bt > 0)

    def aggregate_steps(self, p_bt, steps_bt) -> jax.Array:
        """One outcome score per row from its step scores: min, last, or sum_k gamma^k p_k; 0 without a step."""
        any_b = jnp.any(steps_bt, axis=-1)
        if self.step_aggregation == "min":
            out = jnp.min(jnp.where(steps_bt, p_bt, jnp.inf), axis=-1)
        elif self.step_aggregation == "last":
            t = steps_bt.shape[-1]
            last_b = jnp.max(jnp.where(steps_bt, jnp.arange(t)[None, :], 0), axis=-1)
            out = jnp.take_along_axis(p_bt, last_b[:, None], axis=-1)[:, 0]
        else:
            k_bt = jnp.cumsum(steps_bt.astype(jnp.int32), axis=-1) - 1  # each step's index k
            out = jnp.sum(jnp.where(steps_bt, p_bt * jnp.power(self.step_discount, k_bt.astype(jnp.float32)), 0.0),
                          axis=-1)
        return jnp.where(any_b, out, 0.0)

    def token_rewards(self, p_bt, steps_bt) -> jax.Array:
        """weight x each step's score on its separator token (0 elsewhere), [B, T]."""
        return self.weight * jnp.where(steps_bt, p_bt, 0.0)

    def observe(self, raw_b, valid_b) -> LearnedReward:
        """The state after a batch: its valid rows join the running moments."""
        return self.replace(moments=self.moments.add(raw_b, valid_b.astype(jnp.float32)))

    def rewards(self, raw_b, group_ids_b, valid_b) -> jax.Array:
        """weight * normalise(raw), [B] f32 (rows with valid 0 still get a value; they weigh nothing)."""
        valid = valid_b.astype(jnp.float32)
        if self.normalize == "group":
            ids = group_ids_b
            n = jax.ops.segment_sum(valid, ids, num_segments=raw_b.shape[0])
            mean = jax.ops.segment_sum(raw_b * valid, ids, num_segments=raw_b.shape[0]) / jnp.maximum(n, 1.0)
            var = jax.ops.segment_sum(jnp.square(raw_b - mean[ids]) * valid, ids,
                                      num_segments=raw_b.shape[0]) / jnp.maximum(n - 1.0, 1.0)
            norm = (raw_b - mean[ids]) / (jnp.sqrt(var[ids]) + self.eps)
        elif self.normalize == "running":
            moments = self.moments.add(raw_b, valid)
            norm = (raw_b - moments.mean) / (moments.std + self.eps)
        else:
            norm = raw_b
        return self.weight * norm


def pair_agreement(raw_b, verifier_b, group_ids_b, valid_b) -> jax.Array:
    """The share of same-group row pairs the verifier tells apart (different rewards) that the
    reward model orders the same way: 1 is a reward model that ranks as the verifier does, 0.5 a
    coin. 0 when no pair differs."""
    same = (group_ids_b[:, None] == group_ids_b[None, :]) & (valid_b[:, None] > 0) & (valid_b[None, :] > 0)
    better = same & (verifier_b[:, None] > verifier_b[None, :])
    agree = better & (raw_b[:, None] > raw_b[None, :])
    return jnp.sum(agree) / jnp.maximum(jnp.sum(better), 1)
