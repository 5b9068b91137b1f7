"""Name -> function registries: an algorithm is picked by config, never by an if/elif chain.

Each registry knows its own valid names, so config validation and error messages are driven
from the registry and cannot drift from what is implemented. An entry also declares what it
needs from the rollout beyond tokens, log-probs and rewards (`ROLLOUT_NEEDS`; only advantage
estimators declare needs, since they are what receives the optional fields): ReMax's estimator
needs a greedy baseline, GAE needs a value model. `AlgorithmConfig.needs` collects them, and the
rollout and update step ask it instead of special-casing an algorithm. A distillation objective
(`DISTILLATION`) declares what it needs of the teacher the same way.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from rljax.errors import ConfigError

F = TypeVar("F", bound=Callable)

# What an objective piece can ask of a rollout (see `rljax.objectives.config.RolloutNeeds`).
# teacher_logp: a frozen teacher's log-prob (and top-1) of each sampled token; teacher_hidden: its
# final hidden states, for a loss over its whole next-token distribution.
ROLLOUT_NEEDS = ("greedy_baseline", "values", "reference_logp", "teacher_logp", "teacher_hidden")


class Registry(Generic[F]):
    """A named table of pure functions of one kind (advantage estimators, policy losses, ...)."""

    def __init__(self, kind: str, *, accepts_needs: bool = False):
        self.kind = kind
        self.accepts_needs = accepts_needs
        self._fns: dict[str, F] = {}
        self._needs: dict[str, frozenset[str]] = {}

    def register(self, name: str, *, needs: tuple[str, ...] = ()) -> Callable[[F], F]:
        """Decorator: `@ADVANTAGES.register("remax", needs=("greedy_baseline",))` adds the
        function under `name`, with what it needs from the rollout (names in `ROLLOUT_NEEDS`)."""
        if needs and not self.accepts_needs:
            raise ValueError(f"a {self.kind} cannot declare rollout needs (only advantage estimators and "
                             "distillation objectives receive the rollout's optional fields)")
        unknown = set(needs) - set(ROLLOUT_NEEDS)
        if unknown:
            raise ValueError(f"{self.kind} {name!r} needs unknown rollout data {sorted(unknown)}; "
                             f"known: {', '.join(ROLLOUT_NEEDS)}")

        def add(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._fns[name] = fn
            self._needs[name] = frozenset(needs)
            return fn
        return add

    def needs(self, name: str) -> frozenset[str]:
        """What the entry `name` needs from the rollout (empty for most)."""
        self.get(name)
        return self._needs[name]

    def get(self, name: str) -> F:
        """The function registered as `name`; a one-line ConfigError listing valid names otherwise."""
        if name not in self._fns:
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}")
        return self._fns[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._fns))

    def __contains__(self, name: str) -> bool:
        return name in self._fns

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"


ADVANTAGES: Registry = Registry("advantage estimator", accepts_needs=True)
POLICY_LOSSES: Registry = Registry("policy loss")
KL_ESTIMATORS: Registry = Registry("KL estimator")
AGGREGATIONS: Registry = Registry("loss aggregation")
OFF_POLICY: Registry = Registry("off-policy correction")
DISTILLATION: Registry = Registry("distillation objective", accepts_needs=True)
