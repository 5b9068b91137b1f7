"""Rollout correction beyond TIS/MIS: IcePop, sequence rejection and DPPO-style masking with a KL.

The sampler and the trainer score the same tokens differently (bf16, FP8 rollouts, MoE routing),
and the ratio k_t = pi_old(y_t) / mu(y_t) of the trainer's log-prob (`old_logp_bt`, recomputed
by `prepare_batch`) to the sampler's (`behaviour_logp_bt`) measures it. Each function here has
the `OFF_POLICY` signature and returns (weight_bt, mask_bt), multiplied into the per-token loss
and the loss mask (`rljax.objectives.losses`). All log-ratios are computed where the mask is on
(padding may hold -inf) and without gradient.

    icepop      w_t = k_t if low <= k_t <= high else 0; the mask is kept, so a zeroed token stays
                in the aggregation's denominator (IcePop, Ring-1T / Ling Team, 2025). rljax's `mis`
                differs: a symmetric band [1/cap, cap], weight 1 inside, dropped from the mask.
    seq_reject  a row whose sequence ratio (the arithmetic mean of its k_t, or the geometric mean
                exp(mean log k_t)) lies outside [low, high] is rejected: its tokens leave the mask,
                the rest keep weight 1 (verl's rollout-correction rejection sampling,
                `seq_mean_k1` for the geometric mean; `docs/algo/rollout_corr.md`).
    mask_kl     w_t = 0 where k_t lies outside [low, high] (kept in the denominator), 1 inside, and
                the update adds coef * 1/2 (log pi_theta - log mu)^2 on the zeroed tokens
                (`mask_kl_tokens`), which pulls the policy back toward the sampler where the two
                diverged (DPPO-style masking, as in prime-rl's trainer loss). prime-rl adds the
                first-order tau * log(pi/mu) there; we use the second-order k2 term, whose
                gradient (log pi - log mu) grad log pi points toward mu from either side, where
                the first-order term pushes log pi down on every masked token, including those
                with pi < mu.

`level = "sequence"` uses the row's product of ratios for icepop and mask_kl (as `tis`/`mis` do);
seq_reject is sequence-level by definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives.losses import clamped_ratio, log_weights
from rljax.objectives.registry import OFF_POLICY

sg = jax.lax.stop_gradient


def _inside(log_w, low: float, high: float):
    return (log_w >= jnp.log(low)) & (log_w <= jnp.log(high))


@OFF_POLICY.register("icepop", params=("off_policy_low", "off_policy_high", "off_policy_level"))
def icepop(old_logp_bt, behaviour_logp_bt, mask_bt, *, level="token", low=0.5, high=5.0, **_):
    """IcePop (Ring-1T, 2025): w_t = k_t inside [low, high], 0 outside; the mask is unchanged."""
    log_w = log_weights(old_logp_bt, behaviour_logp_bt, mask_bt, level)
    return jnp.where(_inside(log_w, low, high), clamped_ratio(log_w), 0.0), mask_bt


def sequence_ratio(old_logp_bt, behaviour_logp_bt, mask_bt, mean: str):
    """[B, 1] per-row ratio: 'arithmetic' (1/n) sum_t k_t or 'geometric' exp((1/n) sum_t log k_t)."""
    log_k = log_weights(old_logp_bt, behaviour_logp_bt, mask_bt, "token")
    n = jnp.maximum(jnp.sum(mask_bt > 0, axis=-1, keepdims=True), 1)
    if mean == "arithmetic":
        return jnp.sum(jnp.where(mask_bt > 0, clamped_ratio(log_k), 0.0), axis=-1, keepdims=True) / n
    if mean == "geometric":
        return clamped_ratio(jnp.sum(log_k, axis=-1, keepdims=True) / n)
    raise ValueError(f"mean must be 'arithmetic' or 'geometric', got {mean!r}")


@OFF_POLICY.register("seq_reject", params=("off_policy_low", "off_policy_high", "off_policy_mean"))
def sequence_rejection(old_logp_bt, behaviour_logp_bt, mask_bt, *, low=0.5, high=2.0, mean="geometric", **_):
    """Rejects a row (its tokens leave the mask) whose sequence ratio is outside [low, high]."""
    s_b1 = sequence_ratio(old_logp_bt, behaviour_logp_bt, mask_bt, mean)
    keep = (s_b1 >= low) & (s_b1 <= high)
    return jnp.ones_like(old_logp_bt), mask_bt * keep.astype(mask_bt.dtype)


@OFF_POLICY.register("mask_kl", params=("off_policy_low", "off_policy_high", "off_policy_level",
                                        "off_policy_kl_coef"))
def mask_kl(old_logp_bt, behaviour_logp_bt, mask_bt, *, level="token", low=0.125, high=8.0, **_):
    """DPPO-style mask: w_t = 1 inside [low, high], 0 outside (kept in the mask); the KL term on
    the zeroed tokens is added by the loss (`mask_kl_tokens`, `mask_kl_penalty`)."""
    log_w = log_weights(old_logp_bt, behaviour_logp_bt, mask_bt, level)
    return _inside(log_w, low, high).astype(old_logp_bt.dtype), mask_bt


def mask_kl_tokens(weight_bt, mask_bt):
    """The tokens mask_kl zeroed (on the mask, weight 0): where its KL term applies."""
    return ((mask_bt > 0) & (weight_bt == 0)).astype(jnp.float32)


def mask_kl_penalty(logp_bt, behaviour_logp_bt, kl_tokens_bt):
    """1/2 (log pi_theta - log mu)^2 on the zeroed tokens, 0 elsewhere (k2 of pi vs the sampler)."""
    d = jnp.where(kl_tokens_bt > 0, logp_bt - sg(behaviour_logp_bt), 0.0)
    return 0.5 * jnp.square(d)
