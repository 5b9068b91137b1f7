"""Context parallelism's memory: per-device peak of a long-row update against sequence length.

On 8 simulated CPU devices, the update (value and gradient of a policy-gradient loss over
`token_logprobs` with entropies, one row of T tokens) of `qwen2-tiny` is compiled for a mesh of
fsdp = 8 / CP x context = CP, and its `memory_analysis()` read: arguments + outputs - aliased +
temporaries per device, nothing allocated. CP = 1 is the one-device path (the reference einsum
attention, whose recomputed [T, T] scores a row holds per layer); CP > 1 is
`rljax.models.context_parallel` (each device a zig-zag share of the row, keys all-gathered, c x c
score blocks).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/bench_context.py \
        [--lengths 2048,8192,32768] [--degrees 1,2,4,8] [--model qwen2-tiny]

Prints one line per (T, CP) and the ratio of each CP's peak to CP = 1's; BENCHMARKS.md has a run.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import rljax.models as M  # noqa: E402
from rljax import sharding  # noqa: E402
from rljax.models.scoring import token_logprobs  # noqa: E402


def update_peak_bytes(cfg, t: int, degree: int) -> tuple[int, float]:
    """(peak bytes per device, compile seconds) of the one-row update at T = t on fsdp x context."""
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=8 // degree, context=degree))
    params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
    p_sh = sharding.param_shardings(params, mesh)
    tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, t), jnp.bool_)
    adv = jax.ShapeDtypeStruct((1, t), jnp.float32)

    def loss(p, tok, m, a):
        logp, ent = token_logprobs(cfg, p, tok, m, with_entropy=True)
        w = m.astype(jnp.float32)
        ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
        return -(w * a * ratio).sum() / w.sum() - 0.01 * (w * ent).sum() / w.sum()

    start = time.perf_counter()
    ctx = jax.set_mesh(mesh) if degree > 1 else _null()
    with ctx:
        compiled = jax.jit(jax.value_and_grad(loss), in_shardings=(p_sh, None, None, None)).lower(
            params, tokens, mask, adv).compile()
    ma = compiled.memory_analysis()
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    return peak, time.perf_counter() - start


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--degrees", default="1,2,4,8")
    ap.add_argument("--model", default="qwen2-tiny")
    args = ap.parse_args()
    cfg = M.preset(args.model)
    degrees = [int(x) for x in args.degrees.split(",")]
    print(f"model {args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; "
          f"{jax.device_count()} {jax.default_backend()} devices")
    for t in (int(x) for x in args.lengths.split(",")):
        base = None
        for degree in degrees:
            peak, secs = update_peak_bytes(cfg, t, degree)
            base = peak if degree == 1 else base
            ratio = f"  ratio to CP=1 {peak / base:.3f} (1/CP = {1 / degree:.3f})" if base else ""
            print(f"T={t:6d} CP={degree}: peak {peak / 2**20:9.1f} MiB per device  (compile {secs:5.1f} s){ratio}",
                  flush=True)


if __name__ == "__main__":
    main()
