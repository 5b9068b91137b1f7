"""Static `generate` per `decode_phases` on this machine: programs compiled, first-call and
per-call process CPU seconds (BENCHMARKS.md, "Decode phases and compiles").

    .venv/bin/python bench/decode_phases.py --phases 1 2 3 9 --new 512 --prompts 4

CPU seconds (`time.process_time`, every XLA thread summed) rather than wall time: on a shared
machine the wall time of identical calls varies several-fold, the CPU time far less. Random
qwen2-tiny weights, prompts of random ids, no EOS, so every row decodes `--new` tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

import rljax.models as M
from rljax.sampling import SampleControls, generate

LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2-tiny")
    ap.add_argument("--phases", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = M.preset(args.model)
    params = jax.block_until_ready(M.init_params(cfg, jax.random.key(0)))
    prompts = np.random.default_rng(0).integers(2, cfg.vocab_size, (args.prompts, args.prompt_len)).astype(np.int32)
    lowerings = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_a, **_k: lowerings.append(event) if event == LOWERING else None)

    def call(phases, seed):
        controls = SampleControls(max_new_tokens=args.new, num_samples=args.samples, decode_phases=phases)
        c0, n0 = time.process_time(), len(lowerings)
        jax.block_until_ready(generate(cfg, params, prompts, key=jax.random.key(seed), controls=controls).tokens)
        return time.process_time() - c0, len(lowerings) - n0

    first = {k: call(k, 1) for k in args.phases}
    steady = {k: [] for k in args.phases}
    for r in range(args.repeats):  # interleaved, so a change in the machine's load hits every setting
        for k in args.phases:
            steady[k].append(call(k, 2 + r)[0])
    for k in args.phases:
        med = statistics.median(steady[k])
        print(f"decode_phases={k}: programs {first[k][1]}, first call {first[k][0]:.1f} CPU s, "
              f"per call {med:.2f} CPU s (all {[round(t, 2) for t in steady[k]]}), "
              f"compile ~{first[k][0] - med:.1f} CPU s")


if __name__ == "__main__":
    main()
