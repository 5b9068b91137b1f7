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

Registered policies (`POLICIES`): here ``uniform`` (by weight), ``band`` (online difficulty
filtering per prompt) and ``bandit`` (DUMP's UCB, SEC's Boltzmann TD(0), Gaussian Thompson
sampling); in `rljax.data.curriculum`, which the `rljax.data` package imports so the registry is
complete wherever it is read, the level-ordered ``schedule`` (a piecewise easy-to-hard schedule
over difficulty levels) and ``auto_curriculum`` (start where the pass rate is in a band, move up
when it is mastered).
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


def normalized_weights(weights: Sequence[float] | None, num_tasks: int) -> np.ndarray:
    """``w / sum w`` (equal when `weights` is None); ConfigError unless `num_tasks` non-negative
    numbers with a positive sum."""
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
        normalized_weights(self.weights, num_tasks)

    def probs(self, state):
        return normalized_weights(self.weights, state.num_tasks)


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
        normalized_weights(self.weights, num_tasks)
        if not 0.0 <= self.low < self.high <= 1.0:
            raise ConfigError(f"band needs 0 <= low < high <= 1, got low={self.low}, high={self.high}")
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"band decay={self.decay} must be in [0, 1)")

    def probs(self, state):
        return normalized_weights(self.weights, state.num_tasks)

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
