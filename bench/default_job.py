"""Runs the default job (`rljax train`) for several seeds plus a supervised-only control of equal
wall time, and records held-out accuracy before/after RL. Writes bench/results/default_job.json.

    .venv/bin/python bench/default_job.py [--seeds 0 1 2] [--parallel 2] [--collect-only]
    .venv/bin/python bench/default_job.py --tag lora --skip-control \
        --override lora.rank=16 lora.alpha=32 optim.learning_rate=3e-3     # the LoRA variant (issue 22)
    .venv/bin/python bench/default_job.py --config tool_products --tag tools --skip-control \
        --override rl.iterations=100                                        # multi-turn tools (issue 21)

`--tag NAME` keeps a variant's runs in runs/default_job_NAME and its results in
bench/results/default_job_NAME.json; `--override` passes key=value settings to every seed's run.

Accuracies are deterministic per seed; wall times are only meaningful for runs made alone
(`--parallel 1`), because parallel runs share the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = os.path.join(ROOT, "runs", "default_job")  # runs/default_job_TAG with --tag


def _accuracies(run_dir):
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    return evals[0][1], evals[-1][1], evals


CONFIG: list[str] = []  # ["--config", NAME] with --config


def _launch(name, overrides):
    log = open(os.path.join(RUNS, f"{name}.log"), "w")
    cmd = [sys.executable, "-m", "rljax.cli", "train", *CONFIG, f"output_dir='{os.path.join(RUNS, name)}'",
           "metrics.progress_bar=false", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--control-seconds", type=float, default=None,
                    help="wall time of the SFT-only control (default: seed 0's run time)")
    ap.add_argument("--collect-only", action="store_true", help="only summarise existing runs")
    ap.add_argument("--skip-control", action="store_true", help="run the seeds only (the control ran before)")
    ap.add_argument("--override", nargs="*", default=[], help="key=value settings for every seed's run")
    ap.add_argument("--tag", help="a variant's name: runs/default_job_TAG, bench/results/default_job_TAG.json")
    ap.add_argument("--config", help="a recipe instead of the default job (e.g. tool_products); use with --tag")
    args = ap.parse_args()
    global RUNS, CONFIG
    CONFIG = ["--config", args.config] if args.config else []
    RUNS = f"{RUNS}_{args.tag}" if args.tag else RUNS
    os.makedirs(RUNS, exist_ok=True)
    walls = {}
    if not args.collect_only:
        jobs = [(f"seed{s}", [f"seed={s}", *args.override]) for s in args.seeds]
        running = []
        while jobs or running:
            while jobs and len(running) < args.parallel:
                name, ov = jobs.pop(0)
                running.append((name, *_launch(name, ov)))
            for item in list(running):
                name, proc, t0 = item
                if proc.poll() is not None:
                    if proc.returncode:
                        raise SystemExit(f"{name} failed; see {RUNS}/{name}.log")
                    walls[name] = time.perf_counter() - t0
                    running.remove(item)
            time.sleep(1)
    if not args.collect_only and not args.skip_control:
        control_s = args.control_seconds or walls.get("seed0")
        proc, t0 = _launch("control_sft", ["seed=0", "rl.iterations=0", "warm_start.target_accuracy=0",
                                           "warm_start.steps=1000000", f"warm_start.max_seconds={control_s - 20:.0f}"])
        proc.wait()
        walls["control_sft"] = time.perf_counter() - t0
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": args.config or "default", "overrides": args.override,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "python": platform.python_version(), "runs": {}}
    for name in sorted(os.listdir(RUNS)):
        path = os.path.join(RUNS, name)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "metrics.jsonl")):
            before, after, evals = _accuracies(path)
            out["runs"][name] = {"before_rl": before, "after": after, "gain_points": round(100 * (after - before), 2),
                                 "wall_s": walls.get(name), "evals": evals}
    dest = os.path.join(HERE, "results", f"default_job_{args.tag}.json" if args.tag else "default_job.json")
    if os.path.exists(dest):  # keep wall times measured by an earlier invocation for runs not re-run now
        earlier = json.load(open(dest)).get("runs", {})
        for name, row in out["runs"].items():
            if row["wall_s"] is None and name in earlier:
                row["wall_s"] = earlier[name].get("wall_s")
    with open(dest, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({k: {kk: v[kk] for kk in ("before_rl", "after", "gain_points", "wall_s")}
                      for k, v in out["runs"].items()}, indent=2))


if __name__ == "__main__":
    main()
