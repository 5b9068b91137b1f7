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


def memory_bandwidth_gbs(nbytes: int | None = None, repeats: int = 5) -> float:
    """Best read GB/s of one jitted sum over an f32 array of `nbytes`: the memory roof the decode
    benchmark reports a fraction of (decode mostly reads: weights and KV cache). 1 GiB on an
    accelerator (HBM), 256 MiB on a CPU (well past its caches). A sum rather than a copy, whose
    fresh output buffer on a CPU would time page faults as well."""
    if nbytes is None:
        nbytes = (256 if jax.default_backend() == "cpu" else 1024) * 2**20
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)  # XLA:CPU splits it over threads: 27 GB/s here, a 1-thread NumPy sum 15
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9
