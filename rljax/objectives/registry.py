"""Name -> function registries: an algorithm is picked by config, never by an if/elif chain.

Each registry knows its own valid names, so config validation and error messages are driven
from the registry and cannot drift from what is implemented. An entry also declares what it
reads, so what an algorithm needs is read off its entries rather than kept in side lists:

- `needs`: data the rollout or the update must produce for it (`ROLLOUT_NEEDS`): ReMax's
  estimator needs a greedy baseline, GAE needs a value model, a distillation objective
  (`DISTILLATION`) the teacher's log-probs. `AlgorithmConfig.needs` collects them (with the
  coefficients'), and the rollout and update step ask it instead of special-casing an algorithm.
- `reads`: optional rollout fields the entry consumes when a rollout attaches them
  (`ROLLOUT_READS`): grpo and dr_grpo read `turn_returns` (multi-turn turn-level credit); the
  update refuses such a field for an entry that does not read it (`check_turn_credit`).
- `params`: the `AlgorithmConfig` fields the entry reads (gae: gamma and lam). A neutral-valued
  field an entry does not read (gamma or lam != 1 on a sequence-level estimator) is a config
  error rather than a silently ignored setting.

- `selects`: a policy loss that acts on tokens chosen over the whole mini-batch (Clip-Cov,
  KL-Cov) declares its selection, fn(logp_bt, old_logp_bt, adv_bt, mask_bt, key, algo) ->
  select_bt; the update step scores the mini-batch without gradients, calls it once per
  mini-batch with the update's key, and hands the loss `select_bt` (`rljax.update.controls`).

Only advantage estimators and distillation objectives declare needs and reads (they are what
receives the rollout's optional fields); every registry's entries declare params.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from rljax.errors import ConfigError

F = TypeVar("F", bound=Callable)

# What an objective piece can ask of a rollout (see `rljax.objectives.config.RolloutNeeds`).
# teacher_logp: a frozen teacher's log-prob (and top-1) of each sampled token; teacher_hidden: its
# final hidden states, for a loss over its whole next-token distribution.
ROLLOUT_NEEDS = ("greedy_baseline", "values", "reference_logp", "teacher_logp", "teacher_hidden")

# Optional rollout fields an entry may read when present (the `rljax.update.RolloutBatch` field
# names). turn_returns: multi-turn episodes' per-turn returns (`env.credit = "turn"`).
ROLLOUT_READS = ("turn_returns",)


class Registry(Generic[F]):
    """A named table of pure functions of one kind (advantage estimators, policy losses, ...)."""

    def __init__(self, kind: str, *, accepts_needs: bool = False):
        self.kind = kind
        self.accepts_needs = accepts_needs
        self._fns: dict[str, F] = {}
        self._needs: dict[str, frozenset[str]] = {}
        self._reads: dict[str, frozenset[str]] = {}
        self._params: dict[str, frozenset[str]] = {}
        self._selects: dict[str, Callable | None] = {}

    def register(self, name: str, *, needs: tuple[str, ...] = (), reads: tuple[str, ...] = (),
                 params: tuple[str, ...] = (), selects: Callable | None = None) -> Callable[[F], F]:
        """Decorator: `@ADVANTAGES.register("gae", needs=("values",), params=("gamma", "lam"))`
        adds the function under `name`, with what it needs produced (names in `ROLLOUT_NEEDS`),
        the optional rollout fields it reads (`ROLLOUT_READS`) and the `AlgorithmConfig` fields
        it reads."""
        if (needs or reads) and not self.accepts_needs:
            raise ValueError(f"a {self.kind} cannot declare rollout needs or reads (only advantage estimators and "
                             "distillation objectives receive the rollout's optional fields)")
        for declared, known, what in ((needs, ROLLOUT_NEEDS, "needs"), (reads, ROLLOUT_READS, "reads")):
            unknown = set(declared) - set(known)
            if unknown:
                raise ValueError(f"{self.kind} {name!r} {what} unknown rollout data {sorted(unknown)}; "
                                 f"known: {', '.join(known)}")

        def add(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._fns[name] = fn
            self._needs[name] = frozenset(needs)
            self._reads[name] = frozenset(reads)
            self._params[name] = frozenset(params)
            self._selects[name] = selects
            return fn
        return add

    def needs(self, name: str) -> frozenset[str]:
        """What the entry `name` needs from the rollout (empty for most)."""
        self.get(name)
        return self._needs[name]

    def reads(self, name: str) -> frozenset[str]:
        """The optional rollout fields the entry `name` reads when present (empty for most)."""
        self.get(name)
        return self._reads[name]

    def params(self, name: str) -> frozenset[str]:
        """The `AlgorithmConfig` fields the entry `name` reads."""
        self.get(name)
        return self._params[name]

    def selects(self, name: str) -> Callable | None:
        """The entry's mini-batch token selection (see the module docstring), or None."""
        self.get(name)
        return self._selects[name]

    def reading(self, field: str) -> tuple[str, ...]:
        """The entries that read the rollout field `field`, sorted (for error messages)."""
        return tuple(n for n in self.names() if field in self._reads[n])

    def declaring(self, param: str) -> tuple[str, ...]:
        """The entries that read the config field `param`, sorted (for error messages)."""
        return tuple(n for n in self.names() if param in self._params[n])

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
