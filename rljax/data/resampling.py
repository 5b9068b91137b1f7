"""DAPO dynamic sampling by resampling: draw fixed-size rounds of prompts until the batch is full.

DAPO (Yu et al., 2025) keeps sampling until every group in the batch has reward variance
(``max_j r_gj > min_j r_gj``, `informative_groups`): an all-equal group has zero GRPO advantage
and only dilutes the batch. Under ReMax the baseline is the greedy answer's reward, not the
group's mean, so a group is informative when some sample's reward differs from it. Here the
sampler runs in rounds of a static R prompts (one compiled shape), and this host-side controller
decides after each round whether to draw another:

    round k: rewards [R, n] -> keep the informative groups
    stop when kept >= num_groups (filled) or k + 1 == max_rounds (the cap)
    batch = the first num_groups kept groups in sampled order; at the cap, topped up with
            dropped groups (sampled order) marked invalid, as `refill` does for a fixed pool

Group positions are round-major: group i of round k is ``k * R + i``, so the caller gathers its
rollouts from the concatenated rounds. The fixed-pool mode (over-sample once, then `refill`) is
the special case ``max_rounds = 1`` with R the pool size. `ResampleSpend` says what the batch
cost; a run that hits the cap often needs a larger R or cap, and one with many `unused` kept
groups a smaller R.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from rljax.data.filtering import informative_groups
from rljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ResampleSpend:
    """What one batch cost, in groups (a group is one prompt's n samples).

    rounds: rounds drawn; sampled: ``rounds * R``; kept: informative groups among them (may
    exceed the batch); dropped: ``sampled - kept``; unused: kept groups beyond the batch;
    padded: invalid filler groups in the batch (non-zero only at the cap).
    """

    rounds: int
    sampled: int
    kept: int
    dropped: int
    unused: int
    padded: int

    def metrics(self) -> dict[str, float]:
        """`rollout/resample_*` scalars for the run log."""
        return {f"rollout/resample_{k}": float(v) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class ResampledBatch:
    """indices_g: int64 ``[G]`` round-major group positions; valid_g: bool ``[G]``, False on
    filler; spend: the cost; filled: every group is informative."""

    indices_g: np.ndarray
    valid_g: np.ndarray
    spend: ResampleSpend

    @property
    def filled(self) -> bool:
        return bool(self.valid_g.all())


class RoundResampler:
    """The controller for one batch: `add_round(rewards_rn)` until `done`, then `result()`.

        rs = RoundResampler(num_groups=G, round_size=R, max_rounds=K)
        while not rs.done:
            rewards_rn = sample_and_score(R prompts)   # the loop keeps the rollouts
            rs.add_round(rewards_rn)
        batch = rs.result()
    """

    def __init__(self, *, num_groups: int, round_size: int, max_rounds: int, atol: float = 0.0):
        if num_groups < 1 or round_size < 1 or max_rounds < 1:
            raise ConfigError(f"resampling needs num_groups, round_size and max_rounds >= 1, got "
                              f"{num_groups}, {round_size}, {max_rounds}")
        if num_groups > round_size * max_rounds:
            raise ConfigError(f"{max_rounds} rounds of {round_size} prompts cannot fill {num_groups} "
                              "groups; raise round_size or max_rounds")
        self.num_groups, self.round_size, self.max_rounds, self.atol = num_groups, round_size, max_rounds, atol
        self._keep: list[np.ndarray] = []

    @property
    def rounds(self) -> int:
        return len(self._keep)

    @property
    def kept(self) -> int:
        return int(sum(k.sum() for k in self._keep))

    @property
    def done(self) -> bool:
        return self.kept >= self.num_groups or self.rounds >= self.max_rounds

    def add_round(self, rewards_rn, baseline_r=None) -> np.ndarray:
        """Score one round's rewards ``[R, n]`` (and, for a baseline that is not the group's own,
        such as ReMax's greedy reward, its ``[R]`` baselines: `informative_groups`); returns its
        keep mask ``[R]``."""
        if self.done:
            raise ValueError("the batch is already full or the round cap is reached; call result()")
        rewards_rn = np.asarray(rewards_rn)
        if rewards_rn.ndim != 2 or rewards_rn.shape[0] != self.round_size:
            raise ValueError(f"a round must be rewards [{self.round_size}, n], got {rewards_rn.shape}")
        if baseline_r is not None and np.shape(baseline_r) != rewards_rn.shape[:1]:
            raise ValueError(f"a round's baselines must be [{self.round_size}], got {np.shape(baseline_r)}")
        keep_r = np.asarray(informative_groups(rewards_rn, self.atol, baseline_r), bool)
        self._keep.append(keep_r)
        return keep_r

    def result(self) -> ResampledBatch:
        """The batch: kept groups first, then (at the cap) dropped groups as invalid filler."""
        if not self.done:
            raise ValueError(f"{self.kept} of {self.num_groups} groups kept after {self.rounds} rounds; "
                             "add rounds until done")
        keep = np.concatenate(self._keep)
        order = np.argsort(~keep, kind="stable")[:self.num_groups]  # kept first, sampled order
        kept = int(keep.sum())
        spend = ResampleSpend(rounds=self.rounds, sampled=keep.size, kept=kept, dropped=keep.size - kept,
                              unused=max(kept - self.num_groups, 0), padded=max(self.num_groups - kept, 0))
        return ResampledBatch(indices_g=order.astype(np.int64), valid_g=keep[order], spend=spend)


def resample(draw_round: Callable[[int], np.ndarray], *, num_groups: int, round_size: int, max_rounds: int,
             atol: float = 0.0, baseline_round: Callable[[int], np.ndarray] | None = None) -> ResampledBatch:
    """Run `RoundResampler` with ``draw_round(k) -> rewards [R, n]`` (and, with a baseline of its
    own, ``baseline_round(k) -> [R]``) for rounds k = 0, 1, ... (called only while the batch is
    not full and the cap not reached)."""
    rs = RoundResampler(num_groups=num_groups, round_size=round_size, max_rounds=max_rounds, atol=atol)
    while not rs.done:
        k = rs.rounds
        rs.add_round(draw_round(k), None if baseline_round is None else baseline_round(k))
    return rs.result()
