"""SimpleTIR's void-turn filter and per-episode counts, as pure functions of what the episodes did.

SimpleTIR (Xue et al., 2025) finds that multi-turn tool-integrated RL blows up through *void
turns*: model turns with neither a complete tool call nor a final answer (a turn cut off mid-call,
or rambling that ends without either). Its fix is to drop from the loss every trajectory that
contains one; the dropped share is reported as a metric, so a run that filters most of its
samples shows it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rljax.envs.base import StepResult
from rljax.envs.formats import TURN_KINDS


def trajectory_has_void_turn(turn_kinds: Sequence[str]) -> bool:
    """True when any turn of the trajectory is ``"void"``; unknown kinds are a bug and raise."""
    unknown = set(turn_kinds) - set(TURN_KINDS)
    if unknown:
        raise ValueError(f"unknown turn kinds {sorted(unknown)}; expected {TURN_KINDS}")
    return "void" in turn_kinds


def void_turn_keep(turn_kinds_per_episode: Sequence[Sequence[str]]) -> np.ndarray:
    """keep_b: False for every trajectory with a void turn (SimpleTIR's filter), True otherwise."""
    return np.asarray([not trajectory_has_void_turn(k) for k in turn_kinds_per_episode], bool)


@dataclasses.dataclass(frozen=True)
class EpisodeStats:
    """What one episode did: model turns, tool calls and how many failed, void turns, and the
    characters written by the model and by the environment (tokens come from the author ids,
    `rljax.envs.tokens_by_author`)."""

    turns: int
    tool_calls: int
    tool_errors: int
    void_turns: int
    model_chars: int
    env_chars: int


def episode_stats(actions: Sequence[str], results: Sequence[StepResult]) -> EpisodeStats:
    """Counts for one episode from its model turns and the environment's answers, in order."""
    if len(actions) != len(results):
        raise ValueError(f"{len(actions)} model turns but {len(results)} step results")
    return EpisodeStats(
        turns=len(results),
        tool_calls=sum(r.kind == "tool_call" for r in results),
        tool_errors=sum(r.tool_error for r in results),
        void_turns=sum(r.kind == "void" for r in results),
        model_chars=sum(len(a) for a in actions),
        env_chars=sum(len(r.observation_text) for r in results))


def episode_metrics(stats: Sequence[EpisodeStats], prefix: str = "rollout/") -> dict[str, float]:
    """Means per episode over every sampled episode, and the share SimpleTIR's filter drops."""
    if not stats:
        return {}
    out = {f"{prefix}{f.name}_per_episode": float(np.mean([getattr(s, f.name) for s in stats]))
           for f in dataclasses.fields(EpisodeStats)}
    out[f"{prefix}void_episode_fraction"] = float(np.mean([s.void_turns > 0 for s in stats]))
    return out
