"""Loss aggregation: how per-token losses become one scalar.

Each mode is written as a (numerator, denominator) pair whose two parts are sums over rows, and
whose denominator does not depend on the parameters. So micro-batches add their numerators and
denominators, and `sum(num) / sum(den)` equals the full-batch loss exactly (as do its gradients
when each micro-batch's numerator is divided by the full denominator).

With l the per-token loss, m the mask, n_b = sum_t m_bt, B the number of rows:
    token-mean               sum_bt l m / sum_bt m                 (DAPO, 2025)
    seq-mean-token-mean      (1/B') sum_b [sum_t l m / n_b]        (GRPO, DeepSeekMath 2024)
                             with B' the number of rows with n_b > 0
    seq-mean-token-sum       (1/B) sum_b sum_t l m
    seq-mean-token-sum-norm  sum_bt l m / (B * L)                  (Dr. GRPO, 2025; L a constant length)
"""

from __future__ import annotations

import jax.numpy as jnp

from rljax.objectives.registry import AGGREGATIONS


def _masked_sum_b(loss_bt, mask_bt):
    return jnp.sum(loss_bt * mask_bt, axis=-1)


@AGGREGATIONS.register("token-mean")
def token_mean(loss_bt, mask_bt, norm_length=None):
    """sum l*m / sum m: every token weighs the same (DAPO's token-level loss, 2025)."""
    return jnp.sum(_masked_sum_b(loss_bt, mask_bt)), jnp.sum(mask_bt)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_bt, mask_bt, norm_length=None):
    """mean over non-empty sequences of each sequence's token mean (GRPO, DeepSeekMath 2024)."""
    n_b = jnp.sum(mask_bt, axis=-1)
    per_seq = _masked_sum_b(loss_bt, mask_bt) / jnp.maximum(n_b, 1)
    return jnp.sum(per_seq), jnp.sum((n_b > 0).astype(per_seq.dtype))


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_bt, mask_bt, norm_length=None):
    """mean over sequences of each sequence's token sum (REINFORCE's sum of log-probs)."""
    return jnp.sum(_masked_sum_b(loss_bt, mask_bt)), jnp.asarray(loss_bt.shape[0], loss_bt.dtype)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_bt, mask_bt, norm_length=None):
    """sum l*m / (B * L) with a constant L (default: the padded length T) (Dr. GRPO, 2025)."""
    length = loss_bt.shape[-1] if norm_length is None else norm_length
    return jnp.sum(_masked_sum_b(loss_bt, mask_bt)), jnp.asarray(loss_bt.shape[0] * length, loss_bt.dtype)


def aggregate_parts(per_token_loss, mask, mode: str, norm_length: int | None = None):
    """(numerator, denominator) of an aggregation mode; both add up across micro-batches."""
    mask = mask.astype(per_token_loss.dtype)
    return AGGREGATIONS.get(mode)(per_token_loss, mask, norm_length)


def aggregate(per_token_loss, mask, mode: str = "token-mean", norm_length: int | None = None):
    """One scalar from per-token losses [B, T] and a mask [B, T] (see the module doc for modes)."""
    num, den = aggregate_parts(per_token_loss, mask, mode, norm_length)
    return num / jnp.maximum(den, 1e-8)
