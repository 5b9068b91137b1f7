"""Reward transforms applied to sequence rewards before advantages are estimated, inside the
compiled update step (the TOML `[shaping]` section)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rljax.config_io import bounded
from rljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RewardShaping:
    """Length-based reward terms added to the verifier's reward of each row.

    `overlong_max_length` (None: off) and `overlong_buffer`: DAPO's soft overlong punishment
    (`overlong_penalty`); `length_penalty` > 0: a linear length cost (`length_penalty`) over the
    completion budget.
    """

    overlong_max_length: int | None = bounded(None, ge=1)
    overlong_buffer: int = bounded(0, ge=0)
    length_penalty: float = bounded(0.0, ge=0)

    def __post_init__(self):
        if self.overlong_max_length is not None and self.overlong_max_length < 1:
            raise ConfigError(f"shaping.overlong_max_length={self.overlong_max_length} must be >= 1 (or unset)")
        if self.overlong_max_length is not None and not 0 <= self.overlong_buffer < self.overlong_max_length:
            raise ConfigError(f"shaping.overlong_buffer={self.overlong_buffer} must lie in "
                              f"[0, overlong_max_length={self.overlong_max_length})")
        if self.length_penalty < 0:
            raise ConfigError(f"shaping.length_penalty={self.length_penalty} must be >= 0 (it is subtracted)")

    @property
    def active(self) -> bool:
        return self.overlong_max_length is not None or self.length_penalty > 0

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
