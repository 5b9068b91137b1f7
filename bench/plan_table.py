"""The memory plan table: `rljax plan` for the named real shapes with a recipe, on 8 devices.

v5e-8, v5p-16 (8 chips) and 8xH100 are all 8 devices, so one plan per shape answers the three
slices; only the verdict differs. Each plan compiles the sampler and the update programs on CPU
with 8 simulated devices (`--stages-only`: the one-program iteration, about their sum again in
compile time, is left out; the peak is then the larger stage's). Writes
bench/results/plan_table.json and prints the markdown table for BENCHMARKS.md.

    .venv/bin/python bench/plan_table.py [--config gsm8k_qwen] [--shapes Qwen2.5-0.5B Qwen2.5-7B] \
        [--set update.remat=true update.num_microbatches=64] [--out bench/results/plan_table_remat.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from rljax.plan.accelerators import GIB, SLICES  # noqa: E402
from rljax.plan.memory import plan_memory  # noqa: E402
from rljax.plan.shapes import NAMED_SHAPES, model_config  # noqa: E402
from rljax.train.config import load_config  # noqa: E402

COLUMNS = ("v5e-8", "v5p-16", "8xh100")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gsm8k_qwen")
    ap.add_argument("--shapes", nargs="*", default=list(NAMED_SHAPES))
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides, as for rljax plan")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "plan_table.json"))
    args = ap.parse_args()
    cfg = load_config(args.config, ["mesh.devices=8", *args.set])
    rows = []
    for name in args.shapes:
        model_cfg = model_config(name, param_dtype=cfg.model.param_dtype, compute_dtype=cfg.model.compute_dtype)
        start = time.perf_counter()
        plan = plan_memory(cfg, model_cfg, one_program=False)
        s = plan.state
        row = dict(shape=name, params=s.params_bytes, opt_state=s.opt_state_bytes, reference=s.reference_bytes,
                   value=s.value_bytes, update_temp=plan.update.temp_bytes, sampler_temp=plan.sampler.temp_bytes,
                   update_peak=plan.update_peak_bytes, sampler_peak=plan.sampler_peak_bytes, peak=plan.peak_bytes,
                   compile_update_s=plan.update.compile_seconds, compile_sampler_s=plan.sampler.compile_seconds,
                   wall_s=time.perf_counter() - start,
                   fits={c: plan.peak_bytes <= SLICES[c].accelerator.memory_bytes for c in COLUMNS})
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = dict(config=args.config, overrides=args.set, devices=8, mesh=dict(plan.state.mesh), jax=jax.__version__,
                cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(markdown(rows))


def markdown(rows) -> str:
    g = lambda n: f"{n / GIB:.2f}"  # noqa: E731
    head = ("| shape | params | opt state | reference | update temps | sampler temps | peak (stage) | "
            + " | ".join(COLUMNS) + " | compile s (update + sampler) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        stage = "update" if r["update_peak"] >= r["sampler_peak"] else "sampler"
        fits = " | ".join("fits" if r["fits"][c] else "**no**" for c in COLUMNS)
        lines.append(f"| {r['shape']} | {g(r['params'])} | {g(r['opt_state'])} | {g(r['reference'])} | "
                     f"{g(r['update_temp'])} | {g(r['sampler_temp'])} | {g(r['peak'])} ({stage}) | {fits} | "
                     f"{r['compile_update_s']:.0f} + {r['compile_sampler_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
