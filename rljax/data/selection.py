"""Task-selection policies: which task (source) each prompt of the next batch comes from.

    policy = make_policy("bandit", algorithm="ucb")
    state = policy.init(num_tasks=4, seed=0)
    task_ids_b, state = policy.choose(state, batch_size=16)      # sample and score these prompts
    state = policy.update(state, task_ids_g, group_stats(rewards_gn, advantages_gn, prompt_ids))
    json.dumps(policy.state_dict(state))                        # -> checkpoint; load_state() back

A policy is a frozen, typed config; everything that changes during a run lives in its state, a
frozen dataclass of plain ints, floats, tuples and str-keyed dicts, so `state_dict` is JSON and a
resumed run continues with exactly the choices an uninterrupted one makes. Randomness is never
carried in the state: choice k draws from ``np.random.default_rng([seed, k])``, so restoring
``(seed, step)`` restores the stream.

Registered policies (`POLICIES`): ``uniform`` (by weight), ``band`` (online difficulty
filtering per prompt), ``bandit`` (DUMP's UCB, SEC's Boltzmann TD(0), Gaussian Thompson
sampling), ``schedule`` (a piecewise easy-to-hard schedule over difficulty levels) and
``auto_curriculum`` (start where the pass rate is in a band, move up when it is mastered).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rljax.errors import ConfigError
from rljax.objectives.registry import Registry

POLICIES: Registry = Registry("selection policy")


def register_policy(name: str):
    """Decorator: `@register_policy("uniform")` adds a `SelectionPolicy` class under `name`."""
    return POLICIES.register(name)


def make_policy(name: str, **kwargs) -> "SelectionPolicy":
    """The policy registered as `name`, configured by `kwargs`; one-line ConfigError otherwise."""
    cls = POLICIES.get(name)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ConfigError(f"selection policy {name!r} has no option(s) {unknown}; "
                          f"its options are {', '.join(sorted(known)) or 'none'}")
    return cls(**{k: _freeze(v) for k, v in kwargs.items()})


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """What one batch taught, per group (one prompt and its n samples), for `update`.

    pass_rate_g: f64 ``[G]`` share of the group's samples with reward >= the correct threshold.
    abs_adv_g: f64 ``[G]`` mean |advantage| over the group's samples (the learning-progress
    signal of DUMP and SEC). prompt_ids_g: a key per group (`band` needs it). group_size: samples
    per group (n), so sample counts are exact.
    """

    pass_rate_g: np.ndarray
    abs_adv_g: np.ndarray
    prompt_ids_g: tuple[str, ...] | None = None
    group_size: int = 1


def group_stats(rewards_gn, advantages_gn, prompt_ids_g: Sequence[Any] | None = None,
                correct_threshold: float = 1.0) -> GroupStats:
    """`GroupStats` from per-sample rewards and (sequence-level) advantages, both ``[G, n]``."""
    rewards_gn = np.asarray(rewards_gn, np.float64)
    advantages_gn = np.asarray(advantages_gn, np.float64)
    if rewards_gn.ndim != 2 or rewards_gn.shape != advantages_gn.shape:
        raise ValueError(f"rewards {rewards_gn.shape} and advantages {advantages_gn.shape} must both be [G, n]")
    ids = None if prompt_ids_g is None else tuple(str(p) for p in prompt_ids_g)
    return GroupStats(pass_rate_g=np.mean(rewards_gn >= correct_threshold, axis=1),
                      abs_adv_g=np.mean(np.abs(advantages_gn), axis=1), prompt_ids_g=ids,
                      group_size=rewards_gn.shape[1])


def _softmax(x, temperature: float) -> np.ndarray:
    z = np.asarray(x, np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def _freeze(value):
    """JSON lists back to the tuples the states hold (dicts keep their str keys)."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return {k: _freeze(v) for k, v in value.items()}
    return value


def _weights(weights: Sequence[float] | None, num_tasks: int) -> np.ndarray:
    w = np.ones(num_tasks) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (num_tasks,) or np.any(w < 0) or w.sum() <= 0:
        raise ConfigError(f"weights {None if weights is None else list(weights)} must be {num_tasks} "
                          "non-negative numbers with a positive sum, one per task")
    return w / w.sum()


@dataclasses.dataclass(frozen=True)
class SelectionState:
    """The state every policy has: the task count, its seed and how many choices it has made."""

    num_tasks: int
    seed: int
    step: int = 0


@dataclasses.dataclass(frozen=True)
class SelectionPolicy(abc.ABC):
    """Base: i.i.d. task ids from `probs(state)`; subclasses define `probs` and `update`."""

    state_type = SelectionState

    def init(self, num_tasks: int, seed: int) -> SelectionState:
        if num_tasks < 1:
            raise ConfigError(f"a mixture needs at least one task, got num_tasks={num_tasks}")
        self.check(num_tasks)
        return self.state_type(num_tasks=num_tasks, seed=int(seed))

    def check(self, num_tasks: int) -> None:
        """Validate the options against the task count (ConfigError)."""

    @abc.abstractmethod
    def probs(self, state) -> np.ndarray:
        """The task distribution, float ``[num_tasks]`` summing to 1."""

    def choose(self, state, batch_size: int) -> tuple[np.ndarray, Any]:
        """``batch_size`` task ids, int64, drawn i.i.d. from `probs(state)` with the seed's
        `step`-th generator; returns them and the state with `step + 1`."""
        rng = np.random.default_rng([state.seed, state.step])
        ids_b = rng.choice(state.num_tasks, size=batch_size, p=self.probs(state)).astype(np.int64)
        return ids_b, dataclasses.replace(state, step=state.step + 1)

    def update(self, state, task_ids_g, stats: GroupStats):
        """Fold one batch's outcomes into the state (groups in batch order)."""
        return state

    def keep(self, state, prompt_ids: Sequence[Any]) -> np.ndarray:
        """Which prompts the sampler should keep; every prompt unless the policy filters."""
        return np.ones(len(prompt_ids), bool)

    def state_dict(self, state) -> dict:
        """The state as a JSON-serialisable dict (for the checkpoint)."""
        return dataclasses.asdict(state)

    def load_state(self, state_dict: dict):
        """The state `state_dict` describes (the inverse of `state_dict`)."""
        return self.state_type(**_freeze(dict(state_dict)))


@register_policy("uniform")
@dataclasses.dataclass(frozen=True)
class Uniform(SelectionPolicy):
    """Each prompt's task drawn i.i.d. with probability ``w_j / sum w`` (equal when unset)."""

    weights: tuple[float, ...] | None = None

    def check(self, num_tasks):
        _weights(self.weights, num_tasks)

    def probs(self, state):
        return _weights(self.weights, state.num_tasks)


@dataclasses.dataclass(frozen=True)
class BandState(SelectionState):
    """pass_ema: prompt key -> running pass rate; visits: prompt key -> groups seen. Both are
    in least-recently-updated-first order, so the oldest prompt is the first evicted."""

    pass_ema: dict = dataclasses.field(default_factory=dict)
    visits: dict = dataclasses.field(default_factory=dict)


@register_policy("band")
@dataclasses.dataclass(frozen=True)
class Band(SelectionPolicy):
    """Online difficulty filtering (Bae et al., *Online Difficulty Filtering for Reasoning
    Oriented RL*, 2025), per prompt and across visits:

        p_x <- p_new                                (first visit of prompt x)
        p_x <- decay * p_x + (1 - decay) * p_new    (later visits; an EMA)
        keep(x) = x unseen  or  low < p_x < high

    `accuracy_band` applies the same strict band to one batch's groups after sampling; `keep`
    applies it before sampling from what earlier visits measured, so prompts the policy always
    or never solves stop costing rollouts. Tasks are still chosen by `weights`. The table holds
    at most `max_prompts` prompts, evicting the least recently updated (procedural sources
    rarely repeat a question, and the table goes into every checkpoint).
    """

    low: float = 0.0
    high: float = 1.0
    decay: float = 0.5
    weights: tuple[float, ...] | None = None
    max_prompts: int = 100_000

    state_type = BandState

    def check(self, num_tasks):
        _weights(self.weights, num_tasks)
        if not 0.0 <= self.low < self.high <= 1.0:
            raise ConfigError(f"band needs 0 <= low < high <= 1, got low={self.low}, high={self.high}")
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"band decay={self.decay} must be in [0, 1)")

    def probs(self, state):
        return _weights(self.weights, state.num_tasks)

    def update(self, state, task_ids_g, stats):
        if stats.prompt_ids_g is None:
            raise ValueError("the band policy needs GroupStats.prompt_ids_g")
        ema, visits = dict(state.pass_ema), dict(state.visits)
        for key, p in zip(stats.prompt_ids_g, stats.pass_rate_g):
            old = ema.pop(key, None)
            ema[key] = float(p) if old is None else self.decay * old + (1.0 - self.decay) * float(p)
            visits[key] = visits.pop(key, 0) + 1
        while len(ema) > self.max_prompts:
            oldest = next(iter(ema))
            del ema[oldest], visits[oldest]
        return dataclasses.replace(state, pass_ema=ema, visits=visits)

    def keep(self, state, prompt_ids):
        rates = [state.pass_ema.get(str(p)) for p in prompt_ids]
        return np.array([r is None or self.low < r < self.high for r in rates], bool)


@dataclasses.dataclass(frozen=True)
class BanditState(SelectionState):
    """window: per task, the mean |A| of its last `window` groups; samples: per task, samples
    seen (n_j); value: per task, SEC's Q_j."""

    window: tuple[tuple[float, ...], ...] = ()
    samples: tuple[int, ...] = ()
    value: tuple[float, ...] = ()


@register_policy("bandit")
@dataclasses.dataclass(frozen=True)
class Bandit(SelectionPolicy):
    """Per-task bandits on learning progress, the mean absolute advantage |A| of a task's samples.

    ``ucb`` follows DUMP (Wang et al., *Automated Distribution-Level Curriculum Learning for
    RL-based LLM Post-training*, 2025; its released code): mu_j is the mean |A| over task j's
    sliding window, n_j its samples so far and N = sum_j n_j;

        UCB_j = mu_j + c * sqrt(2 ln(N + 1) / (n_j + 1)),     P(j) = softmax_j(UCB_j / tau)

    with c = 1, tau = 0.1 and a window of 300 samples there. Our window counts groups (each
    entry is one group's mean |A|), which equals DUMP's per-sample mean when groups have equal
    size: `window` = 300 / n.

    ``boltzmann`` follows SEC (Chen et al., *Self-Evolving Curriculum for LLM Reasoning*, 2025):
    after each batch, for every task j it drew from, r_j = mean |A| over j's groups and

        Q_j <- alpha * r_j + (1 - alpha) * Q_j   (TD(0)),     P(j) = softmax_j(Q_j / tau).

    ``thompson``: Gaussian Thompson sampling on the same windowed signal: per prompt slot draw
    theta_j ~ N(mu_j, sigma^2 / (m_j + 1)) (m_j the window's entries) and take argmax_j theta_j.
    Unseen tasks have mu_j = 0 and the widest posterior, so each is tried early.
    """

    algorithm: str = "ucb"
    window: int = 38
    exploration: float = 1.0
    temperature: float = 0.1
    learning_rate: float = 0.5
    sigma: float = 0.5

    state_type = BanditState
    ALGORITHMS = ("ucb", "boltzmann", "thompson")

    def check(self, num_tasks):
        if self.algorithm not in self.ALGORITHMS:
            raise ConfigError(f"bandit algorithm {self.algorithm!r} is unknown; choose one of "
                              f"{', '.join(self.ALGORITHMS)}")
        if self.window < 1 or self.temperature <= 0 or not 0 < self.learning_rate <= 1 or self.sigma <= 0:
            raise ConfigError("bandit needs window >= 1, temperature > 0, 0 < learning_rate <= 1 and sigma > 0")

    def init(self, num_tasks, seed):
        base = super().init(num_tasks, seed)
        return BanditState(num_tasks=num_tasks, seed=base.seed, window=((),) * num_tasks,
                           samples=(0,) * num_tasks, value=(0.0,) * num_tasks)

    def window_means(self, state) -> np.ndarray:
        return np.array([np.mean(w) if w else 0.0 for w in state.window])

    def probs(self, state):
        if self.algorithm == "ucb":
            n_j = np.asarray(state.samples, np.float64)
            bonus = self.exploration * np.sqrt(2.0 * np.log(n_j.sum() + 1.0) / (n_j + 1.0))
            return _softmax(self.window_means(state) + bonus, self.temperature)
        if self.algorithm == "boltzmann":
            return _softmax(state.value, self.temperature)
        raise ValueError("thompson sampling has no closed-form choice probabilities")

    def choose(self, state, batch_size):
        if self.algorithm != "thompson":
            return super().choose(state, batch_size)
        rng = np.random.default_rng([state.seed, state.step])
        scale_j = self.sigma / np.sqrt(np.array([len(w) for w in state.window], np.float64) + 1.0)
        theta_bj = rng.normal(self.window_means(state), scale_j, size=(batch_size, state.num_tasks))
        return np.argmax(theta_bj, axis=1).astype(np.int64), dataclasses.replace(state, step=state.step + 1)

    def update(self, state, task_ids_g, stats):
        task_ids_g = np.asarray(task_ids_g)
        window, samples, value = list(state.window), list(state.samples), list(state.value)
        for j in np.unique(task_ids_g):
            r_g = stats.abs_adv_g[task_ids_g == j]
            window[j] = (tuple(window[j]) + tuple(float(r) for r in r_g))[-self.window:]
            samples[j] += len(r_g) * stats.group_size
            value[j] = self.learning_rate * float(np.mean(r_g)) + (1.0 - self.learning_rate) * value[j]
        return dataclasses.replace(state, window=tuple(window), samples=tuple(samples), value=tuple(value))


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
            _weights(row, len(order))

    def probs(self, state):
        order = _level_order(self.levels, state.num_tasks)
        stage = int(np.searchsorted(np.asarray(self.boundaries), state.step, side="right"))
        w_level = _weights(self.stage_weights[stage], len(order))
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
        _weights(self.family_weights, len(self._names(num_tasks)))
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
        w_f = dict(zip(names, _weights(self.family_weights, len(names))))
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
