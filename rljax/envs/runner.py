"""Advancing a batch of episodes one turn, through the verifier pool and its time limits.

This is what the multi-turn rollout calls between decoding segments (from an ``io_callback`` or a
short host loop): every row whose model turn just ended gets its step run in a `VerifierPool`
worker, killed at ``env.time_limit_s``. A step that raises, hangs or kills its worker becomes
``env.on_error(...)``, an error observation with ``info["flag"]`` set to ``"error"`` or
``"timeout"``, so a bad tool costs at most its limit and never stops training. Environments with
``time_limit_s = None`` step inline (their steps are cheap and cannot hang), exceptions caught alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rljax.envs.base import Environment, StepResult
from rljax.errors import ConfigError
from rljax.rewards.pool import Task, VerifierPool, default_pool


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """States after the turn, and each row's `StepResult` (None for rows that were not stepped)."""

    states: list[Any]
    results: list[StepResult | None]


def reset_batch(env: Environment, examples: Sequence[Any]) -> tuple[list[Any], list[str]]:
    """``env.reset`` for each example: (states, first observation texts). Resets run inline."""
    pairs = [env.reset(ex) for ex in examples]
    return [s for s, _ in pairs], [t for _, t in pairs]


def step_batch(env: Environment, states: Sequence[Any], actions: Sequence[str | None], *,
               pool: VerifierPool | None = None) -> StepBatch:
    """One turn for every row whose action is a string; rows with action None are left as they are.

    ``pool`` defaults to the process-wide `default_pool` (``VerifierPool(0)`` runs inline, with no
    isolation and no time limit: for debugging only).
    """
    if len(states) != len(actions):
        raise ConfigError(f"got {len(states)} episode states for {len(actions)} actions; pass one each")
    new_states, results = list(states), [None] * len(states)
    rows = [i for i, a in enumerate(actions) if a is not None]
    if env.time_limit_s is None:
        for i in rows:
            new_states[i], results[i] = _inline(env, states[i], actions[i])
        return StepBatch(new_states, results)
    tasks = [Task(_step, (env, states[i], actions[i]), float(env.time_limit_s)) for i in rows]
    for i, out in zip(rows, (pool or default_pool()).run(tasks)):
        if out.flag is None:
            new_states[i], results[i] = out.value
        else:
            new_states[i], results[i] = _failed(env, states[i], actions[i], out.flag, out.message)
    return StepBatch(new_states, results)


def _step(env: Environment, state: Any, action: str) -> tuple[Any, StepResult]:
    return env.step(state, action)


def _inline(env: Environment, state: Any, action: str) -> tuple[Any, StepResult]:
    try:
        return env.step(state, action)
    except Exception as e:  # noqa: BLE001  # same contract as a pooled step
        return _failed(env, state, action, "error", f"{type(e).__name__}: {e}"[:500])


def _failed(env: Environment, state: Any, action: str, flag: str, message: str) -> tuple[Any, StepResult]:
    what = f"the tool timed out ({message})" if flag == "timeout" else f"the tool failed ({message})"
    new_state, result = env.on_error(state, action, what)
    return new_state, dataclasses.replace(result, tool_error=True, info={**result.info, "flag": flag})
