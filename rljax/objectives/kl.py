"""Per-token KL estimators between the policy pi and a reference policy (Schulman, *Approximating
KL Divergence*, 2020).

With samples from pi and log r = log ref - log pi:
    k1  = -log r = log pi - log ref                (unbiased, high variance, can be negative)
    k2  = (log r)^2 / 2                            (biased, low variance, always >= 0)
    k3  = (r - 1) - log r                          (unbiased, low variance, always >= 0)
    abs = |log r|                                  (verl's "abs"; a penalty, not an estimate)
    k3+ = k2 + sg(k3 - k2)                         (k3's value, k2's gradient; verl's "k3+")

As a loss on samples of pi, k2's gradient (log pi - log ref) grad log pi has expectation
grad KL(pi || ref), while k3's, (1 - r) grad log pi, has expectation grad KL(ref || pi), the
reverse KL, and grows like ref/pi where pi << ref. k3+ keeps k3's value (for the metric and the
penalty's size) and takes k2's gradient. `kl(..., clamp=c)` clips any estimate to [-c, c] (verl
clamps k3 to +-10); where the clamp binds, the gradient is zero, except for k3+, whose clamp bounds
its value only: k2 + sg(clip(k3, -c, c) - k2) keeps k2's gradient on clamped tokens, as verl
0.9.1's `kl_penalty` does (it clamps the forward k3 and adds k2's straight-through gradient
after). Clamping the whole straight-through sum instead would zero the gradient exactly on the
tokens furthest from the reference, the ones the penalty exists for. k3 takes exp of log r clamped to
+-LOG_RATIO_CLAMP (20, as verl does), so it never overflows to inf, whose gradient through a
clamp or a mask would be NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives.losses import LOG_RATIO_CLAMP
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
    """k3 = exp(log ref - log pi) - 1 - (log ref - log pi) (Schulman, 2020; used by GRPO), with
    log ref - log pi clamped to +-LOG_RATIO_CLAMP (verl's "low_var_kl")."""
    log_r = jnp.clip(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.expm1(log_r) - log_r


@KL_ESTIMATORS.register("abs")
def abs_kl(logp, ref_logp):
    """|log pi - log ref|: the absolute log-ratio (verl's "abs" KL penalty, after TRL)."""
    return jnp.abs(logp - ref_logp)


@KL_ESTIMATORS.register("k3+")
def k3_plus(logp, ref_logp, clamp: float | None = None):
    """k2 + sg(k3 - k2): k3's value with k2's gradient log pi - log ref (verl's straight-through
    "k3+" / "low_var_kl+"; Schulman, 2020, for k2 and k3). With `clamp`, the value is
    clip(k3, -clamp, clamp) and the gradient is still k2's (verl 0.9.1's `kl_penalty`)."""
    k2_bt = k2(logp, ref_logp)
    k3_bt = k3(logp, ref_logp)
    k3_bt = k3_bt if clamp is None else jnp.clip(k3_bt, -clamp, clamp)
    return k2_bt + jax.lax.stop_gradient(k3_bt - k2_bt)


# estimators whose clamp bounds the value and keeps the gradient (they take clamp= themselves)
_CLAMPS_VALUE_ONLY = (k3_plus,)


def kl(logp, ref_logp, estimator: str = "k3", clamp: float | None = None):
    """Per-token KL(pi || ref) estimate by name: 'k1', 'k2', 'k3', 'abs' or 'k3+' (same shape as
    `logp`), clipped to [-clamp, clamp] when `clamp` is not None (verl clamps k3 to +-10); k3+
    clips its value only and keeps k2's gradient (see the module docstring)."""
    fn = KL_ESTIMATORS.get(estimator)
    if fn in _CLAMPS_VALUE_ONLY:
        return fn(logp, ref_logp, clamp=clamp)
    out = fn(logp, ref_logp)
    return out if clamp is None else jnp.clip(out, -clamp, clamp)
