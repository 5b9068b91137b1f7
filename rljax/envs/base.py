"""The environment protocol: episodes where the model's turns alternate with observations.

An environment is host-side Python, like a verifier. It starts an episode from an example and
answers each model turn::

    state, first_text = env.reset(example)
    state, result = env.step(state, action_text)     # result: StepResult

``action_text`` is what the model wrote since the last observation; ``result.observation_text``
is what the environment appends to the conversation (a tool's output in the chat format's
wrapping), ``result.reward`` the reward of this turn, ``result.done`` whether the episode ended.
States are plain, picklable data: `rljax.envs.step_batch` sends them to the verifier pool, so a
tool that hangs is killed at ``env.time_limit_s`` and the episode goes on with
``env.on_error(state, action_text, message)``, an error observation.

Environments register by name (`register_env`) and are built from config by `make_env`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Protocol, runtime_checkable

from rljax.envs.formats import TurnKind
from rljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn.

    observation_text: text to append after the turn ("" when the episode ended).
    reward: this turn's reward: the per-turn reward, plus the answer's score on an answer turn.
    done: the episode ended (an answer, a void turn, or the turn limit).
    kind: how the turn was read: "tool_call", "answer" or "void".
    tool_error: the tool call failed (a bad call, a refusal, a crash, a hang, a flood), or the step
      itself failed in the pool (then ``info["flag"]`` is the pool's "error" or "timeout").
    info: details for logs (the tool's name, the extracted answer, the pool's flag...).
    """

    observation_text: str
    reward: float
    done: bool
    kind: TurnKind
    tool_error: bool = False
    info: dict = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """What `step_batch` and the rollout need from an environment.

    ``time_limit_s``: wall-clock limit of one `step` in a pool worker; None runs steps inline (only
    for steps that are cheap and cannot hang). ``on_error`` must be cheap and pure: it runs inline
    when a pooled step crashed or timed out, and returns the state after a failed turn.
    """

    name: str
    time_limit_s: float | None

    def reset(self, example: Any) -> tuple[Any, str]: ...

    def step(self, state: Any, action_text: str) -> tuple[Any, StepResult]: ...

    def on_error(self, state: Any, action_text: str, message: str) -> tuple[Any, StepResult]: ...


# A plain table rather than `rljax.objectives.Registry`: importing rljax.objectives loads jax, and
# every pool worker that unpickles an environment imports this module.
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


def register_env(name: str) -> Callable:
    """Decorator: ``@register_env("calculator")`` on a factory ``(**options) -> Environment``."""
    def add(factory: Callable[..., Environment]) -> Callable[..., Environment]:
        if name in ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is registered twice")
        ENVIRONMENTS[name] = factory
        return factory
    return add


def make_env(name: str, **options: Any) -> Environment:
    """The environment registered as ``name``, built with ``options`` (the config's env section).

    Unknown names and options raise a one-line `ConfigError` naming what is known.
    """
    if name not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {name!r}; choose one of {', '.join(sorted(ENVIRONMENTS))}")
    factory = ENVIRONMENTS[name]
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise ConfigError(f"environment {name!r} has no option {unknown[0]!r}; "
                              f"its options are {', '.join(params)}")
    return factory(**options)
