"""Curriculum selection policies: tasks ordered by difficulty level, chosen easy to hard.

    policy = make_policy("auto_curriculum", levels=[1, 2, 3], min_groups=16)
    state = policy.calibrate(policy.init(num_tasks=3, seed=0), pass_rate_j)   # optional warm start
    policy.level_of(state)                                                     # {"all": 2}

Registered here into `rljax.data.selection.POLICIES` (at import; `rljax.data` imports this
module, so `make_policy` always sees them):

``schedule``: a fixed piecewise-constant schedule over difficulty levels by choice step,
``P(j) = w_{stage(k), level(j)} / #{i: level(i) = level(j)}`` (AceReason-style staged training).
``auto_curriculum``: per task family, start at the level whose pass rate is in a band and move
up one level when an EMA of the pass rate exceeds `advance_at` (optionally probing the next
level first, issue 24).

They share the base policy's state contract (`rljax.data.selection`): a frozen dataclass of
plain values, JSON in the checkpoint, choice k seeded by ``default_rng([seed, k])``. They live
apart from it because they are the only policies that read per-task difficulty `levels`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rljax.data.selection import SelectionPolicy, SelectionState, normalized_weights, register_policy
from rljax.errors import ConfigError


def _level_order(levels: Sequence[int], num_tasks: int) -> tuple[int, ...]:
    if levels is None or len(levels) != num_tasks:
        raise ConfigError(f"levels must give one difficulty level per task ({num_tasks}), got {levels}")
    return tuple(sorted(set(int(v) for v in levels)))


@register_policy("schedule")
@dataclasses.dataclass(frozen=True)
class Schedule(SelectionPolicy):
    """Easy to hard by iteration: a piecewise-constant schedule of weights over difficulty levels.

    `levels[j]` is task j's difficulty level; `boundaries` are the choice steps at which the
    stage changes, and `stage_weights[s]` weighs the distinct levels (ascending) in stage s, so

        stage(k) = #{b in boundaries: b <= k},  P(j) = w_{stage(k), level(j)} / #{i: level(i) = level(j)}

    renormalised over the levels that have weight (AceReason-style staged training, 2025).
    """

    levels: tuple[int, ...] | None = None
    boundaries: tuple[int, ...] = ()
    stage_weights: tuple[tuple[float, ...], ...] = ()

    def check(self, num_tasks):
        order = _level_order(self.levels, num_tasks)
        if list(self.boundaries) != sorted(self.boundaries) or len(self.stage_weights) != len(self.boundaries) + 1:
            raise ConfigError("schedule needs ascending boundaries and one stage_weights row per stage "
                              f"(len(boundaries) + 1 = {len(self.boundaries) + 1})")
        for row in self.stage_weights:
            normalized_weights(row, len(order))

    def probs(self, state):
        order = _level_order(self.levels, state.num_tasks)
        stage = int(np.searchsorted(np.asarray(self.boundaries), state.step, side="right"))
        w_level = normalized_weights(self.stage_weights[stage], len(order))
        level_idx = np.array([order.index(int(v)) for v in self.levels])
        share = np.bincount(level_idx, minlength=len(order))[level_idx]
        return w_level[level_idx] / share


@dataclasses.dataclass(frozen=True)
class CurriculumState(SelectionState):
    """Per family: the index of its current level (ascending), the EMA pass rate at that level
    (None before a group is seen there) and the groups seen there; the same two for the probed
    next level (`next_rate`, `next_seen`)."""

    current: dict = dataclasses.field(default_factory=dict)
    rate: dict = dataclasses.field(default_factory=dict)
    seen: dict = dataclasses.field(default_factory=dict)
    next_rate: dict = dataclasses.field(default_factory=dict)
    next_seen: dict = dataclasses.field(default_factory=dict)


@register_policy("auto_curriculum")
@dataclasses.dataclass(frozen=True)
class AutoCurriculum(SelectionPolicy):
    """Start each task family at the difficulty it can learn from, move up as it improves.

    Tasks are (family, level) pairs: `families[j]` names task j's family (default: one family)
    and `levels[j]` its difficulty. Each family has a current level; a prompt picks a family by
    `family_weights` (equal by default), then a task of that family at its current level.

    `calibrate(state, pass_rate_j)` sets the start from measured pass rates (a warm-start eval per
    level): the lowest level with ``low <= p <= high``; if none, the hardest level above the band
    (it still has something to learn nearby); if none, the easiest. Without calibration a family
    starts at its easiest level. `update` keeps an EMA of the pass rate at the current level
    (the first call sets it) and moves up one level once ``seen >= min_groups`` groups and the EMA
    exceeds `advance_at`; groups from any other level (drawn before a move) are ignored. The EMA
    takes one step per `update` call (an RL iteration), on the mean pass rate of that call's
    groups at the level: stepped per group, with 64 groups an iteration, decay 0.9 remembered ~10
    groups, and a run of easy prompts lifted it over `advance_at` by chance (basic_arithmetic
    moved up at a 0.32 mean pass rate, issue 24).

    With `probe` > 0 a family spends that share of its prompts on its next level and keeps an
    EMA of the pass rate there too; it moves up only once the next level is learnable as well:
    ``next_seen >= min_groups`` and its EMA >= `low`, and the move carries that EMA over. The
    reason is measured (issue 24): decimal_chain_sum mastered level 1 in 50 iterations and moved
    to level 2, where 3-5% of samples passed; its remaining 350 iterations taught almost nothing,
    while level 1 still had room. ``probe = 0`` is the rule without probing.
    """

    levels: tuple[int, ...] | None = None
    families: tuple[str, ...] | None = None
    family_weights: tuple[float, ...] | None = None
    low: float = 0.1
    high: float = 0.9
    advance_at: float = 0.7
    decay: float = 0.9
    min_groups: int = 16
    probe: float = 0.1

    state_type = CurriculumState

    def _families(self, num_tasks) -> tuple[str, ...]:
        fam = ("all",) * num_tasks if self.families is None else tuple(self.families)
        if len(fam) != num_tasks:
            raise ConfigError(f"families must name one family per task ({num_tasks}), got {list(fam)}")
        return fam

    def _names(self, num_tasks) -> list[str]:
        return list(dict.fromkeys(self._families(num_tasks)))

    def _ladder(self, family: str, num_tasks: int) -> tuple[int, ...]:
        fam = self._families(num_tasks)
        return tuple(sorted({int(self.levels[j]) for j in range(num_tasks) if fam[j] == family}))

    def check(self, num_tasks):
        _level_order(self.levels, num_tasks)
        normalized_weights(self.family_weights, len(self._names(num_tasks)))
        if not 0.0 <= self.low <= self.high <= 1.0 or not 0.0 <= self.decay < 1.0 or self.min_groups < 1 \
                or not 0.0 <= self.probe < 1.0:
            raise ConfigError("auto_curriculum needs 0 <= low <= high <= 1, 0 <= decay < 1, min_groups >= 1 and "
                              "0 <= probe < 1")

    def init(self, num_tasks, seed):
        base = super().init(num_tasks, seed)
        names = self._names(num_tasks)
        return CurriculumState(num_tasks=num_tasks, seed=base.seed, current={f: 0 for f in names},
                               rate={f: None for f in names}, seen={f: 0 for f in names},
                               next_rate={f: None for f in names}, next_seen={f: 0 for f in names})

    def calibrate(self, state, pass_rate_j) -> CurriculumState:
        """Start levels from measured per-task pass rates (see the class doc); resets the EMAs."""
        pass_rate_j = np.asarray(pass_rate_j, np.float64)
        fam = self._families(state.num_tasks)
        current = {}
        for f in self._names(state.num_tasks):
            ladder = self._ladder(f, state.num_tasks)
            rate_l = [np.mean([pass_rate_j[j] for j in range(state.num_tasks)
                               if fam[j] == f and int(self.levels[j]) == lv]) for lv in ladder]
            inside = [i for i, p in enumerate(rate_l) if self.low <= p <= self.high]
            above = [i for i, p in enumerate(rate_l) if p > self.high]
            current[f] = inside[0] if inside else (above[-1] if above else 0)
        names = list(current)
        return dataclasses.replace(state, current=current, rate={f: None for f in names},
                                   seen={f: 0 for f in names}, next_rate={f: None for f in names},
                                   next_seen={f: 0 for f in names})

    def probs(self, state):
        fam = self._families(state.num_tasks)
        names = self._names(state.num_tasks)
        w_f = dict(zip(names, normalized_weights(self.family_weights, len(names))))
        p = np.zeros(state.num_tasks)
        for f in names:  # a family's weight: 1 - probe at its current level, probe at the next one
            ladder = self._ladder(f, state.num_tasks)
            i = state.current[f]
            shares = [(ladder[i], 1.0 - self.probe), (ladder[i + 1], self.probe)] if self.probe and i + 1 < len(ladder) \
                else [(ladder[i], 1.0)]
            for level, share in shares:  # split among the family's tasks at that level
                members = np.array([fam[j] == f and int(self.levels[j]) == level for j in range(state.num_tasks)])
                p[members] = w_f[f] * share / members.sum()
        return p

    def update(self, state, task_ids_g, stats):
        fam = self._families(state.num_tasks)
        current, rate, seen = dict(state.current), dict(state.rate), dict(state.seen)
        next_rate, next_seen = dict(state.next_rate), dict(state.next_seen)
        ema = lambda old, p: float(p) if old is None else self.decay * old + (1.0 - self.decay) * float(p)  # noqa: E731
        task_ids_g, pass_rate_g = np.asarray(task_ids_g), np.asarray(stats.pass_rate_g, np.float64)
        level_g = np.array([int(self.levels[j]) for j in task_ids_g], np.int64)
        for f in current:  # one EMA step per call, on the mean over the call's groups at a level
            ladder = self._ladder(f, state.num_tasks)
            in_family_g = np.array([fam[j] == f for j in task_ids_g], bool)
            at_current = in_family_g & (level_g == ladder[current[f]])
            at_next = in_family_g & (level_g == ladder[current[f] + 1]) if self.probe and current[f] + 1 < len(ladder) \
                else np.zeros(len(level_g), bool)
            if at_next.any():
                next_rate[f] = ema(next_rate[f], pass_rate_g[at_next].mean())
                next_seen[f] += int(at_next.sum())
            if not at_current.any():
                continue
            rate[f], seen[f] = ema(rate[f], pass_rate_g[at_current].mean()), seen[f] + int(at_current.sum())
            next_ok = not self.probe or (next_seen[f] >= self.min_groups and next_rate[f] >= self.low)
            if seen[f] >= self.min_groups and rate[f] > self.advance_at and current[f] + 1 < len(ladder) and next_ok:
                current[f], rate[f], seen[f] = current[f] + 1, next_rate[f] if self.probe else None, next_seen[f]
                next_rate[f], next_seen[f] = None, 0
        return dataclasses.replace(state, current=current, rate=rate, seen=seen, next_rate=next_rate,
                                   next_seen=next_seen)

    def level_of(self, state) -> dict[str, int]:
        """Each family's current difficulty level (for metrics)."""
        return {f: self._ladder(f, state.num_tasks)[i] for f, i in state.current.items()}
