"""Entropy control: Clip-Cov and KL-Cov policy losses, the high-entropy-token mask and the
adaptive entropy coefficient, as pure functions.

Cui et al. (2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models") show that the policy's entropy falls with the covariance between a token's log-prob and
its advantage, Cov(log pi(y_t), A_t), and that a small share of tokens with the largest
covariance drives the collapse. Their two losses act on those tokens only:

    cov_t = (A_t - mean(A)) * (sg(log pi_t) - mean(sg(log pi)))          (means over valid tokens)

- Clip-Cov: among the tokens with lb < cov_t < ub that PPO has not already clipped, a random
  ceil-free share `ratio` (at least one token: max(int(ratio N), 1)) loses its gradient; every
  other token keeps PPO's clipped surrogate.
- KL-Cov: the top max(int(ratio N), 1) tokens by cov_t get the unclipped -A_t r_t plus
  coef |log r_t|; every other token gets -A_t r_t (no clipping anywhere, as in the paper).

Both follow verl 0.9's `compute_policy_loss_clip_cov` / `_kl_cov`. The selection is split from
the loss: `clip_cov_select` / `kl_cov_select` pick the tokens over a whole mini-batch (the update
step calls them once per mini-batch, before micro-batching or packing, with the update's key),
and the losses take the chosen tokens as `select_bt`. So the scope of every mean, top-k and draw
is the mini-batch, whatever its micro-batching (verl's is each micro-batch on each device, so
verl's selection changes with `ppo_micro_batch_size`; ours does not). Called without
`select_bt`, the losses select nothing (PPO's clip and the plain -A r): a notebook can call them
on one batch by selecting first.

The ratios are not the paper's 2e-4 / 2e-3: those were set for 7B-32B models on batches of
millions of tokens, where they select hundreds of tokens; on the default job's ~3,000 tokens
2e-4 selects one (the max(., 1) floor). The defaults here (`AlgorithmConfig.cov_ratio`) select
about 1% of the tokens.

`entropy_quantile_mask` keeps the policy loss on the highest-entropy share rho of the valid
tokens only (Wang et al., 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
Effective RL for LLM Reasoning"; TRL's `top_entropy_quantile`); `adaptive_entropy_coef` moves
the entropy bonus's coefficient toward a target entropy (Skywork-OR1, He et al., 2025).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives.losses import clamped_ratio
from rljax.objectives.registry import POLICY_LOSSES

sg = jax.lax.stop_gradient


def _masked_mean(x_bt, mask_bt):
    return jnp.sum(jnp.where(mask_bt > 0, x_bt, 0.0)) / jnp.maximum(jnp.sum(mask_bt > 0), 1)


def token_covariance(logp_bt, adv_bt, mask_bt):
    """cov_t = (A_t - mean(A)) (log pi_t - mean(log pi)), means over the valid tokens of the
    arrays given (Cui et al., 2025, eq. of the centered cross-product); 0 off the mask."""
    on = mask_bt > 0
    logp_bt = sg(jnp.where(on, logp_bt, 0.0))  # padding may hold -inf
    cov = (adv_bt - _masked_mean(adv_bt, mask_bt)) * (logp_bt - _masked_mean(logp_bt, mask_bt))
    return jnp.where(on, cov, 0.0)


def selection_count(mask_bt, ratio: float):
    """max(int(ratio * N), 1) with N the valid tokens (verl's count; 0 when there are none)."""
    n = jnp.sum(mask_bt > 0)
    return jnp.where(n > 0, jnp.maximum(jnp.floor(ratio * n).astype(jnp.int32), 1), 0)


def _first_k(score_bt, eligible_bt, k):
    """The k eligible tokens with the largest score (ties broken by position), as a bool mask."""
    flat = jnp.where(eligible_bt, score_bt, -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return (rank.reshape(score_bt.shape) < k) & eligible_bt


def ppo_clipped(logp_bt, old_logp_bt, adv_bt, eps_low, eps_high):
    """Where PPO's clipped term is the larger loss (its gradient is zero there): verl's
    `clip_by_origin`, -A clip(r) > -A r."""
    r = clamped_ratio(logp_bt - old_logp_bt)
    return -adv_bt * jnp.clip(r, 1 - eps_low, 1 + eps_high) > -adv_bt * r


def clip_cov_select(logp_bt, old_logp_bt, adv_bt, mask_bt, key, *, ratio: float, lb: float, ub: float,
                    eps_low: float, eps_high: float):
    """Clip-Cov's tokens: a uniformly random min(max(int(ratio N), 1), #candidates) of the
    candidates lb < cov_t < ub, on the mask, not clipped by PPO. `key` draws them (the update's)."""
    on = mask_bt > 0
    cov = token_covariance(logp_bt, adv_bt, mask_bt)
    cand = on & (cov > lb) & (cov < ub) & ~ppo_clipped(sg(logp_bt), sg(old_logp_bt), adv_bt, eps_low, eps_high)
    return _first_k(jax.random.uniform(key, mask_bt.shape), cand, selection_count(mask_bt, ratio))


def kl_cov_select(logp_bt, adv_bt, mask_bt, *, ratio: float):
    """KL-Cov's tokens: the top max(int(ratio N), 1) valid tokens by covariance."""
    return _first_k(token_covariance(logp_bt, adv_bt, mask_bt), mask_bt > 0, selection_count(mask_bt, ratio))


def _stats(ratio_bt, clip_low, clip_high):
    f32 = jnp.float32
    return {"ratio": sg(ratio_bt), "clip_low": clip_low.astype(f32), "clip_high": clip_high.astype(f32)}


@POLICY_LOSSES.register("clip_cov", params=("clip_eps_low", "clip_eps_high", "cov_ratio", "clip_cov_lb",
                                            "clip_cov_ub"), selects=lambda lp, old, adv, m, key, algo: clip_cov_select(
                                lp, old, adv, m, key, ratio=algo.cov_ratio, lb=algo.clip_cov_lb, ub=algo.clip_cov_ub,
                                eps_low=algo.clip_eps_low, eps_high=algo.clip_eps_high))
def clip_cov(logp_bt, old_logp_bt, adv_bt, mask_bt, *, eps_low=0.2, eps_high=0.2, select_bt=None, **_):
    """Clip-Cov (Cui et al., 2025): PPO's clipped surrogate, times 0 on the selected tokens

        L_t = (1 - s_t) max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),

    s_t from `clip_cov_select` (None: none selected). A zeroed token keeps its place in the
    aggregation's denominator, as in verl. The selected tokens count as clip_low/high by the sign
    of their advantage (verl counts them in `pg_clipfrac`)."""
    r = clamped_ratio(logp_bt - sg(old_logp_bt))
    loss = jnp.maximum(-adv_bt * r, -adv_bt * jnp.clip(r, 1 - eps_low, 1 + eps_high))
    clip_low = (r < 1 - eps_low) & (adv_bt < 0)
    clip_high = (r > 1 + eps_high) & (adv_bt > 0)
    if select_bt is not None:
        s = select_bt.astype(bool)
        loss = jnp.where(s, 0.0, loss)
        clip_low, clip_high = clip_low | (s & (adv_bt < 0)), clip_high | (s & (adv_bt >= 0))
    return loss, _stats(r, clip_low, clip_high)


@POLICY_LOSSES.register("kl_cov", params=("cov_ratio", "kl_cov_coef"),
                        selects=lambda lp, old, adv, m, key, algo: kl_cov_select(lp, adv, m, ratio=algo.cov_ratio))
def kl_cov(logp_bt, old_logp_bt, adv_bt, mask_bt, *, select_bt=None, kl_cov_coef=1.0, **_):
    """KL-Cov (Cui et al., 2025): the unclipped surrogate with an |log-ratio| penalty on the
    selected tokens

        L_t = -A_t r_t + s_t coef |log pi_t - log pi_old,t|,

    s_t from `kl_cov_select` (None: none selected). No token is clipped."""
    log_r = logp_bt - sg(old_logp_bt)
    r = clamped_ratio(log_r)
    loss = -adv_bt * r
    if select_bt is not None:
        loss = loss + jnp.where(select_bt.astype(bool), kl_cov_coef * jnp.abs(log_r), 0.0)
    never = jnp.zeros_like(r, bool)
    return loss, _stats(r, never, never)


def entropy_quantile_mask(entropy_bt, mask_bt, rho: float):
    """1 on the valid tokens whose entropy is at least the (1 - rho) quantile of the VALID tokens'
    entropies (linear interpolation, as torch.quantile in TRL's `get_high_entropy_mask`), 0 else;
    rho = 1 keeps every valid token (Wang et al., 2025: rho = 0.2 in the paper)."""
    on = mask_bt > 0
    if rho >= 1.0:
        return on.astype(jnp.float32)
    thr = jnp.nanquantile(jnp.where(on, sg(entropy_bt), jnp.nan), 1.0 - rho)
    return (on & (sg(entropy_bt) >= thr)).astype(jnp.float32)


def adaptive_entropy_coef(coef, entropy, target: float, step: float):
    """Skywork-OR1's (He et al., 2025) adaptive entropy coefficient:

        c' = max(c + step, 0) if entropy < target, max(c - step, 0) if entropy > target,

    so the bonus grows while the policy's entropy is under the target and fades above it."""
    return jnp.maximum(coef + step * jnp.sign(target - entropy), 0.0).astype(jnp.float32)
