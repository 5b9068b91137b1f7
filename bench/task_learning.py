"""Issue 24's learning evidence: RL on tasks the default recipe was not tuned on, each beside an
SFT-only control of the same time, and selection policies against `uniform` on a mixture.

    .venv/bin/python bench/task_learning.py tasks [--tasks gcd simple_equations ...]
    .venv/bin/python bench/task_learning.py mixture [--policies uniform bandit] [--seeds 0 1 2]
    .venv/bin/python bench/task_learning.py tasks --collect-only     # re-summarise existing runs

`tasks` runs `rljax train --config learn_TASK` (`--seed`, default 0; rows and run directories of
another seed are suffixed `_seed{N}`), then the control: the same config with
`rl.iterations=0` and a warm start that only stops at the RL run's wall time (no target, no
plateau), so the control spends on supervised steps what the RL run spent on its warm start plus
RL. Held-out accuracy is `eval/accuracy` (greedy, both levels' held-out splits). Writes
bench/results/task_learning.json.

`mixture` runs `rljax train --config mixture_arith` per policy and seed with the same iterations
(so the same samples), and writes bench/results/mixture_selection.json and
mixture_selection.png: per policy, the mean over seeds of eval/accuracy against samples spent.

Each run is recorded with its wall seconds, its CPU seconds (user + system of the child process,
from `os.wait4`) and `/proc/loadavg` before and after, because the machine may carry other work.
Run one at a time (the script does), under `nice` if the machine is shared.
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
RUNS = os.path.join(ROOT, "runs", "task_learning")
RESULTS = os.path.join(HERE, "results")
TASKS = ("basic_arithmetic", "decimal_chain_sum", "gcd", "simple_equations")
# The mixture comparison sized to ~5 minutes a run on 2 cores: 120 iterations of 64 prompts
# x 8 samples (61,440 samples), a warm start capped by steps (not seconds, so it is deterministic
# per seed and the policies of a seed start from the same params), a greedy eval of 50 held-out
# problems per source every 20 iterations.
MIXTURE_OVERRIDES = ("rl.iterations=120", "rl.prompts_per_iteration=64", "warm_start.steps=600", "eval.every=20",
                     "eval.size=50", "eval.num_samples=1", "eval.pass_k=[1]", "eval.seeds=1", "checkpoint.every=1000")


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def run(name: str, config: str, overrides: list[str], nice: int) -> dict:
    """One `rljax train` run in its own process; its wall and CPU seconds and the load around it."""
    out_dir = os.path.join(RUNS, name)
    cmd = ["nice", "-n", str(nice), sys.executable, "-m", "rljax.cli", "train", "--config", config,
           f"output_dir='{out_dir}'", "metrics.progress_bar=false", *overrides]
    load_before = _loadavg()
    t0 = time.perf_counter()
    with open(os.path.join(RUNS, f"{name}.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{name} failed; see {RUNS}/{name}.log")
    return {"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "loadavg_before": load_before, "loadavg_after": _loadavg(), "overrides": overrides}


def curve(name: str) -> dict:
    """eval/accuracy (overall and per task) against the RL step and the samples spent so far."""
    rows = [json.loads(x) for x in open(os.path.join(RUNS, name, "metrics.jsonl"))]
    spent, points = 0.0, []
    for r in rows:
        spent = sum(v for k, v in r.items() if k.startswith("selection/") and k.endswith("/samples_total")) or spent
        if r.get("eval/accuracy") is not None:
            per_task = {k.split("/")[1]: v for k, v in r.items()
                        if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2}
            points.append({"step": r["step"], "samples": spent, "accuracy": r["eval/accuracy"], "per_task": per_task,
                           # the audit's held-out accuracy on the same greedy replies (`[reward] audit`)
                           **({"accuracy_strict": r["eval/accuracy_strict"]} if "eval/accuracy_strict" in r else {})})
    log = open(os.path.join(RUNS, f"{name}.log")).read().splitlines()
    notes = [x for x in log if x.startswith(("warm start stopped", "curriculum start"))]
    return {"evals": points, "log": notes}


MINE: set[str] = set()  # the runs this process makes; the results file's other rows are taken from disk


def _save(name: str, out: dict) -> None:
    """Writes `out`, first taking in runs another process (a parallel `tasks --tasks X`) saved meanwhile."""
    path = os.path.join(RESULTS, name)
    if os.path.exists(path):
        for key, row in json.load(open(path)).get("runs", {}).items():
            if key not in MINE:
                out["runs"][key] = row
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


def _header() -> dict:
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": _cpu_model(), "cpus": os.cpu_count(),
            "python": platform.python_version()}


def tasks_part(args) -> None:
    results = f"task_learning_{args.tag}.json" if args.tag else "task_learning.json"  # a variant: its own file
    dest = os.path.join(RESULTS, results)
    out = json.load(open(dest)) if os.path.exists(dest) else {"runs": {}}
    out.update(_header(), overrides=args.override)
    suffix = "" if args.seed == 0 else f"_seed{args.seed}"  # seed 0 keeps the names of earlier rounds
    suffix += f"_{args.tag}" if args.tag else ""
    MINE.update(f"{task}{suffix}" for task in args.tasks)
    for task in args.tasks:
        row = out["runs"].setdefault(f"{task}{suffix}", {})
        row["seed"] = args.seed
        rl_name, control_name = f"{task}_rl{suffix}", f"{task}_control{suffix}"
        if not args.collect_only and not args.control_only:
            row["rl"] = run(rl_name, f"learn_{task}", [f"seed={args.seed}", *args.override], args.nice)
            row["rl"].update(curve(rl_name))
            _save(results, out)
        if not args.collect_only and not args.skip_control:
            budget = row["rl"]["wall_s"] - args.control_overhead_s
            row["control_sft"] = run(control_name, f"learn_{task}",
                                     [f"seed={args.seed}", *args.override, "rl.iterations=0",
                                      "warm_start.target_accuracy=0", "warm_start.patience=0",
                                      "warm_start.steps=1000000", f"warm_start.max_seconds={budget:.0f}"], args.nice)
        for kind, name in (("rl", rl_name), ("control_sft", control_name)):
            if kind in row and os.path.exists(os.path.join(RUNS, name, "metrics.jsonl")):
                row[kind].update(curve(name))
        if "rl" in row:
            evals = row["rl"]["evals"]
            row["before_rl"], row["after_rl"] = evals[0]["accuracy"], evals[-1]["accuracy"]
            row["rl_gain_points"] = round(100 * (row["after_rl"] - row["before_rl"]), 2)
        if "control_sft" in row:
            row["control_accuracy"] = row["control_sft"]["evals"][-1]["accuracy"]
            if "rl" in row:
                row["rl_minus_control_points"] = round(100 * (row["after_rl"] - row["control_accuracy"]), 2)
        _save(results, out)
    median = {}
    for seed in sorted({r.get("seed", 0) for r in out["runs"].values()}):
        gains = sorted(r["rl_gain_points"] for r in out["runs"].values() if "rl_gain_points" in r and r.get("seed", 0) == seed)
        median[seed] = (gains[len(gains) // 2] + gains[(len(gains) - 1) // 2]) / 2 if gains else None
    out["median_rl_gain_points"] = median.get(0)
    out["median_rl_gain_points_by_seed"] = {str(k): v for k, v in median.items()}
    _save(results, out)
    print(json.dumps({t: {k: r.get(k) for k in ("before_rl", "after_rl", "rl_gain_points", "control_accuracy")}
                      for t, r in out["runs"].items()}, indent=1), "median gain by seed", median)


def _samples_to(points: list[dict], target: float) -> float | None:
    """Samples spent when the mean curve first reaches `target`, interpolated linearly between evals."""
    for a, b in zip(points, points[1:]):
        if a["accuracy"] >= target:
            return a["samples"]
        if b["accuracy"] >= target:
            return a["samples"] + (b["samples"] - a["samples"]) * (target - a["accuracy"]) / (b["accuracy"] - a["accuracy"])
    return points[0]["samples"] if points and points[0]["accuracy"] >= target else None


def mixture_part(args) -> None:
    results = f"mixture_selection_{args.tag}.json" if args.tag else "mixture_selection.json"  # a variant: its own file
    dest = os.path.join(RESULTS, results)
    out = json.load(open(dest)) if os.path.exists(dest) else {"runs": {}}
    out.update(_header(), overrides=args.override)
    for seed in args.seeds:  # seed-major, so a partial sweep still compares the policies on equal seeds
        for policy in args.policies:
            name = f"mixture_{policy}_seed{seed}" + (f"_{args.tag}" if args.tag else "")
            MINE.add(name)
            if not args.collect_only:
                opts = [f"data.selection={policy}"] + ([] if policy == "bandit" else ["data.selection_options={}"])
                out["runs"][name] = run(name, "mixture_arith", [f"seed={seed}", *opts, *MIXTURE_OVERRIDES, *args.override],
                                       args.nice)
            if os.path.exists(os.path.join(RUNS, name, "metrics.jsonl")):
                out["runs"].setdefault(name, {}).update(curve(name), policy=policy, seed=seed)
            _save(results, out)
    mean = {}
    for policy in args.policies:
        runs = [r for r in out["runs"].values() if r.get("policy") == policy and r.get("evals")]
        if runs:
            n = min(len(r["evals"]) for r in runs)
            mean[policy] = [{"samples": sum(r["evals"][i]["samples"] for r in runs) / len(runs),
                             "accuracy": sum(r["evals"][i]["accuracy"] for r in runs) / len(runs),
                             "seeds": len(runs)} for i in range(n)]
    out["mean_curves"] = mean
    if len(mean) >= 2:  # fixed before the runs: half the smaller policy's mean gain, so every policy reaches it
        start = min(pts[0]["accuracy"] for pts in mean.values())
        target = start + 0.5 * min(pts[-1]["accuracy"] - pts[0]["accuracy"] for pts in mean.values())
        out["target_accuracy"] = round(target, 4)
        out["samples_to_target"] = {p: _samples_to(pts, target) for p, pts in mean.items()}
        out["final_accuracy"] = {p: pts[-1]["accuracy"] for p, pts in mean.items()}
    _save(results, out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, pts in mean.items():
        ax.plot([p["samples"] for p in pts], [p["accuracy"] for p in pts], marker="o",
                label=f"{policy} ({pts[0]['seeds']} seeds)")
    ax.set_xlabel("samples spent")
    ax.set_ylabel("held-out greedy accuracy (mean over seeds)")
    ax.set_title("mixture_arith: selection policy vs uniform")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, results.replace(".json", ".png")), dpi=100)
    print(json.dumps(mean, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=("tasks", "mixture"))
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--policies", nargs="+", default=["uniform", "bandit"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--seed", type=int, default=0, help="the tasks part's seed")
    ap.add_argument("--override", nargs="*", default=[], help="key=value settings for every run")
    ap.add_argument("--control-overhead-s", type=float, default=30.0,
                    help="the control's setup and evaluation time, taken off its warm-start budget")
    ap.add_argument("--nice", type=int, default=5)
    ap.add_argument("--tag", default="", help="a variant's name; its rows go to task_learning_TAG.json / mixture_selection_TAG.json")
    ap.add_argument("--collect-only", action="store_true", help="only summarise existing runs")
    ap.add_argument("--skip-control", action="store_true", help="tasks: the RL runs only")
    ap.add_argument("--control-only", action="store_true", help="tasks: the controls only (after the RL runs)")
    args = ap.parse_args()
    os.makedirs(RUNS, exist_ok=True)
    (tasks_part if args.part == "tasks" else mixture_part)(args)


if __name__ == "__main__":
    main()
