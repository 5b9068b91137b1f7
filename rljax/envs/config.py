"""The `[env]` section: which environment, its tool-call format and the episode's static shape.

One type for the config section and the rollout's options: `rljax.stages.episodes` and the
greedy episode evaluation read the same fields the recipe sets.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rljax.config_io import bounded
from rljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episodes with a tool (`rljax.envs`; the rollout is `rljax.stages.episodes`).

    Unset or empty `name` (the default) keeps single-turn rollouts. `name` picks a registered
    environment (calculator, python, reasoning_gym_tool), `format` its tool-call format (tags,
    qwen, hermes); `options` are further keyword arguments of the environment's factory.
    - max_turns: model turns per episode (the environment ends the episode at the last one).
    - max_episode_tokens: the per-episode token budget, model and environment tokens together (the
      episode buffer's width N; `sampling.max_new_tokens` does not apply).
    - max_observation_tokens: an observation's cap in tokens; a longer one is cut and ends with the
      tokenizer's encoding of `truncation_marker` (which the tokenizer must spell).
    - void_turn_filter: drop trajectories with a void turn from the loss (SimpleTIR).
    - turn_discount: gamma of the episode return sum_k gamma^k r_k over its turns (1: the plain sum).
    - credit: "episode" (every model token of an episode gets its return's advantage) or "turn"
      (turn k's tokens get the advantage of its return-to-go against the group's episodes that
      reached turn k; the batch carries `TurnReturns`; needs advantage grpo or dr_grpo).
    """

    name: str | None = None
    format: str = "tags"
    max_turns: int = bounded(3, ge=1)
    max_episode_tokens: int = bounded(64, ge=1)
    max_observation_tokens: int = bounded(16, ge=1)
    truncation_marker: str = "..."
    void_turn_filter: bool = True
    turn_discount: float = bounded(1.0, gt=0, le=1)
    credit: Literal["episode", "turn"] = "episode"
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.credit not in ("episode", "turn"):
            raise ConfigError(f"env.credit={self.credit!r}; choose 'episode' or 'turn'")

    @property
    def enabled(self) -> bool:
        """An environment is named (`env.name=''` on the command line turns a recipe's off)."""
        return bool(self.name)
