"""Reward transforms applied to sequence rewards before advantages are estimated, inside the
compiled update step (the TOML `[shaping]` section)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rljax.config_io import bounded
from rljax.objectives.difficulty import STAGES
from rljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RewardShaping:
    """Length-based reward terms added to the verifier's reward of each row.

    `overlong_max_length` (None: off) and `overlong_buffer`: DAPO's soft overlong punishment
    (`overlong_penalty`); `length_penalty` > 0: a linear length cost (`length_penalty`) over the
    completion budget.

    VL-Cogito's progressive curriculum (`rljax.objectives.difficulty`, off by default):
    `difficulty_stages` (e.g. ["easy", "medium", "hard"]; empty: off) weighs each prompt's
    advantages by its rollout accuracy through the stage's function (ODSW), stage k from RL
    iteration `difficulty_boundaries[k - 1]` on (iterations counted from 0, as optimiser steps over
    `num_epochs * num_minibatches`; one boundary fewer than stages);
    `difficulty_zero_weight` is the hard stage's weight of a prompt with no correct rollout.
    `length_reward_coef` > 0 adds the dynamic length reward (DyLR), whose target is the mean
    length of a prompt's correct rollouts, or `length_reward_fallback` tokens (unset: the
    completion budget) when none is correct; with stages it applies in the "hard" stage only.
    """

    overlong_max_length: int | None = bounded(None, ge=1)
    overlong_buffer: int = bounded(0, ge=0)
    length_penalty: float = bounded(0.0, ge=0)
    difficulty_stages: tuple[str, ...] = ()
    difficulty_boundaries: tuple[int, ...] = bounded((), ge=0)
    difficulty_zero_weight: float = bounded(0.25, ge=0, le=1)
    length_reward_coef: float = bounded(0.0, ge=0)
    length_reward_fallback: int | None = bounded(None, ge=1)

    def __post_init__(self):
        if self.overlong_max_length is not None and self.overlong_max_length < 1:
            raise ConfigError(f"shaping.overlong_max_length={self.overlong_max_length} must be >= 1 (or unset)")
        if self.overlong_max_length is not None and not 0 <= self.overlong_buffer < self.overlong_max_length:
            raise ConfigError(f"shaping.overlong_buffer={self.overlong_buffer} must lie in "
                              f"[0, overlong_max_length={self.overlong_max_length})")
        if self.length_penalty < 0:
            raise ConfigError(f"shaping.length_penalty={self.length_penalty} must be >= 0 (it is subtracted)")
        object.__setattr__(self, "difficulty_stages", tuple(self.difficulty_stages))
        object.__setattr__(self, "difficulty_boundaries", tuple(int(b) for b in self.difficulty_boundaries))
        for stage in self.difficulty_stages:
            STAGES.get(stage)
        if len(self.difficulty_boundaries) != max(len(self.difficulty_stages) - 1, 0) \
                or list(self.difficulty_boundaries) != sorted(self.difficulty_boundaries):
            raise ConfigError(f"shaping.difficulty_boundaries={list(self.difficulty_boundaries)} must be "
                              f"{max(len(self.difficulty_stages) - 1, 0)} ascending RL iterations, one fewer than "
                              f"shaping.difficulty_stages={list(self.difficulty_stages)}")

    @property
    def active(self) -> bool:
        return self.overlong_max_length is not None or self.length_penalty > 0 or self.length_reward_coef > 0

    @property
    def curriculum(self) -> bool:
        """Whether VL-Cogito's ODSW or DyLR is on (`rljax.objectives.difficulty`)."""
        return bool(self.difficulty_stages) or self.length_reward_coef > 0

    def apply(self, rewards_b, lengths_b, completion_len: int):
        """Shaped rewards [B] from rewards [B] and completion lengths [B] (tokens)."""
        rewards_b = rewards_b.astype(jnp.float32)
        if self.overlong_max_length is not None:
            rewards_b = rewards_b + overlong_penalty(lengths_b, self.overlong_max_length, self.overlong_buffer)
        if self.length_penalty:
            rewards_b = rewards_b + length_penalty(lengths_b, self.length_penalty, completion_len)
        return rewards_b


def overlong_penalty(lengths_b, max_length: int, buffer: int):
    """DAPO's soft overlong punishment (Yu et al., 2025), with L_max = max_length, L_c = buffer:

        0                                  if |y| <= L_max - L_c
        ((L_max - L_c) - |y|) / L_c        if L_max - L_c < |y| <= L_max
        -1                                 if |y| > L_max
    """
    n = lengths_b.astype(jnp.float32)
    start = max_length - buffer
    ramp = (start - n) / max(buffer, 1)
    return jnp.where(n <= start, 0.0, jnp.where(n <= max_length, ramp, -1.0))


def length_penalty(lengths_b, coef: float, max_length: int):
    """A linear length cost -coef * |y| / max_length (the simplest length reward; cf. LASER, 2025)."""
    return -coef * lengths_b.astype(jnp.float32) / max_length
