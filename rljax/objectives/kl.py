"""Per-token KL estimators between the policy pi and a reference policy (Schulman, *Approximating
KL Divergence*, 2020).

With samples from pi and log r = log ref - log pi:
    k1 = -log r = log pi - log ref                 (unbiased, high variance, can be negative)
    k2 = (log r)^2 / 2                             (biased, low variance, always >= 0)
    k3 = (r - 1) - log r                           (unbiased, low variance, always >= 0)
"""

from __future__ import annotations

import jax.numpy as jnp

from rljax.objectives.registry import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1")
def k1(logp, ref_logp):
    """k1 = log pi - log ref (Schulman, 2020)."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp, ref_logp):
    """k2 = (log pi - log ref)^2 / 2 (Schulman, 2020)."""
    return 0.5 * jnp.square(logp - ref_logp)


@KL_ESTIMATORS.register("k3")
def k3(logp, ref_logp):
    """k3 = exp(log ref - log pi) - 1 - (log ref - log pi) (Schulman, 2020; used by GRPO)."""
    log_r = ref_logp - logp
    return jnp.expm1(log_r) - log_r


def kl(logp, ref_logp, estimator: str = "k3"):
    """Per-token KL(pi || ref) estimate by name: 'k1', 'k2' or 'k3' (same shape as `logp`)."""
    return KL_ESTIMATORS.get(estimator)(logp, ref_logp)
