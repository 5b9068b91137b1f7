"""Reward transforms applied to sequence rewards before advantages are estimated."""

from __future__ import annotations

import jax.numpy as jnp


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
