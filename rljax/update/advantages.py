"""`prepare_batch`: what the update step derives from a rollout before any gradient is taken.

    RolloutBatch  --prepare_batch(state, batch)-->  PreparedBatch + metrics

Once per update and without gradients (traceable; `update_step` calls it inside its program):
a learned reward's score joined to the verifier's rewards, reward shaping, the old (sampler's,
or the trainer's own with `recompute_old_logp`) and reference log-probs, the off-policy weights,
the old values, the advantages (the `algorithm.advantage` estimator, then a distillation term,
whitening and negative-advantage scaling) and the value targets. The typed batches it reads and
returns live in `rljax.update.batch`; what it needs of a batch comes from the registry entries'
declarations (`AlgorithmConfig.needs`, `check_turn_credit`), and a batch that lacks a needed
field, or carries turn returns the objective cannot use, fails here with one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.errors import ConfigError
from rljax.models import token_logprobs
from rljax.models.scoring import teacher_scores
from rljax.objectives.advantages import scale_negative_advantages, whiten_advantages, zero_variance_groups
from rljax.objectives.config import check_turn_credit
from rljax.objectives.difficulty import CORRECT_AT, curriculum_terms
from rljax.objectives.kl import kl
from rljax.objectives.registry import ADVANTAGES, DISTILLATION, OFF_POLICY
from rljax.objectives.rollout_correction import mask_kl_tokens
from rljax.rewards.judge import judge_rows, parse_verdicts
from rljax.rewards.learned import pair_agreement
from rljax.sampling import SampleControls, sample
from rljax.update.batch import ROLLOUT_FIELDS, PreparedBatch, RolloutBatch, replayed_routes, state_values
from rljax.update.vision import check_vision_update

sg = jax.lax.stop_gradient


def _chunked(fn, chunks: int, *arrays):
    """fn over `chunks` row blocks with lax.map (bounded memory for no-grad scoring passes);
    `arrays` are [B, ...] arrays or pytrees of them."""
    if chunks == 1:
        return fn(*arrays)
    split = jax.tree.map(lambda a: a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:]), tuple(arrays))
    out = jax.lax.map(lambda xs: fn(*xs), split)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)


def _check_provides(algo, shaping, reward_model, batch: RolloutBatch) -> None:
    """One-line ConfigErrors for a batch that lacks a field the objective declares it needs (a
    routing record under routing replay too), or carries turn returns it cannot use
    (`check_turn_credit`, the loader's check too)."""
    needs = algo.needs
    for need, field in ROLLOUT_FIELDS.items():
        if getattr(algo.needs, need) and getattr(batch, field) is None:
            raise ConfigError(f"advantage={algo.advantage!r} declares the need {need!r}, but batch.{field} is None: "
                              "build the batch with rljax.train.rollout (it reads state.algo.needs)")
    if needs.routes and batch.routes_btlk is None:
        raise ConfigError("algorithm.routing_replay='rollout' replays the sampler's routing record, but "
                          "batch.routes_btlk is None: build the batch with rljax.stages.rollout (it records the "
                          "routes), or set algorithm.routing_replay='off'")
    if batch.turn_returns is not None:  # a PRM with token credit adds per-token rewards (`_learned_reward`)
        prm_tokens = reward_model is not None and reward_model.kind == "prm" and reward_model.credit == "token"
        check_turn_credit(algo, shaping, token_rewards=prm_tokens)


def _masked_mean(x_b, weight_b):
    return jnp.sum(x_b * weight_b) / jnp.maximum(jnp.sum(weight_b), 1.0)


def logp_mismatch(trainer_logp_bt, sampler_logp_bt, mask_bt) -> dict[str, jax.Array]:
    """|trainer log-prob - sampler log-prob| over the completion tokens, for the same params: the
    sampler/trainer numerics gap that a PPO ratio starts from, as `update/logp_diff_mean` and
    `update/logp_diff_max` (nats; `update/`: the update measures it, on the rows it trains on).
    `prepare_batch` reports it over every row when it recomputes the old log-probs; otherwise
    `update` reports it from the first mini-batch's forward."""
    m = mask_bt.astype(bool)
    diff = jnp.abs(trainer_logp_bt.astype(jnp.float32) - sampler_logp_bt.astype(jnp.float32))
    return {"update/logp_diff_mean": jnp.sum(jnp.where(m, diff, 0.0)) / jnp.maximum(jnp.sum(m), 1),
            "update/logp_diff_max": jnp.max(jnp.where(m, diff, 0.0))}


def prepare_batch(state, batch: RolloutBatch) -> tuple[PreparedBatch, dict[str, jax.Array]]:
    """Shaped rewards, old/reference log-probs, old values, advantages and off-policy weights.

    `state` is a `rljax.update.TrainState`. Traceable; `update_step` calls it inside its program.
    Metrics (`train/...`) cover the rows the loss sees (non-empty loss masks), after shaping.
    """
    cfg, algo, schedule = state.model_cfg, state.algo, state.update_cfg
    _check_provides(algo, state.shaping, state.reward_model, batch)
    if batch.vision is not None:
        check_vision_update(state)
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
    curriculum = None
    if state.shaping.curriculum:  # VL-Cogito's ODSW weights and DyLR term (rljax.objectives.difficulty)
        verifier_b = batch.rewards_b if batch.verifier_rewards_b is None else batch.verifier_rewards_b
        iteration = state.step // (schedule.num_epochs * schedule.num_minibatches)
        curriculum = curriculum_terms(state.shaping, verifier_b >= CORRECT_AT, lengths_b, batch.group_ids_b,
                                      trained_b, batch.completion_len, iteration)
        rewards_b = rewards_b + curriculum.length_reward_b
        metrics.update(curriculum.metrics)

    lp_chunks = schedule.chunk_for(toks.shape[0] // chunks, toks.shape[1], cfg.vocab_size)

    # Routing replay: every forward of these tokens computes each one with the sampler's experts
    routes = batch.routes_btlk if needs.routes else None
    check_routing_replay(cfg, algo)
    rows_in = (toks, attn) if routes is None else (toks, attn, routes)

    def score(params):
        if batch.vision is not None:  # image rows: each block's images spliced into `params`
            def with_images(t, a, v):
                lm, rope = v.splice(params)
                return token_logprobs(cfg, lm, t, a, chunk_size=lp_chunks.time, vocab_chunk=lp_chunks.vocab,
                                      **rope)[0]

            return sg(_chunked(with_images, chunks, toks, attn, batch.vision))
        return sg(_chunked(lambda t, a, *r: token_logprobs(cfg, params, t, a, chunk_size=lp_chunks.time,
                                                           vocab_chunk=lp_chunks.vocab,
                                                           routes_lbtk=replayed_routes(*r) if r else None)[0],
                           chunks, *rows_in))

    policy, critic = state.models()  # no LoRA dropout: these are the policy's own log-probs
    sampler_logp = batch.sampler_logp_bt.astype(f32)
    correction_kl = None
    old_logp, is_w = sampler_logp, jnp.ones_like(mask)
    if algo.recompute_old_logp:
        trainer_logp = score(policy)
        is_w, kept = OFF_POLICY.get(algo.off_policy)(trainer_logp, sampler_logp, mask, **algo.off_policy_kwargs)
        metrics.update(logp_mismatch(trainer_logp, sampler_logp, mask))
        metrics["train/is_weight_mean"] = jnp.sum(is_w * kept) / jnp.maximum(jnp.sum(kept), 1.0)
        metrics["train/is_dropped_frac"] = 1.0 - jnp.sum(kept) / jnp.maximum(jnp.sum(mask), 1.0)
        if algo.off_policy != "none":  # zeroed in place (IcePop, mask_kl) and whole rows rejected
            metrics.update(correction_shares(is_w, mask, kept))
        if algo.off_policy_kl:
            correction_kl = mask_kl_tokens(is_w, kept)
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
    if curriculum is not None:  # ODSW: A_i <- F(Acc) * A_i, per prompt (1 when its stages are off)
        adv = adv * curriculum.weight_b[:, None]
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
                             reward_model_scores_b=rm_scores,
                             behaviour_logp_bt=None if correction_kl is None else sampler_logp,
                             correction_kl_bt=correction_kl, routes_btlk=routes, vision=batch.vision)
    return prepared, metrics


def check_routing_replay(cfg, algo) -> None:
    """One line for `algorithm.routing_replay = "rollout"` on a model with no MoE layers."""
    if algo.routing_replay != "off" and cfg.moe is None:
        raise ConfigError(f"algorithm.routing_replay={algo.routing_replay!r} replays an MoE router's expert choices, "
                          "but the policy is a dense model: set algorithm.routing_replay='off'")


def correction_shares(weight_bt, mask_bt, kept_bt) -> dict[str, jax.Array]:
    """What a rollout correction removed, over the completion tokens before it: `train/is_zeroed_frac`,
    the tokens kept in the mask at weight 0 (IcePop, mask_kl, decoupled's cap), and
    `train/is_rejected_rows`, the share of rows with tokens that lost all of them (seq_reject, MIS)."""
    n = jnp.maximum(jnp.sum(mask_bt), 1.0)
    had_b = jnp.sum(mask_bt, -1) > 0
    lost_b = had_b & (jnp.sum(kept_bt, -1) == 0)
    return {"train/is_zeroed_frac": jnp.sum(jnp.where(kept_bt > 0, weight_bt == 0, False)) / n,
            "train/is_rejected_rows": jnp.sum(lost_b) / jnp.maximum(jnp.sum(had_b), 1)}


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
