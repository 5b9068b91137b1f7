"""Loss aggregation: how per-token losses become one scalar.

Each mode is written as a (numerator, denominator) pair whose two parts are sums over rows, and
whose denominator does not depend on the parameters. So micro-batches add their numerators and
denominators, and `sum(num) / sum(den)` equals the full-batch loss exactly (as do its gradients
when each micro-batch's numerator is divided by the full denominator). The one exception is
token-sum, whose denominator is the constant 1: its numerators add, its denominator does not.

With l the per-token loss, m the mask, n_b = sum_t m_bt, and B' the number of non-empty rows
(n_b > 0):
    token-mean               sum_bt l m / sum_bt m                 (DAPO, 2025)
    token-sum                sum_bt l m / 1
    seq-mean-token-mean      (1/B') sum_b [sum_t l m / n_b]        (GRPO, DeepSeekMath 2024)
    seq-mean-token-sum       (1/B') sum_b sum_t l m
    seq-mean-token-sum-norm  sum_bt l m / (B' * L)                 (Dr. GRPO, 2025; L a constant)

The seq-mean modes average over non-empty rows only, as verl's `agg_loss` does for seq-mean-*:
fully masked rows (dynamic-sampling filler, sequences dropped by MIS) would otherwise dilute the
loss. verl's seq-mean-token-sum-norm divides by L alone; rljax also averages over B' rows (the
paper's mean over responses), so the loss scale does not grow with the batch.
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


@AGGREGATIONS.register("token-sum")
def token_sum(loss_bt, mask_bt, norm_length=None):
    """sum l*m with denominator 1: the plain sum over tokens. The update step divides every
    micro-batch's numerator by the mini-batch's denominator, which for this mode is 1."""
    return jnp.sum(_masked_sum_b(loss_bt, mask_bt)), jnp.asarray(1.0, loss_bt.dtype)


def _nonempty_rows(mask_bt):
    return jnp.sum((jnp.sum(mask_bt, axis=-1) > 0).astype(mask_bt.dtype))


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_bt, mask_bt, norm_length=None):
    """mean over non-empty sequences of each sequence's token mean (GRPO, DeepSeekMath 2024)."""
    n_b = jnp.sum(mask_bt, axis=-1)
    per_seq = _masked_sum_b(loss_bt, mask_bt) / jnp.maximum(n_b, 1)
    return jnp.sum(per_seq), _nonempty_rows(mask_bt)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_bt, mask_bt, norm_length=None):
    """mean over non-empty sequences of each sequence's token sum (REINFORCE's sum of log-probs)."""
    return jnp.sum(_masked_sum_b(loss_bt, mask_bt)), _nonempty_rows(mask_bt)


@AGGREGATIONS.register("seq-mean-token-sum-norm", params=("norm_length",))
def seq_mean_token_sum_norm(loss_bt, mask_bt, norm_length=None):
    """sum l*m / (B' * L) over the B' non-empty rows with a constant L (default: the padded length
    T) (Dr. GRPO, *Understanding R1-Zero-like training*, Liu et al. 2025)."""
    length = loss_bt.shape[-1] if norm_length is None else norm_length
    return jnp.sum(_masked_sum_b(loss_bt, mask_bt)), _nonempty_rows(mask_bt) * length


def aggregate_parts(per_token_loss, mask, mode: str, norm_length: int | None = None):
    """(numerator, denominator) of an aggregation mode; both add up across micro-batches."""
    mask = mask.astype(per_token_loss.dtype)
    return AGGREGATIONS.get(mode)(per_token_loss, mask, norm_length)


def aggregate(per_token_loss, mask, mode: str = "token-mean", norm_length: int | None = None):
    """One scalar from per-token losses [B, T] and a mask [B, T] (see the module doc for modes)."""
    num, den = aggregate_parts(per_token_loss, mask, mode, norm_length)
    return num / jnp.maximum(den, 1e-8)
