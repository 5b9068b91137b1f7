"""Verifiers as a host callback inside compiled code (`jax.experimental.io_callback`).

A compiled rollout → reward → advantage step calls the verifiers without leaving ``jit``:
token ids go to the host, are decoded, scored by the `RewardFn` (its pool does the work, so
nothing slow or unsafe runs in the trainer's process), and come back as float32 arrays.

Per-example metadata (gold answers, unit tests) is not array data, so it stays on the host in a
table (any sequence of dicts, e.g. the prompt dataset). The compiled code carries only an int32
``index_b`` into that table: row ``b`` is scored against ``table[index_b[b]]``. With prompt-major
sampling (row ``i*n + j`` = sample ``j`` of prompt ``i``) that is ``jnp.repeat(prompt_idx, n)``.

The callback gathers sharded inputs to one host call (it is ``io_callback``'s job to move the
data); its outputs come back replicated, and the caller may reshard them.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from rljax.errors import DataError
from rljax.rewards.base import Rewards, RewardFn
from rljax.rewards.pool import VerifierPool


def _decoder(decoder: Any) -> Callable[[list[list[int]]], list[str]]:
    if hasattr(decoder, "decode_batch"):
        return lambda ids: decoder.decode_batch(ids, skip_special=True)
    if callable(decoder):
        return decoder
    raise DataError("decoder must be a Tokenizer (with decode_batch) or a function "
                    "list[list[int]] -> list[str]")


class RewardCallback:
    """``callback(tokens_bt, mask_bt, index_b) -> Rewards`` of jax arrays, traceable under ``jit``.

    ``mask_bt`` marks the completion's real tokens (the sampler's ``mask``); its row sums are the
    lengths passed to length rewards. `eager` runs the same scoring on NumPy inputs. ``last_infos``
    keeps the per-row info dicts of the latest call, for logging. Host time spent in calls
    (decode + verify) accumulates until `take_seconds()` reads and resets it, so an iteration that
    calls the verifiers twice (ReMax's greedy baseline) reports the sum.
    """

    def __init__(self, reward_fn: RewardFn, decoder: Any, table: Sequence[Any],
                 pool: VerifierPool | None = None) -> None:
        self.reward_fn, self.table, self.pool = reward_fn, table, pool
        self.decode = _decoder(decoder)
        self.last_infos: list[dict] = []
        self._seconds = 0.0  # wall time of the calls since the last take_seconds()

    def eager(self, tokens_bt: Any, mask_bt: Any, index_b: Any) -> Rewards:
        """Scores on the host; returns `Rewards` of NumPy arrays."""
        start = time.perf_counter()
        tokens_bt, mask_bt = np.asarray(tokens_bt), np.asarray(mask_bt).astype(bool)
        index_b = np.asarray(index_b)
        if tokens_bt.shape != mask_bt.shape or index_b.shape != tokens_bt.shape[:1]:
            raise DataError(f"shapes tokens {tokens_bt.shape}, mask {mask_bt.shape}, index "
                            f"{index_b.shape} do not fit [B, T], [B, T], [B]")
        if index_b.size and (index_b.min() < 0 or index_b.max() >= len(self.table)):
            raise DataError(f"example index out of range [0, {len(self.table)}): "
                            f"{index_b.min()}..{index_b.max()}; index_b must point into the table")
        ids = [row[m].tolist() for row, m in zip(tokens_bt, mask_bt)]
        texts = self.decode(ids)
        metas = [self.table[int(i)] for i in index_b]
        rewards, self.last_infos = self.reward_fn.batch(metas, texts, num_tokens=mask_bt.sum(1),
                                                        pool=self.pool)
        self._seconds += time.perf_counter() - start
        return rewards

    def take_seconds(self) -> float:
        """Host seconds spent scoring since the previous call (all calls summed), then resets."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def __call__(self, tokens_bt: Any, mask_bt: Any, index_b: Any) -> Rewards:
        """The same scores through ``io_callback``: usable inside ``jax.jit``."""
        import jax
        import jax.numpy as jnp
        from jax.experimental import io_callback

        b = tokens_bt.shape[0]
        f32 = jax.ShapeDtypeStruct((b,), jnp.float32)
        shapes = Rewards(f32, {n: f32 for n in self.reward_fn.part_names},
                         jax.ShapeDtypeStruct((b,), jnp.bool_))
        return io_callback(self.eager, shapes, tokens_bt, mask_bt, index_b)


def as_callback(reward_fn: RewardFn, decoder: Any, table: Sequence[Any], *,
                pool: VerifierPool | None = None) -> RewardCallback:
    """Makes ``reward_fn`` callable from jitted code: ``(tokens_bt, mask_bt, index_b) -> Rewards``.

    ``decoder``: an `rljax.tokenizers.Tokenizer` or ``list[list[int]] -> list[str]``; ``table``:
    host-side metadata, one dict per example, indexed by ``index_b``; ``pool``: defaults to the
    shared `default_pool`.
    """
    return RewardCallback(reward_fn, decoder, table, pool)
