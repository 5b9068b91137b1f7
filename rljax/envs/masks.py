"""Who wrote each token, and the loss mask that follows from it.

In a multi-turn episode one row interleaves the prompt, the model's turns and the environment's
observations. The rollout records an author id per token (`PAD`, `PROMPT`, `MODEL`, `ENV`), and

    loss_mask_bt = [author_bt == MODEL]

so the environment's tokens (tool outputs, and the chat template's role markers around them)
never receive gradient, and never count in an aggregation's denominator: every mode in
`rljax.objectives.aggregation` divides by sums of this mask (token-mean by sum_bt m, the seq-mean
modes by n_b = sum_t m_bt and by the rows with n_b > 0).

The functions take NumPy or jax arrays (`__array_namespace__`), and trace under ``jit``; none
imports jax, so host-side code that uses them does not load it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

PAD, PROMPT, MODEL, ENV = 0, 1, 2, 3


def loss_mask(author_bt: Any, dtype: Any = np.float32) -> Any:
    """1 where the model wrote the token, 0 for the prompt, the environment and padding."""
    return (author_bt == MODEL).astype(dtype)


def author_row(segments: Sequence[tuple[int, int]], length: int) -> np.ndarray:
    """One row's author ids from ``(author, num_tokens)`` segments in order, right-padded with PAD."""
    ids = np.concatenate([np.full(n, a, np.int32) for a, n in segments] or [np.zeros(0, np.int32)])
    if len(ids) > length:
        raise ValueError(f"segments hold {len(ids)} tokens, more than the row length {length}")
    return np.pad(ids, (0, length - len(ids)), constant_values=PAD)


def tokens_by_author(author_bt: Any) -> tuple[Any, Any]:
    """(model_tokens_b, env_tokens_b): tokens each row's model and environment wrote."""
    return (author_bt == MODEL).sum(axis=-1), (author_bt == ENV).sum(axis=-1)


def turn_index(author_bt: Any) -> Any:
    """turn_bt: which model turn (0, 1, ...) each model token belongs to; -1 on other tokens.

    A turn starts at each model token whose predecessor is not a model token, so the turns are
    the maximal runs of model tokens, split by the environment's observations.
    """
    xp = author_bt.__array_namespace__()
    is_model = author_bt == MODEL
    prev = xp.concat([xp.zeros_like(is_model[..., :1]), is_model[..., :-1]], axis=-1)
    starts = (is_model & ~prev).astype(xp.int32)
    return xp.where(is_model, xp.cumsum(starts, axis=-1) - 1, -1)


def discounted_turn_returns(turn_rewards_bk: Any, gamma: float) -> Any:
    """G_k = sum_{j >= k} gamma^(j - k) r_j over each row's turns (k = 0..K-1), for turn-level
    credit (ArCHer, Zhou et al., 2024: a turn is credited with the rewards that follow it).

    `turn_values_to_tokens` spreads them over each turn's tokens.
    """
    xp = turn_rewards_bk.__array_namespace__()
    k = turn_rewards_bk.shape[-1]
    j = xp.arange(k)
    power = xp.asarray(j[None, :] - j[:, None], dtype=turn_rewards_bk.dtype)  # [k, j] = j - k
    gamma_ = xp.asarray(gamma, dtype=turn_rewards_bk.dtype)
    weights_kj = xp.where(power >= 0, gamma_ ** xp.maximum(power, 0), 0)
    return turn_rewards_bk @ weights_kj.T


def turn_values_to_tokens(values_bk: Any, turn_bt: Any) -> Any:
    """values_bt: each model token gets its turn's value (``values_bk[b, turn_bt[b, t]]``), every
    other token 0; ``turn_bt`` from `turn_index`. Turns past K (``turn_bt >= K``) are an error in
    NumPy and clamp under jit, so size K to the turn limit."""
    xp = values_bk.__array_namespace__()
    picked = xp.take_along_axis(values_bk, xp.maximum(turn_bt, 0), axis=-1)
    return xp.where(turn_bt >= 0, picked, xp.zeros_like(picked))
