"""Built-in tools: a calculator and a sandboxed Python interpreter.

A tool maps ``(arguments, history) -> ToolOutput``. ``history`` is the tool's own state for this
episode, a tuple of strings (plain data, so an episode state pickles to any pool worker); a tool
returns the history to keep after the call. Tools never raise for bad input: a refusal, a crash, a
hang or a flood is an output with ``error=True``, shown to the model like any other output.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import secrets
from typing import Any, Mapping, Protocol, runtime_checkable

from rljax.rewards.sandbox import SandboxLimits, run_program


@dataclasses.dataclass(frozen=True)
class ToolOutput:
    """What a call produced: the text shown to the model, whether it failed, the history to keep."""

    text: str
    error: bool
    history: tuple[str, ...]


@runtime_checkable
class Tool(Protocol):
    """A named tool with one main argument (`argument`, what the tag format's body fills)."""

    name: str
    argument: str
    time_limit_s: float | None

    def schema(self) -> dict: ...

    def __call__(self, arguments: Mapping[str, Any], history: tuple[str, ...]) -> ToolOutput: ...


def _schema(name: str, description: str, argument: str, arg_description: str) -> dict:
    """An OpenAI-style function schema, what chat templates render into the system prompt."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": [argument],
                       "properties": {argument: {"type": "string", "description": arg_description}}}}}


def _argument(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    value = arguments.get(tool.argument, arguments.get("input"))
    return value if isinstance(value, str) else None


# ----------------------------------------------------------------------------- calculator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Refused(Exception):
    pass


def _digits(x: int | float) -> int:
    return len(str(abs(int(x)))) if isinstance(x, int) or math.isfinite(x) else 1


@dataclasses.dataclass(frozen=True)
class Calculator:
    """Arithmetic on numbers with ``+ - * / // % **`` (``^`` and ``×`` are read as ``**`` and
    ``*``) and parentheses, evaluated by walking Python's ``ast``, never ``eval``.

    Integers stay exact and may be big, up to `max_digits` digits: a product or power whose result
    would be longer is refused *before* it is computed (``a*b`` has at most
    ``digits(a) + digits(b)`` digits; ``a**b`` about ``b * log10|a|``), so ``9**9**9`` costs
    nothing. ``int / int`` that divides exactly prints as an integer. Anything else (names, calls,
    strings, attributes) is refused with an error output.
    """

    max_digits: int = 100
    max_chars: int = 256
    name: str = "calculator"
    argument: str = "expression"
    time_limit_s: float | None = None  # bounded by construction: runs inline

    def schema(self) -> dict:
        return _schema(self.name, "Evaluates an arithmetic expression exactly.", self.argument,
                       "e.g. 123 * 456")

    def __call__(self, arguments: Mapping[str, Any], history: tuple[str, ...] = ()) -> ToolOutput:
        expr = _argument(self, arguments)
        if expr is None:
            return ToolOutput(f"error: pass the expression as {self.argument!r}", True, history)
        return ToolOutput(*self.evaluate(expr), history)

    def evaluate(self, expr: str) -> tuple[str, bool]:
        """``(result text, error)`` for one expression."""
        if len(expr) > self.max_chars:
            return f"error: expression longer than {self.max_chars} characters", True
        try:
            tree = ast.parse(expr.replace("×", "*").replace("^", "**").strip(), mode="eval")
            value = self._eval(tree.body)
        except _Refused as e:
            return f"error: {e}", True
        except ZeroDivisionError:
            return "error: division by zero", True
        except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError) as e:
            return f"error: {type(e).__name__}: {e}"[:200], True
        if isinstance(value, float):
            if not math.isfinite(value):
                return "error: result is not finite", True
            return (str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)), False
        return str(value), False

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = self._eval(node.left), self._eval(node.right)
            op = type(node.op)
            if op is ast.Mult and _digits(a) + _digits(b) > self.max_digits + 1:
                raise _Refused(f"result longer than {self.max_digits} digits")
            if op is ast.Pow:
                if abs(b) > 10 * self.max_digits + 10 or (
                        abs(a) > 1 and b > 0 and b * math.log10(abs(a)) > self.max_digits):
                    raise _Refused(f"result longer than {self.max_digits} digits")
            if op is ast.Div and isinstance(a, int) and isinstance(b, int) and b and a % b == 0:
                return a // b
            value = _BINARY[op](a, b)
            if isinstance(value, complex):
                raise _Refused("result is not a real number")
            if isinstance(value, int) and _digits(value) > self.max_digits:
                raise _Refused(f"result longer than {self.max_digits} digits")
            return value
        raise _Refused("only numbers, + - * / // % ** and parentheses are allowed")


# ----------------------------------------------------------------------------- python

# The cell's program. No `traceback` import: it calls sys._getframe, which the audit hook refuses.
_PROGRAM = '''\
import io as _io, sys as _sys
_scope = {{"__name__": "__main__"}}
_real, _sys.stdout = _sys.stdout, _io.StringIO()
for _cell in {history!r}:
    try:
        exec(compile(_cell, "<cell>", "exec"), _scope)
    except BaseException:
        pass
    _sys.stdout.seek(0)
    _sys.stdout.truncate()
_sys.stdout = _real
print({marker!r}, flush=True)
try:
    exec(compile({cell!r}, "<cell>", "exec"), _scope)
except SystemExit:
    pass
except BaseException as _e:
    print(type(_e).__name__ + ": " + str(_e), flush=True)
    raise SystemExit(1)
'''


@dataclasses.dataclass(frozen=True)
class PythonTool:
    """Runs a code cell in the code verifier's sandbox (`rljax.rewards.run_program`: its own process,
    namespaces, rlimits and audit hook) and shows the cell's stdout, or its exception's last line.

    State across turns is kept by replay: the history is the episode's earlier cells that ran
    without error, and each call runs them again, with their output discarded, before the new
    cell. We chose replay over a long-lived interpreter per episode because the state is then plain
    data: any pool worker can run any turn, a worker killed at its time limit loses nothing, and no
    sandbox process outlives its call. The costs: earlier cells run again (episodes are a few
    short turns), the wall limit covers the replay too, and a cell that failed is not kept, so
    its side effects before the error are gone (the model sees the error and writes the cell
    again). Replayed cells must be deterministic for the state to be the same; seeded randomness is.

    Output beyond `max_output_chars` is cut and marked; a flood past the sandbox's byte cap is
    killed and shown as cut; a cell out of CPU or wall time shows a time-limit error.
    """

    limits: SandboxLimits = SandboxLimits(cpu_s=2, wall_s=5.0, memory_mb=512, output_bytes=1 << 14)
    max_output_chars: int = 512
    name: str = "python"
    argument: str = "code"

    @property
    def time_limit_s(self) -> float:
        """The pool's backstop: the sandbox kills at ``limits.wall_s``; 5 s more covers start-up."""
        return min(self.limits.wall_s, self.limits.total_s) + 5.0

    def schema(self) -> dict:
        return _schema(self.name, "Runs a Python cell; variables persist across calls; prints stdout.",
                       self.argument, "Python source; print what you want to see")

    def __call__(self, arguments: Mapping[str, Any], history: tuple[str, ...] = ()) -> ToolOutput:
        cell = _argument(self, arguments)
        if cell is None:
            return ToolOutput(f"error: pass the code as {self.argument!r}", True, history)
        marker = "rljax-cell-" + secrets.token_hex(8)
        run = run_program(_PROGRAM.format(history=tuple(history), marker=marker, cell=cell),
                          limits=self.limits)
        _, found, out = run.stdout.partition(marker + "\n")
        out = out if found else ""
        if run.flag == "output_limit":
            return ToolOutput(self._cut(out, force=True), True, history)
        if run.flag is not None:  # out of time (wall clock, or CPU: killed by a signal)
            wall = min(self.limits.wall_s, self.limits.total_s)
            return ToolOutput(self._cut(out) + f"error: the cell was stopped ({run.flag}; limits "
                              f"{self.limits.cpu_s} s CPU, {wall:g} s wall)", True, history)
        if not found:  # the replay itself died before the new cell started
            return ToolOutput("error: the earlier cells could not be run again", True, history)
        if run.returncode != 0:
            return ToolOutput(self._cut(out), True, history)
        return ToolOutput(self._cut(out), False, (*history, cell))

    def _cut(self, text: str, force: bool = False) -> str:
        if len(text) <= self.max_output_chars and not force:
            return text
        return text[:self.max_output_chars] + "\n[output truncated]\n"
