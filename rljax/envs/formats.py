"""Tool-call formats: how a model turn becomes a tool call, a final answer or a void turn, and how a
tool's output is written back into the conversation.

A turn is what the model wrote since the last observation; the sampler stops it at the format's
`ToolFormat.stop_sequence` (the end of a tool call), at end-of-sequence, or at a token budget.
`ToolFormat.parse` sorts it, in this order:

1. a complete call (open tag ... close tag) -> ``"tool_call"``; a call whose body is not a valid
   call (neither JSON nor a Python dict literal, no ``name``) is still a call, carrying ``error``,
   so the model gets an error observation it can learn from;
2. an open tag with no close tag (the model ran out of budget mid-call) -> ``"void"``;
3. an answer found by `rljax.rewards.extract_answer` with the task's methods -> ``"answer"``;
4. anything else -> ``"void"``: SimpleTIR's void turn (Xue et al., 2025), neither a complete tool
   call nor a final answer.

Three formats, all registered in `FORMATS`:

- ``tags``: ``<tool>BODY</tool>`` and ``<result>OUTPUT</result>``, a few characters for tiny
  char-level models; the body is the default tool's one argument (an expression, a code cell).
- ``qwen``: Qwen2.5's chat template. The assistant writes
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; the template renders the result
  as a *user* turn, ``<|im_start|>user\\n<tool_response>\\nOUTPUT\\n</tool_response><|im_end|>``,
  then opens the next assistant turn.
- ``hermes``: NousResearch's Hermes-2-Pro function calling: the same ``<tool_call>`` JSON, but the
  result comes in a ``tool`` role turn whose body is ``{"name": ..., "content": OUTPUT}``.

In the chat formats the observation also closes the model's turn (``<|im_end|>``) and opens the
next one (``<|im_start|>assistant``): those tokens are the environment's, so they get no gradient.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from typing import Any, Literal, Mapping

from rljax.errors import ConfigError
from rljax.rewards.extract import extract_answer

TurnKind = Literal["tool_call", "answer", "void"]
TURN_KINDS: tuple[TurnKind, ...] = ("tool_call", "answer", "void")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One complete tool call.

    name: the tool asked for; None in the tag format, which calls the environment's default tool.
    arguments: the JSON arguments; in the tag format ``{"input": body}``.
    error: why the call cannot run (bad JSON, missing name), or None.
    """

    name: str | None
    arguments: Mapping[str, Any]
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A model turn, sorted: exactly one of `call` (kind "tool_call") and `answer` (kind "answer")
    is set, or neither (kind "void")."""

    kind: TurnKind
    call: ToolCall | None = None
    answer: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """The text around tool calls and their results in one chat format.

    call_open / call_close: delimit a call; `call_close` is the sampler's stop sequence.
    observation_prefix / observation_suffix: written by the environment around a tool's output;
      with `call_close` before them, they make the text the template renders for the exchange.
    json_calls: the call body is ``{"name", "arguments"}`` JSON (else the raw text is the input).
    wrap_name: the output is rendered as ``{"name": tool, "content": output}`` JSON (Hermes).
    end_of_turn: the text a model writes to end its turn, stripped before looking for an answer.
    """

    name: str
    call_open: str
    call_close: str
    observation_prefix: str
    observation_suffix: str
    json_calls: bool
    wrap_name: bool = False
    end_of_turn: str = ""

    @property
    def stop_sequence(self) -> str:
        """Where the sampler stops a turn that calls a tool."""
        return self.call_close

    def parse(self, turn_text: str, answer_methods: tuple[str, ...] = ("answer_tag", "final_line")
              ) -> ParsedTurn:
        """Sorts a model turn into a call, an answer or a void turn (see the module doc); never raises."""
        start = turn_text.find(self.call_open)
        if start >= 0:
            end = turn_text.find(self.call_close, start + len(self.call_open))
            if end < 0:
                return ParsedTurn("void")  # a call cut off mid-way
            body = turn_text[start + len(self.call_open):end]
            return ParsedTurn("tool_call", call=self._call(body))
        answer, _ = extract_answer(self.content(turn_text), answer_methods)
        return ParsedTurn("answer", answer=answer) if answer else ParsedTurn("void")

    def content(self, turn_text: str) -> str:
        """The turn without the format's end-of-turn text (what a verifier should read)."""
        text = turn_text.rstrip()
        if self.end_of_turn and text.endswith(self.end_of_turn):
            return text[:-len(self.end_of_turn)]
        return turn_text

    def _call(self, body: str) -> ToolCall:
        if not self.json_calls:
            return ToolCall(None, {"input": body.strip()})
        try:
            obj = json.loads(body)
        except ValueError as e:
            obj = _python_literal(body)
            if obj is None:
                return ToolCall(None, {}, f"the tool call is not valid JSON ({e})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall(None, {}, 'the tool call needs {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            return ToolCall(obj["name"], {}, "the tool call's arguments must be a JSON object")
        return ToolCall(obj["name"], args)

    def render_call(self, name: str | None, arguments: Mapping[str, Any]) -> str:
        """The text of a call as the model is meant to write it (inverse of `parse`)."""
        if not self.json_calls:
            return f"{self.call_open}{arguments['input']}{self.call_close}"
        body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
        return f"{self.call_open}\n{body}\n{self.call_close}"

    def render_observation(self, output: str, tool_name: str | None = None) -> str:
        """The text the environment appends after a call: prefix, the tool's output, suffix."""
        if self.wrap_name:
            output = json.dumps({"name": tool_name, "content": output}, ensure_ascii=False)
        return f"{self.observation_prefix}{output}{self.observation_suffix}"


def _python_literal(body: str) -> dict | None:
    """A call written as a Python dict literal (Hermes-2-Pro's own examples use single quotes);
    `ast.literal_eval` builds only literals, never calls anything."""
    try:
        obj = ast.literal_eval(body.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


FORMATS: dict[str, ToolFormat] = {
    "tags": ToolFormat("tags", "<tool>", "</tool>", "<result>", "</result>", json_calls=False),
    "qwen": ToolFormat("qwen", "<tool_call>", "</tool_call>",
                       "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                       "\n</tool_response><|im_end|>\n<|im_start|>assistant\n", json_calls=True,
                       end_of_turn="<|im_end|>"),
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>",
                         "<|im_end|>\n<|im_start|>tool\n<tool_response>\n",
                         "\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n", json_calls=True,
                         wrap_name=True, end_of_turn="<|im_end|>"),
}


def get_format(name: str | ToolFormat) -> ToolFormat:
    """A registered format by name (a `ToolFormat` passes through); one-line ConfigError otherwise."""
    if isinstance(name, ToolFormat):
        return name
    if name not in FORMATS:
        raise ConfigError(f"unknown tool-call format {name!r}; choose one of {', '.join(sorted(FORMATS))}")
    return FORMATS[name]
