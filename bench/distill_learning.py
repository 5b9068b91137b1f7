"""On-policy distillation against GRPO on the default job, at equal wall time (issue 41).

    .venv/bin/python bench/distill_learning.py [--seeds 0 1 2] [--teacher-seconds 150]

1. The teacher: the README's supervised-only control (seed 0, supervised steps on reference
   answers for `--teacher-seconds`, no RL), exported as a HF directory with its tokenizer.
2. For each seed, runs of the default job from the same warm-started student (the warm start is
   seeded, so all start from the same policy): the default GRPO recipe, and each on-policy
   distillation method of `--methods` with no verifier reward in its loss: `opd` (the teacher's
   per-token reverse KL as the advantage) and `gkd` (GKD's generalized JSD over the whole
   vocabulary, `algorithm.distill_beta`, default 0.5).
3. Both are compared at equal training wall time: the cumulative `time/iteration_s` of their
   iterations (sampling, scoring, update; evaluations excluded for both), at the GRPO run's total.
   Held-out greedy accuracy is the real verifier's, every `--eval-every` iterations.

Runs alone and one at a time (wall times are the comparison). Writes
bench/results/distill_learning.json and docs/img/distill_vs_grpo.png (both curves, every seed).
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
RUNS = os.path.join(ROOT, "runs", "distill_learning")


def _run(name: str, overrides: list[str]) -> float:
    out = os.path.join(RUNS, name)
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        print(f"{name}: already run, kept")
        return float("nan")
    cmd = [sys.executable, "-m", "rljax.cli", "train", f"output_dir='{out}'", "metrics.progress_bar=false",
           "metrics.tensorboard=false", *overrides]
    t0 = time.perf_counter()
    with open(os.path.join(RUNS, f"{name}.log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall = time.perf_counter() - t0
    print(f"{name}: {wall:.0f} s")
    return wall


def _curve(name: str):
    """[(cumulative training seconds, iteration, held-out accuracy)] from a run's metrics."""
    rows = [json.loads(x) for x in open(os.path.join(RUNS, name, "metrics.jsonl"))]
    seconds, out = 0.0, []
    for r in rows:
        seconds += r.get("time/iteration_s", 0.0)
        if r.get("eval/accuracy") is not None:
            out.append((round(seconds, 2), r["step"], r["eval/accuracy"]))
    return out


def _at(curve, seconds: float) -> float:
    """The accuracy of the last evaluation within `seconds` of training."""
    return [acc for s, _, acc in curve if s <= seconds + 1e-6][-1]


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _plot(results, dest):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = {"grpo": ("GRPO (verifier reward)", "tab:blue"), "gkd": ("on-policy distillation, GKD (JSD)", "tab:red"),
             "opd": ("on-policy distillation, reverse-KL advantage", "tab:orange")}
    for i, (seed, r) in enumerate(results.items()):
        for key, (label, color) in names.items():
            if key not in r:
                continue
            s, _, acc = zip(*r[key]["curve"])
            ax.plot(s, [100 * a for a in acc], color=color, alpha=0.5, marker=".", label=label if i == 0 else None)
    ax.set_xlabel("training wall time (s, evaluations excluded)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title("default job from its warm start, seeds " + ", ".join(results) + " (one line each)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(dest, dpi=110)


def main() -> None:
    global RUNS
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--teacher-seconds", type=float, default=150.0)
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--override", nargs="*", default=[], help="key=value settings for every student run")
    ap.add_argument("--methods", nargs="+", default=["gkd", "opd"], help="distillation presets to run")
    ap.add_argument("--method-override", nargs="*", default=[],
                    help="key=value settings for the distillation runs only (e.g. algorithm.distill_beta=0)")
    ap.add_argument("--teacher-override", nargs="*", default=[], help="key=value settings for the teacher's run")
    ap.add_argument("--runs", default=RUNS, help="where the runs go (default runs/distill_learning)")
    ap.add_argument("--results", default=os.path.join(HERE, "results", "distill_learning.json"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "distill_vs_grpo.png"))
    args = ap.parse_args()
    RUNS = args.runs
    os.makedirs(RUNS, exist_ok=True)
    walls = {}
    # One RL iteration at a negligible learning rate after the supervised steps, so the run writes a
    # checkpoint to export (a run of 0 iterations writes none); the teacher is the supervised model.
    walls["teacher"] = _run("teacher", ["seed=0", "rl.iterations=1", "optim.learning_rate=1e-12",
                                        "warm_start.target_accuracy=0", "warm_start.steps=1000000",
                                        f"warm_start.max_seconds={args.teacher_seconds:.0f}", *args.teacher_override])
    teacher_hf = os.path.join(RUNS, "teacher_hf")
    if not os.path.exists(teacher_hf):
        subprocess.run([sys.executable, "-m", "rljax.cli", "export", os.path.join(RUNS, "teacher"), teacher_hf],
                       cwd=ROOT, check=True)
    teacher_acc = _curve("teacher")[-1][2]
    common = [f"rl.iterations={args.iterations}", f"eval.every={args.eval_every}", f"checkpoint.every={args.iterations}",
              *args.override]
    results = {}
    for seed in args.seeds:
        walls[f"grpo_seed{seed}"] = _run(f"grpo_seed{seed}", [f"seed={seed}", *common])
        for method in args.methods:
            walls[f"{method}_seed{seed}"] = _run(f"{method}_seed{seed}", [
                f"seed={seed}", f"algorithm.algorithm={method}", f"teacher.checkpoint='{teacher_hf}'", *common,
                *args.method_override])
        grpo = _curve(f"grpo_seed{seed}")
        budget = grpo[-1][0]  # the GRPO run's whole training time
        r = results[str(seed)] = {"start": grpo[0][2], "budget_s": budget}
        for method in ["grpo", *args.methods]:
            curve = grpo if method == "grpo" else _curve(f"{method}_seed{seed}")
            r[method] = {"at_budget": _at(curve, budget), "final": curve[-1][2], "train_s": curve[-1][0],
                         "curve": curve}
        print(f"seed {seed}: start {r['start']:.3f} | at {budget:.0f} s of training: "
              + ", ".join(f"{m} {r[m]['at_budget']:.3f}" for m in ["grpo", *args.methods]))
    import jax

    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": _cpu_model(), "cpus": os.cpu_count(),
           "load_avg_at_end": os.getloadavg(), "python": platform.python_version(), "jax": jax.__version__,
           "teacher": {"seconds": args.teacher_seconds, "held_out_accuracy": teacher_acc},
           "iterations": args.iterations, "eval_every": args.eval_every, "overrides": args.override,
           "methods": args.methods, "method_overrides": args.method_override,
           "walls_s": walls, "seeds": results}
    with open(args.results, "w") as f:
        json.dump(out, f, indent=2)
    _plot(results, args.plot)


if __name__ == "__main__":
    main()
