"""The rollout -> update contract: what a rollout hands the update step, and what the update step
derives from it before any gradient is taken.

    RolloutBatch   (from a sampler, a replay buffer, or a notebook)
        --prepare_batch(state, batch)-->  PreparedBatch + metrics
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

from rljax.errors import ConfigError
from rljax.models import token_logprobs, values
from rljax.models.scoring import teacher_scores
from rljax.objectives.advantages import (scale_negative_advantages, takes_turn_returns, whiten_advantages,
                                         zero_variance_groups)
from rljax.objectives.kl import kl
from rljax.objectives.registry import ADVANTAGES, DISTILLATION, OFF_POLICY
from rljax.rewards.judge import judge_rows, parse_verdicts
from rljax.rewards.learned import pair_agreement
from rljax.sampling import SampleControls, sample

sg = jax.lax.stop_gradient


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
    multi-turn rollout with `env.credit = "turn"`, for an estimator that takes it
    (`rljax.objectives.advantages.takes_turn_returns`); None: one reward per row.
    verifier_rewards_b: the verifier's unweighted correctness part (the composer's `correct`),
    which a learned reward's agreement metric compares with (None: `rewards_b` serves).
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
    are updated from them).
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


def state_values(cfg, value_params, tokens_bt, attn_mask_bt, *, remat: bool = False, unroll: bool = False):
    """V(state before token t): the value head on the hidden state at t - 1 (column 0 is 0)."""
    v_bt = values(cfg, value_params, tokens_bt, attn_mask_bt, remat=remat, unroll=unroll)
    return jnp.concatenate([jnp.zeros_like(v_bt[:, :1]), v_bt[:, :-1]], axis=1)


def _chunked(fn, chunks: int, *arrays):
    """fn over `chunks` row blocks with lax.map (bounded memory for no-grad scoring passes)."""
    if chunks == 1:
        return fn(*arrays)
    split = [a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:]) for a in arrays]
    out = jax.lax.map(lambda xs: fn(*xs), tuple(split))
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)


# Needs the rollout itself must provide, by the `RolloutBatch` field that carries each (values
# and reference log-probs are scored by `prepare_batch` from the train state instead).
ROLLOUT_FIELDS = {"greedy_baseline": "baseline_rewards_b"}


def _check_provides(algo, shaping, batch: RolloutBatch) -> None:
    for need, field in ROLLOUT_FIELDS.items():
        if getattr(algo.needs, need) and getattr(batch, field) is None:
            raise ConfigError(f"advantage={algo.advantage!r} declares the need {need!r}, but batch.{field} is None: "
                              "build the batch with rljax.train.rollout (it reads state.algo.needs)")
    if batch.turn_returns is not None and not takes_turn_returns(algo.advantage):
        raise ConfigError(f"env.credit='turn' needs an advantage that takes turn returns (grpo, dr_grpo), not "
                          f"algorithm.advantage={algo.advantage!r}; change the algorithm or set env.credit='episode'")
    if batch.turn_returns is not None and shaping.active:
        raise ConfigError("env.credit='turn' reads per-turn returns, which the [shaping] length terms do not reach; "
                          "remove [shaping] or set env.credit='episode'")


def _masked_mean(x_b, weight_b):
    return jnp.sum(x_b * weight_b) / jnp.maximum(jnp.sum(weight_b), 1.0)


def logp_mismatch(trainer_logp_bt, sampler_logp_bt, mask_bt) -> dict[str, jax.Array]:
    """|trainer log-prob - sampler log-prob| over the completion tokens, for the same params: the
    sampler/trainer numerics gap that a PPO ratio starts from, as `rollout/logp_diff_mean` and
    `rollout/logp_diff_max` (nats). `prepare_batch` reports it over every row when it recomputes
    the old log-probs; otherwise `update` reports it from the first mini-batch's forward."""
    m = mask_bt.astype(bool)
    diff = jnp.abs(trainer_logp_bt.astype(jnp.float32) - sampler_logp_bt.astype(jnp.float32))
    return {"rollout/logp_diff_mean": jnp.sum(jnp.where(m, diff, 0.0)) / jnp.maximum(jnp.sum(m), 1),
            "rollout/logp_diff_max": jnp.max(jnp.where(m, diff, 0.0))}


def prepare_batch(state, batch: RolloutBatch) -> tuple[PreparedBatch, dict[str, jax.Array]]:
    """Shaped rewards, old/reference log-probs, old values, advantages and off-policy weights.

    `state` is a `rljax.update.TrainState`. Traceable; `update_step` calls it inside its program.
    Metrics (`train/...`) cover the rows the loss sees (non-empty loss masks), after shaping.
    """
    cfg, algo, schedule = state.model_cfg, state.algo, state.update_cfg
    _check_provides(algo, state.shaping, batch)
    needs = algo.needs
    f32 = jnp.float32
    mask = batch.loss_mask_bt.astype(f32)
    lengths_b = jnp.sum(mask, axis=-1)
    trained_b = (lengths_b > 0).astype(f32)
    chunks = schedule.chunks
    toks, attn = batch.tokens_bt, batch.attn_mask_bt
    metrics: dict[str, jax.Array] = {}
    rewards_in, rm_scores, rm_token_rewards = batch.rewards_b.astype(f32), None, None
    if state.reward_model is not None:  # a learned reward, scored here: no host round trip
        rm_scores, term_b, rm_token_rewards, rm_metrics = _learned_reward(state.reward_model, batch, mask, trained_b,
                                                                          chunks)
        metrics.update(rm_metrics)
        rewards_in = rewards_in + term_b
    rewards_b = state.shaping.apply(rewards_in, lengths_b, batch.completion_len)

    lp_chunks = schedule.chunk_for(toks.shape[0] // chunks, toks.shape[1], cfg.vocab_size)

    def score(params):
        return sg(_chunked(lambda t, a: token_logprobs(cfg, params, t, a, chunk_size=lp_chunks.time,
                                                       vocab_chunk=lp_chunks.vocab)[0], chunks, toks, attn))

    policy, critic = state.models()  # no LoRA dropout: these are the policy's own log-probs
    sampler_logp = batch.sampler_logp_bt.astype(f32)
    old_logp, is_w = sampler_logp, jnp.ones_like(mask)
    if algo.recompute_old_logp:
        trainer_logp = score(policy)
        is_w, kept = OFF_POLICY.get(algo.off_policy)(trainer_logp, sampler_logp, mask, cap=algo.off_policy_cap,
                                                    level=algo.off_policy_level)
        metrics.update(logp_mismatch(trainer_logp, sampler_logp, mask))
        metrics["train/is_weight_mean"] = jnp.sum(is_w * kept) / jnp.maximum(jnp.sum(kept), 1.0)
        metrics["train/is_dropped_frac"] = 1.0 - jnp.sum(kept) / jnp.maximum(jnp.sum(mask), 1.0)
        old_logp, mask = trainer_logp, kept
    ref_logp, token_rewards = None, rm_token_rewards
    if needs.reference_logp:
        ref_logp = score(state.reference_params)
        if algo.kl_in_reward:
            kl_rewards = -algo.kl_coef * kl(old_logp, ref_logp, algo.kl_estimator, clamp=algo.kl_clamp) * mask
            token_rewards = kl_rewards if token_rewards is None else token_rewards + kl_rewards
    old_values = None
    if needs.values:
        old_values = batch.old_values_bt
        if old_values is None:
            old_values = _chunked(lambda t, a: state_values(cfg, critic, t, a), chunks, toks, attn)
        old_values = sg(old_values.astype(f32))
    turns = {} if batch.turn_returns is None else dict(turn_bt=batch.turn_returns.turn_bt,
                                                       turn_returns_bk=batch.turn_returns.returns_bk)
    adv = ADVANTAGES.get(algo.advantage)(
        rewards_b, batch.group_ids_b, mask, token_rewards_bt=token_rewards, baseline_b=batch.baseline_rewards_b,
        values_bt=old_values, gamma=algo.gamma, lam=algo.lam, std_normalize=algo.std_normalize, eps=algo.eps,
        **turns)
    returns = None if old_values is None else sg(adv + old_values)  # value targets from raw advantages
    teacher_hidden = None
    if needs.teacher_logp:
        teacher_logp, teacher_hidden, distill_metrics = _teacher_grades(state, toks, attn, old_logp, mask, chunks)
        metrics.update(distill_metrics)
        objective = DISTILLATION.get(algo.distill)
        if objective.kind == "advantage":
            adv = algo.reward_weight * adv + algo.distill_coef * objective.fn(old_logp, teacher_logp, mask,
                                                                             discount=algo.distill_discount)
        else:
            adv = algo.reward_weight * adv
    if algo.whiten_advantages:
        adv = whiten_advantages(adv, mask)
    if algo.negative_advantage_scale != 1.0:
        adv = scale_negative_advantages(adv, algo.negative_advantage_scale)
    adv = sg(adv)

    n = jnp.maximum(jnp.sum(mask), 1.0)
    adv_mean = jnp.sum(adv * mask) / n
    metrics.update({
        "train/reward_mean": _masked_mean(rewards_b, trained_b),
        "train/reward_raw_mean": _masked_mean(batch.rewards_b.astype(f32), trained_b),
        "train/length_mean": _masked_mean(lengths_b, trained_b),
        "train/rows": jnp.sum(trained_b),
        "adv/mean": adv_mean, "adv/std": jnp.sqrt(jnp.sum(jnp.square(adv - adv_mean) * mask) / n),
        "adv/max": jnp.max(jnp.where(mask > 0, adv, -jnp.inf)),
        "adv/min": jnp.min(jnp.where(mask > 0, adv, jnp.inf)),
        "train/zero_variance_groups": zero_variance_groups(batch.rewards_b.astype(f32), batch.group_ids_b),
    })
    prepared = PreparedBatch(tokens_bt=toks, attn_mask_bt=attn, loss_mask_bt=mask, old_logp_bt=old_logp,
                             is_weight_bt=is_w, advantages_bt=adv, ref_logp_bt=ref_logp,
                             old_values_bt=old_values, returns_bt=returns, teacher_hidden_btd=teacher_hidden,
                             reward_model_scores_b=rm_scores)
    return prepared, metrics


def _learned_reward(rm, batch: RolloutBatch, mask, trained_b, chunks: int):
    """(raw outcome scores [B], the weighted, normalised outcome term [B] added to the rewards,
    token-level rewards [B, T] or None, metrics) of a learned reward (`rljax.rewards.learned`): a
    Bradley-Terry model's score, a generative judge's parsed verdict, or a PRM's step scores
    aggregated into one per row (`credit = "outcome"`) or laid on the step tokens
    (`credit = "token"`, the outcome term 0)."""
    token_rewards, metrics = None, {}
    if rm.kind == "judge":
        scores_b, parsed_b = _judge(rm, batch)
        metrics["reward_model/judge_unparsed"] = jnp.sum(~parsed_b & (trained_b > 0))
    elif rm.kind == "prm":
        raw = _chunked(rm.raw_scores, chunks, batch.tokens_bt, batch.attn_mask_bt)
        steps_bt = rm.steps(batch.tokens_bt, mask)
        scores_b = rm.aggregate_steps(raw, steps_bt)
        metrics["reward_model/steps_mean"] = _masked_mean(jnp.sum(steps_bt, -1).astype(jnp.float32), trained_b)
        if rm.credit == "token":
            token_rewards = rm.token_rewards(raw, steps_bt) * mask
    else:
        scores_b = _chunked(rm.raw_scores, chunks, batch.tokens_bt, batch.attn_mask_bt)
    term_b = rm.rewards(scores_b, batch.group_ids_b, trained_b) if token_rewards is None else jnp.zeros_like(scores_b)
    metrics.update({"reward_model/score_mean": _masked_mean(scores_b, trained_b),
                    "reward_model/reward_mean": _masked_mean(term_b, trained_b),
                    "reward_model/pair_agreement": pair_agreement(
                        scores_b, batch.rewards_b if batch.verifier_rewards_b is None else batch.verifier_rewards_b,
                        batch.group_ids_b, trained_b)})
    return scores_b, term_b, token_rewards, metrics


def _judge(rm, batch: RolloutBatch):
    """A generative judge's (scores [B], parsed [B]): its template around each row's prompt and
    completion, a greedy decode of `max_tokens` with the sampler, the verdict parsed."""
    spec, c = rm.judge, batch.completion_len
    p = batch.tokens_bt.shape[1] - c
    toks, attn = batch.tokens_bt, batch.attn_mask_bt
    rows, rows_mask = judge_rows(toks[:, :p], attn[:, :p], toks[:, p:], attn[:, p:], prefix=spec.prefix,
                                 middle=spec.middle, suffix=spec.suffix, pad_id=spec.pad_id, drop_ids=spec.eos_ids)
    controls = SampleControls(max_new_tokens=spec.max_tokens, num_samples=1, greedy=True, eos_ids=spec.eos_ids,
                              pad_id=spec.pad_id)
    out = sample(rm.model.cfg, rm.model.params, rows, rows_mask, jax.random.key(0), controls)
    return parse_verdicts(out.tokens, out.mask, spec.verdicts, spec.default)


def _teacher_grades(state, toks, attn, student_logp, mask, chunks: int):
    """The teacher's log-probs of the sampled tokens (in row blocks, through the trainer's chunked
    vocabulary projection), its final hidden states when the objective reads its whole
    distribution, and the `distill/...` metrics over the completion tokens: the sampled reverse
    KL log pi_S - log pi_T, the teacher's mean log-prob, and the share of tokens that are the
    teacher's top-1."""
    teacher = state.teacher
    if teacher is None:
        raise ConfigError(f"algorithm.distill={state.algo.distill!r} needs a teacher in the train state: set "
                          "teacher.checkpoint (init_train_state(..., teacher=...))")
    tcfg = teacher.cfg
    keep_hidden = state.algo.needs.teacher_hidden
    lp_chunks = state.update_cfg.chunk_for(toks.shape[0] // chunks, toks.shape[1], tcfg.vocab_size)
    graded = _chunked(lambda t, a: teacher_scores(tcfg, teacher.params, t, a, chunk_size=lp_chunks.time,
                                                  vocab_chunk=lp_chunks.vocab, return_hidden=keep_hidden),
                      chunks, toks, attn)
    teacher_logp, top1 = sg(graded[0]), graded[1]
    on = mask > 0
    n = jnp.maximum(jnp.sum(mask), 1.0)
    metrics = {"distill/reverse_kl": jnp.sum(jnp.where(on, student_logp - teacher_logp, 0.0)) / n,
               "distill/teacher_logp": jnp.sum(jnp.where(on, teacher_logp, 0.0)) / n,
               "distill/teacher_top1_match": jnp.sum(on & top1) / n}
    return teacher_logp, (graded[2] if keep_hidden else None), metrics


def rows(tree: Any, n: int):
    """Splits every [B, ...] leaf into [n, B // n, ...] (mini- or micro-batches)."""
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), tree)
