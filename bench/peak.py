"""This machine's measured matmul peak: the compute roof the benchmarks report fractions of."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def matmul_peak_gflops(dtype=jnp.float32, n: int = 2048, repeats: int = 5) -> float:
    """Best GFLOP/s of one n x n x n jitted matmul in `dtype` (accumulating in f32)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9
