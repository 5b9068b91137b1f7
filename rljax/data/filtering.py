"""Dynamic sampling and online difficulty filtering over an over-sampled pool of groups.

DAPO (2025) drops every group whose n rewards are all equal: under a group baseline such a
group has zero advantage everywhere and only dilutes the batch. It refills the batch from extra
prompts. Online difficulty filtering (2025) keeps prompts the policy solves sometimes but not
always: ``low < accuracy < high``. Both reduce to a keep mask over a pool of P groups; `refill`
turns the mask into a batch of exactly G groups, so shapes stay static under `jit`.

Refill policy when fewer than G groups survive: the batch is topped up with dropped groups (in
pool order) marked ``valid_g = False``. Give them zero weight in the loss (GRPO-style advantages
of an all-equal group are already zero) and log `num_padded`: a run that pads often needs a
larger pool.
"""

from __future__ import annotations

import chex
import flax
import jax
import jax.numpy as jnp

from rljax.errors import ConfigError


@flax.struct.dataclass
class GroupSelection:
    """Which pool groups make up the batch, and counts for metrics.

    indices_g: int32 ``[G]`` pool rows, kept groups first, each block in pool order.
    valid_g: bool ``[G]``, False on filler groups that must not contribute to the loss.
    num_kept: groups in the pool that passed the filter (may exceed G).
    num_padded: filler groups in the batch, ``max(G - num_kept, 0)``.
    num_dropped: pool groups that failed the filter, ``P - num_kept``.
    """

    indices_g: jax.Array
    valid_g: jax.Array
    num_kept: jax.Array
    num_padded: jax.Array
    num_dropped: jax.Array


def informative_groups(rewards_pn: jax.Array, atol: float = 0.0, baseline_p: jax.Array | None = None) -> jax.Array:
    """The groups that carry a gradient.

    Without a baseline (group baselines: GRPO, RLOO, DAPO), DAPO's dynamic-sampling mask
    ``max_j r_pj - min_j r_pj > atol``: the rewards are not all equal. With a per-prompt
    baseline ``b_p`` that is not the group's own mean (ReMax's greedy reward), the advantage is
    ``r_pj - b_p``, so a group is informative when ``max_j |r_pj - b_p| > atol``: eight wrong
    samples of a prompt whose greedy answer is right all carry advantage -1, though they agree.
    """
    rewards_pn = jnp.asarray(rewards_pn)
    chex.assert_rank(rewards_pn, 2)
    if baseline_p is None:
        return (rewards_pn.max(axis=1) - rewards_pn.min(axis=1)) > atol
    baseline_p = jnp.asarray(baseline_p, rewards_pn.dtype)
    chex.assert_shape(baseline_p, rewards_pn.shape[:1])
    return jnp.abs(rewards_pn - baseline_p[:, None]).max(axis=1) > atol


def accuracy_band(rewards_pn: jax.Array, low: float = 0.0, high: float = 1.0,
                  correct_threshold: float = 1.0) -> jax.Array:
    """Online difficulty filtering: keep groups with ``low < mean_j[r_pj >= threshold] < high``.

    With the defaults a group is kept unless all its samples are right or all are wrong.
    """
    rewards_pn = jnp.asarray(rewards_pn)
    chex.assert_rank(rewards_pn, 2)
    acc_p = jnp.mean(rewards_pn >= correct_threshold, axis=1)
    return (acc_p > low) & (acc_p < high)


def refill(keep_p: jax.Array, num_groups: int) -> GroupSelection:
    """A static batch of `num_groups` pool rows: kept groups first, then filler (see module doc)."""
    keep_p = jnp.asarray(keep_p, bool)
    chex.assert_rank(keep_p, 1)
    pool = keep_p.shape[0]
    if not 1 <= num_groups <= pool:
        raise ConfigError(f"batch of {num_groups} groups needs a pool of at least that many (pool has {pool})")
    order_p = jnp.argsort(~keep_p, stable=True)  # kept rows first, each block in pool order
    indices_g = order_p[:num_groups].astype(jnp.int32)
    num_kept = keep_p.sum().astype(jnp.int32)
    return GroupSelection(indices_g=indices_g, valid_g=keep_p[indices_g], num_kept=num_kept,
                          num_padded=jnp.maximum(num_groups - num_kept, 0),
                          num_dropped=(pool - num_kept).astype(jnp.int32))


def dynamic_sample(rewards_pn: jax.Array, num_groups: int, atol: float = 0.0,
                   baseline_p: jax.Array | None = None) -> GroupSelection:
    """DAPO dynamic sampling: `refill(informative_groups(rewards_pn, atol, baseline_p), num_groups)`."""
    return refill(informative_groups(rewards_pn, atol, baseline_p), num_groups)
