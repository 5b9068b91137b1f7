"""`ToolEnv`: a task whose model may call tools before it answers; the built-in environments.

Each model turn is read by the chat format (`rljax.envs.formats`):

- a tool call runs the tool and shows its output (``reward = turn_reward``); an error (bad call,
  unknown tool, refusal, crash) is an output too, flagged ``tool_error``;
- an answer is scored by the task's verifier and ends the episode
  (``reward = turn_reward + score``);
- a void turn ends the episode (``reward = turn_reward``);
- the ``max_turns``-th turn ends the episode whatever it is; a call made then is not run.

``turn_reward(parsed_turn, tool_error) -> float`` is the per-turn reward hook (default 0 for every
turn); it must be a module-level function so the environment pickles to pool workers.

Registered environments (`make_env`): ``calculator`` and ``python`` (scored by math-verify against
the example's answer), and ``reasoning_gym_tool`` (scored by the reasoning-gym task's own
``score_answer``, with the calculator or the Python tool).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping

from rljax.envs.base import StepResult, register_env
from rljax.envs.formats import ParsedTurn, ToolFormat, get_format
from rljax.envs.tools import Calculator, PythonTool, Tool, ToolOutput
from rljax.errors import ConfigError
from rljax.rewards.base import Verifier
from rljax.rewards.math import MathAnswer
from rljax.rewards.reasoning import ReasoningGymAnswer
from rljax.rewards.sandbox import SandboxLimits

if TYPE_CHECKING:
    from rljax.data.example import Example

TurnReward = Callable[[ParsedTurn, bool], float]
DEFAULT_ANSWER_METHODS = ("answer_tag", "final_line")


@dataclasses.dataclass(frozen=True)
class ToolEpisode:
    """One episode's state: what the scorer reads, the turns taken, and each tool's kept history."""

    metadata: Mapping[str, Any]
    turn: int = 0
    done: bool = False
    histories: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ToolEnv:
    """An `Environment` with tools, a chat format, an answer verifier and a turn limit.

    tools: the first is the default, called by the tag format (which names no tool).
    scorer: a verifier ``(metadata, final_turn_text) -> (score, info)``, run inside the step.
    """

    tools: tuple[Tool, ...]
    format: ToolFormat
    scorer: Verifier
    answer_methods: tuple[str, ...] = DEFAULT_ANSWER_METHODS
    max_turns: int = 4
    turn_reward: TurnReward | None = None
    name: str = "tool_env"

    def __post_init__(self) -> None:
        if not self.tools:
            raise ConfigError(f"environment {self.name!r} needs at least one tool")
        if self.max_turns < 1:
            raise ConfigError(f"max_turns must be >= 1, got {self.max_turns}")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ConfigError(f"tool names {names} repeat; give each tool its own name")

    @property
    def time_limit_s(self) -> float | None:
        """A step runs one tool or the scorer: the longest of their limits (None if all run inline)."""
        limits = [t.time_limit_s for t in self.tools] + [self.scorer.time_limit_s]
        known = [x for x in limits if x is not None]
        return max(known) if known else None

    def tool_schemas(self) -> list[dict]:
        """The tools as OpenAI-style schemas, for a chat template's ``tools=`` argument."""
        return [t.schema() for t in self.tools]

    def reset(self, example: Example | Mapping[str, Any]) -> tuple[ToolEpisode, str]:
        """A new episode; the first observation is the question (the prompt template formats it)."""
        if isinstance(example, Mapping):
            return ToolEpisode(dict(example)), str(example.get("question", ""))
        from rljax.data.example import verifier_metadata  # lazy: rljax.data loads jax

        return ToolEpisode(verifier_metadata(example)), example.question

    def step(self, state: ToolEpisode, action_text: str) -> tuple[ToolEpisode, StepResult]:
        if state.done:
            raise ValueError("step() called on a finished episode")
        parsed = self.format.parse(action_text, self.answer_methods)
        turn = state.turn + 1
        last = turn >= self.max_turns
        info: dict = {}
        observation, tool_error, score, histories = "", False, 0.0, state.histories
        if parsed.kind == "tool_call" and last:
            info["truncated"] = "max_turns"
        elif parsed.kind == "tool_call":
            tool, output = self._call(parsed, state.histories)
            tool_error = output.error
            info["tool"] = tool.name if tool else None
            histories = {**state.histories, tool.name: output.history} if tool else histories
            observation = self.format.render_observation(output.text, info["tool"])
        elif parsed.kind == "answer":
            try:
                score, info["score"] = self.scorer(state.metadata, self.format.content(action_text))
            except Exception as e:  # noqa: BLE001  # a crashing scorer scores 0, like a verifier
                score, info["score"] = 0.0, {"flag": "error", "message": f"{type(e).__name__}: {e}"[:500]}
        done = last or parsed.kind != "tool_call"
        reward = self._turn_reward(parsed, tool_error) + float(score)
        return (dataclasses.replace(state, turn=turn, done=done, histories=histories),
                StepResult(observation, reward, done, parsed.kind, tool_error, info))

    def on_error(self, state: ToolEpisode, action_text: str, message: str) -> tuple[ToolEpisode, StepResult]:
        """The turn after a step that crashed or hung in the pool: an error observation, no state change."""
        parsed = self.format.parse(action_text, self.answer_methods)
        turn = state.turn + 1
        done = turn >= self.max_turns or parsed.kind != "tool_call"
        tool = self._tool(parsed.call.name) if parsed.call else None
        observation = "" if done else self.format.render_observation(
            f"error: {message}", tool.name if tool else None)
        reward = self._turn_reward(parsed, True)
        return (dataclasses.replace(state, turn=turn, done=done),
                StepResult(observation, reward, done, parsed.kind, True, {"message": message}))

    def _tool(self, name: str | None) -> Tool | None:
        if name is None:
            return self.tools[0]
        return next((t for t in self.tools if t.name == name), None)

    def _call(self, parsed: ParsedTurn, histories: Mapping[str, tuple[str, ...]]
              ) -> tuple[Tool | None, ToolOutput]:
        call = parsed.call
        tool = self._tool(call.name)
        if call.error:
            kept = histories.get(tool.name, ()) if tool else ()
            return tool, ToolOutput(f"error: {call.error}", True, kept)
        if tool is None:
            known = ", ".join(t.name for t in self.tools)
            return None, ToolOutput(f"error: unknown tool {call.name!r}; tools: {known}", True, ())
        history = histories.get(tool.name, ())
        try:
            return tool, tool(call.arguments, history)
        except Exception as e:  # noqa: BLE001  # a tool bug is the model's observation, not a crash
            return tool, ToolOutput(f"error: {type(e).__name__}: {e}"[:500], True, history)

    def _turn_reward(self, parsed: ParsedTurn, tool_error: bool) -> float:
        return 0.0 if self.turn_reward is None else float(self.turn_reward(parsed, tool_error))


def _limits(limits: SandboxLimits | Mapping[str, Any] | None) -> SandboxLimits:
    if limits is None:
        return PythonTool().limits
    return limits if isinstance(limits, SandboxLimits) else SandboxLimits(**limits)


def _make_tool(tool: str, max_digits: int, limits: SandboxLimits | Mapping[str, Any] | None) -> Tool:
    if tool == "calculator":
        return Calculator(max_digits=max_digits)
    if tool == "python":
        return PythonTool(limits=_limits(limits))
    raise ConfigError(f"unknown tool {tool!r}; choose calculator or python")


@register_env("calculator")
def calculator_env(format: str = "tags", max_turns: int = 4,
                   answer_methods: tuple[str, ...] = DEFAULT_ANSWER_METHODS, max_digits: int = 100,
                   turn_reward: TurnReward | None = None, scorer_time_limit_s: float = 5.0) -> ToolEnv:
    """Calculator tool; the answer is checked by math-verify against the example's answer."""
    return ToolEnv((Calculator(max_digits=max_digits),), get_format(format),
                   MathAnswer(methods=tuple(answer_methods), time_limit_s=scorer_time_limit_s),
                   tuple(answer_methods), max_turns, turn_reward, "calculator")


@register_env("python")
def python_env(format: str = "qwen", max_turns: int = 4,
               answer_methods: tuple[str, ...] = ("boxed", "answer_tag", "final_line"),
               limits: SandboxLimits | Mapping[str, Any] | None = None,
               turn_reward: TurnReward | None = None, scorer_time_limit_s: float = 5.0) -> ToolEnv:
    """Python tool in the code sandbox; the answer is checked by math-verify."""
    return ToolEnv((PythonTool(limits=_limits(limits)),), get_format(format),
                   MathAnswer(methods=tuple(answer_methods), time_limit_s=scorer_time_limit_s),
                   tuple(answer_methods), max_turns, turn_reward, "python")


@register_env("reasoning_gym_tool")
def reasoning_gym_tool_env(tool: str = "calculator", format: str = "tags", max_turns: int = 4,
                           answer_methods: tuple[str, ...] = DEFAULT_ANSWER_METHODS,
                           max_digits: int = 100, limits: SandboxLimits | Mapping[str, Any] | None = None,
                           turn_reward: TurnReward | None = None,
                           scorer_time_limit_s: float = 5.0) -> ToolEnv:
    """A reasoning-gym task with a tool: the answer is scored by the task's own ``score_answer``."""
    return ToolEnv((_make_tool(tool, max_digits, limits),), get_format(format),
                   ReasoningGymAnswer(methods=tuple(answer_methods), time_limit_s=scorer_time_limit_s),
                   tuple(answer_methods), max_turns, turn_reward, "reasoning_gym_tool")
