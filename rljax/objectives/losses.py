"""Policy losses, the clipped value loss and off-policy corrections, as per-token functions.

Every policy loss shares one signature so the update step finds it by name:

    fn(logp_bt, old_logp_bt, adv_bt, mask_bt, *, eps_low=0.2, eps_high=0.2, dual_clip=None)
        -> (loss_bt, stats)

`loss_bt` is the per-token loss to minimise (aggregate it with `aggregate`); `stats` holds
per-token `ratio`, `clip_low` and `clip_high` indicators (where clipping zeroes or caps that
token's gradient) for the metrics. Ratios are r_t = exp(logp_t - old_logp_t); old log-probs are
constants (stop-gradient).

Every ratio and importance weight is exp of a log-ratio clamped to [-LOG_RATIO_CLAMP,
LOG_RATIO_CLAMP] (20, verl's value; `clamped_ratio`). Unclamped, a log-ratio above ~88 overflows
float32 to inf, and inf * 0 on a masked or clipped token turns the whole gradient into NaN. Where
the clamp binds, the token's gradient through the ratio is zero, as in verl (the token is e^20
times more or less likely than when it was sampled, far outside any clip range).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives.registry import OFF_POLICY, POLICY_LOSSES

sg = jax.lax.stop_gradient

LOG_RATIO_CLAMP = 20.0


def clamped_ratio(log_ratio):
    """exp(clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)): a ratio that never overflows."""
    return jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _ratio(logp_bt, old_logp_bt):
    return clamped_ratio(logp_bt - sg(old_logp_bt))


def _stats(ratio_bt, clip_low_bt, clip_high_bt):
    f32 = jnp.float32
    return {"ratio": sg(ratio_bt), "clip_low": clip_low_bt.astype(f32), "clip_high": clip_high_bt.astype(f32)}


@POLICY_LOSSES.register("ppo_clip", params=("clip_eps_low", "clip_eps_high", "dual_clip"))
def ppo_clip(logp_bt, old_logp_bt, adv_bt, mask_bt, *, eps_low=0.2, eps_high=0.2, dual_clip=None, **_):
    """PPO clipped surrogate (Schulman et al., 2017) with an asymmetric range (DAPO's clip-higher, 2025):

        L_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

    and optional dual clip (Ye et al., 2020): for A_t < 0, L_t = min(L_t, -c A_t) with c > 1.
    clip_low: r_t < 1 - eps_low and A_t < 0; clip_high: r_t > 1 + eps_high and A_t > 0.
    """
    ratio = _ratio(logp_bt, old_logp_bt)
    loss = jnp.maximum(-adv_bt * ratio, -adv_bt * jnp.clip(ratio, 1 - eps_low, 1 + eps_high))
    clip_low = (ratio < 1 - eps_low) & (adv_bt < 0)
    clip_high = (ratio > 1 + eps_high) & (adv_bt > 0)
    if dual_clip is not None:
        dual = (adv_bt < 0) & (loss > -dual_clip * adv_bt)
        loss = jnp.where(dual, -dual_clip * adv_bt, loss)
        clip_low = clip_low | dual
    return loss, _stats(ratio, clip_low, clip_high)


@POLICY_LOSSES.register("pg")
def policy_gradient(logp_bt, old_logp_bt, adv_bt, mask_bt, **_):
    """Unclipped importance-weighted policy gradient L_t = -r_t A_t (REINFORCE, Williams 1992);
    at r_t = 1 its gradient is -A_t grad log pi."""
    ratio = _ratio(logp_bt, old_logp_bt)
    never = jnp.zeros_like(ratio, bool)
    return -adv_bt * ratio, _stats(ratio, never, never)


@POLICY_LOSSES.register("gspo", params=("clip_eps_low", "clip_eps_high"))
def gspo(logp_bt, old_logp_bt, adv_bt, mask_bt, *, eps_low=3e-4, eps_high=4e-4, **_):
    """GSPO (Zheng et al., 2025): a sequence-level, length-normalised ratio

        s_i = exp((1/|y_i|) sum_t (logp_t - old_logp_t)),
        L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),

    applied per token in the GSPO-token form s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)): its value
    is s_i and its gradient s_i grad log pi_t, so under seq-mean-token-mean aggregation the token
    form equals the sequence form. A_i is the row's advantage (constant over its tokens).
    log s_i is clamped to +-LOG_RATIO_CLAMP (verl clamps GSPO's log-ratio above at 10).
    """
    m = mask_bt.astype(logp_bt.dtype)
    n_b = jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1.0)
    log_r_bt = jnp.where(m > 0, logp_bt - sg(old_logp_bt), 0.0)  # padding may hold -inf
    log_s_b1 = jnp.sum(log_r_bt, axis=-1, keepdims=True) / n_b
    s_bt = clamped_ratio(sg(log_s_b1) + logp_bt - sg(logp_bt))
    loss = jnp.maximum(-adv_bt * s_bt, -adv_bt * jnp.clip(s_bt, 1 - eps_low, 1 + eps_high))
    clip_low = (s_bt < 1 - eps_low) & (adv_bt < 0)
    clip_high = (s_bt > 1 + eps_high) & (adv_bt > 0)
    return loss, _stats(s_bt, clip_low, clip_high)


@POLICY_LOSSES.register("cispo", params=("clip_eps_low", "clip_eps_high"))
def cispo(logp_bt, old_logp_bt, adv_bt, mask_bt, *, eps_low=1.0, eps_high=0.28, **_):
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight

        L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi_t,

    so every token keeps a gradient (clipping bounds its weight instead of dropping it).
    """
    ratio = _ratio(logp_bt, old_logp_bt)
    weight = sg(jnp.clip(ratio, 1 - eps_low, 1 + eps_high))
    loss = -weight * adv_bt * logp_bt
    return loss, _stats(ratio, ratio < 1 - eps_low, ratio > 1 + eps_high)


@POLICY_LOSSES.register("topr")
def topr(logp_bt, old_logp_bt, adv_bt, mask_bt, **_):
    """TOPR, tapered off-policy REINFORCE (Le Roux et al., 2025):

        L_t = -A_t log pi_t                              if A_t >= 0 (SFT-like, no ratio)
        L_t = -sg(clip(r_t, 0, 1)) A_t log pi_t          if A_t < 0 (truncated importance weight)

    clip_low marks negative tokens whose weight is truncated (r_t > 1).
    """
    ratio = _ratio(logp_bt, old_logp_bt)
    weight = jnp.where(adv_bt >= 0, 1.0, sg(jnp.minimum(ratio, 1.0)))
    never = jnp.zeros_like(ratio, bool)
    return -weight * adv_bt * logp_bt, _stats(ratio, (adv_bt < 0) & (ratio > 1.0), never)


def value_loss(values_bt, old_values_bt, returns_bt, clip_eps: float | None = 0.2):
    """Clipped value loss (PPO, Schulman et al. 2017; as in OpenAI baselines), per token:

        v_clip = v_old + clip(v - v_old, -eps, eps)
        L_t = 1/2 max((v - R)^2, (v_clip - R)^2)     (1/2 (v - R)^2 without clipping)
    """
    unclipped = jnp.square(values_bt - returns_bt)
    if clip_eps is None:
        return 0.5 * unclipped
    v_clip = old_values_bt + jnp.clip(values_bt - old_values_bt, -clip_eps, clip_eps)
    return 0.5 * jnp.maximum(unclipped, jnp.square(v_clip - returns_bt))


# ----------------------------------------------------------------------------- off-policy correction
# Inputs: log-probs of the trainer's old policy (`old_logp_bt`) and of the policy that actually
# drew the samples (`behaviour_logp_bt`: an older snapshot in async training, or another engine).
# Output: (weight_bt, mask_bt) to multiply into the per-token loss and the loss mask.
# The weight is exp of a log-weight clamped by `clamped_ratio` (after the sequence sum, as verl's
# rollout correction does), so an uncapped TIS cannot overflow. MIS compares the unclamped
# log-weight with log(cap) and exponentiates nothing: clamping there would only let a ratio of
# e^100 pass a cap above e^20.


def log_weights(old_logp_bt, behaviour_logp_bt, mask_bt, level):
    """sg(log pi_old - log mu) per token (0 off the mask), or its row sum at level 'sequence'."""
    # where, not a product: padding may hold -inf log-probs, and -inf * 0 is NaN
    log_w = jnp.where(mask_bt > 0, old_logp_bt - behaviour_logp_bt, 0.0)
    if level == "sequence":
        log_w = jnp.broadcast_to(jnp.sum(log_w, axis=-1, keepdims=True), log_w.shape)
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    return sg(log_w)


@OFF_POLICY.register("none")
def no_correction(old_logp_bt, behaviour_logp_bt, mask_bt, *, cap=2.0, level="token", **_):
    """No correction: weight 1 everywhere (on-policy samples, or a trusted sampler)."""
    return jnp.ones_like(old_logp_bt), mask_bt


@OFF_POLICY.register("tis", params=("off_policy_cap", "off_policy_level"))
def truncated_is(old_logp_bt, behaviour_logp_bt, mask_bt, *, cap=2.0, level="token", **_):
    """Truncated importance sampling: w = min(pi_old / mu, cap), per token or per sequence
    (w = prod_t ratio_t) (Ionides, 2008; as used for sampler/trainer mismatch by verl and TRL)."""
    log_w = log_weights(old_logp_bt, behaviour_logp_bt, mask_bt, level)
    w = clamped_ratio(jnp.minimum(log_w, jnp.log(cap)))
    return w, mask_bt


@OFF_POLICY.register("mis", params=("off_policy_cap", "off_policy_level"))
def masked_is(old_logp_bt, behaviour_logp_bt, mask_bt, *, cap=2.0, level="token", **_):
    """Masked importance sampling: drop tokens (or whole sequences) whose ratio pi_old / mu lies
    outside [1/cap, cap]; the rest keep weight 1."""
    log_w = log_weights(old_logp_bt, behaviour_logp_bt, mask_bt, level)
    keep = jnp.abs(log_w) <= jnp.log(cap)
    return jnp.ones_like(old_logp_bt), mask_bt * keep.astype(mask_bt.dtype)


@OFF_POLICY.register("decoupled", params=("off_policy_cap", "off_policy_level"))
def decoupled_ppo(old_logp_bt, behaviour_logp_bt, mask_bt, *, cap=2.0, level="token", **_):
    """AReaL's decoupled PPO (Fu et al., 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
    Learning System for Language Reasoning"), as the weight of the clipped surrogate:

        J(theta) = E_mu[ w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) ],
        w_t = pi_prox / mu,    r_t = pi_theta / pi_prox,

    mu the behaviour policy (the sampler's recorded per-token log-probs, possibly from several
    policy versions within one row) and pi_prox the proximal policy: the params at the start of
    this update, which `prepare_batch` scores as `old_logp_bt` under `recompute_old_logp`. Paired
    with `policy_loss='ppo_clip'`, whose ratio already divides by `old_logp_bt` = pi_prox, this
    weight completes the objective. The trust region is kept around pi_prox, a policy the trainer
    holds, rather than around mu, which may be several versions stale: the decoupling is what lets
    AReaL train on stale and interrupted rollouts without shrinking its updates.

    Large weights follow AReaL's `ppo_actor_loss_fn` (`behav_imp_weight_cap`): a token whose
    w_t exceeds `cap` gets weight 0 but keeps its place in the loss mask, so it still counts in
    the aggregation's denominator (unlike MIS, which drops it from the mask, and TIS, which keeps
    it at weight `cap`). We follow AReaL so that a run reproduces its objective exactly, and
    because a zeroed token cannot enlarge the step the way a truncated one would. There is no
    lower cap, as in AReaL: a small w_t only shrinks a token's gradient. `cap = inf` means
    uncapped (AReaL's None). `level='sequence'` uses the row's product of ratios (AReaL's is per
    token). With mu = pi_prox the weight is exactly 1 and the loss is PPO's clipped surrogate.
    """
    log_w = log_weights(old_logp_bt, behaviour_logp_bt, mask_bt, level)
    w = jnp.where(log_w <= jnp.log(cap), clamped_ratio(log_w), 0.0)
    return w, mask_bt
