"""Does entropy control or rollout correction keep a collapsing run alive? (issue 51)

The default job (`configs/default.toml`) pushed toward entropy collapse: a raised learning rate
and more samples per prompt. Three arms, same seeds, same iterations (wall times recorded):

    plain       GRPO as the default job runs it
    entropy     the entropy control (default: KL-Cov, Cui et al., 2025, on ~2% of the tokens)
    correction  the rollout correction (default: IcePop with the trainer's log-probs recomputed)

All arms and seeds start RL from one warm start (the default job's supervised warm start of
`--warm-seed`, run once and saved as a HF directory under runs/stability/warm_start): on the
shared 2-core CPU a warm start takes 15-25 minutes, nine of them would not fit, and a shared start
makes the arms' starting points identical, so only the RL seed (sampling, the update's key) varies
across seeds.

Each arm logs the policy's entropy every update and held-out greedy accuracy at each evaluation;
after the run, `rljax eval` measures the last checkpoint's held-out greedy accuracy, pass@k and
mean@k (sampled at the eval temperature, over the config's eval seeds). Writes bench/results/stability.json and docs/img/stability_entropy.png.

    .venv/bin/python bench/stability.py --seeds 0 --iterations 60        # one seed per arm, short
    .venv/bin/python bench/stability.py --collect-only                    # re-summarise, re-plot
    .venv/bin/python bench/stability.py --lr 1e-2 ...                     # another collapsing setting
    .venv/bin/python bench/stability.py --seeds 0 1 2 --parallel 3        # a seed's three arms side by side

Runs one job at a time (the CPU is shared); wrap it in `flock /tmp/rljax_heavy.lock`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = os.path.join(ROOT, "runs", "stability")
WARM = os.path.join(RUNS, "warm_start")

# 16 samples per prompt (the default job: 8) and a raised learning rate (--lr; the default job: 3e-4).
# A pilot at 3e-3 with no warmup wrecked the policy in its first update (train reward 0.31 -> 0.0):
# a divergence, not an entropy collapse; the default job's 10-step warmup is kept.
COLLAPSE = ["sampling.num_samples=16", "rl.prompts_per_iteration=32"]
# a shorter warm start than the default job's (30% of the way to solved), for the shared CPU
SHORT = ["warm_start.target_accuracy=0.15"]
ARMS = {
    "plain": [],
    "entropy": ["algorithm.policy_loss='kl_cov'", "algorithm.cov_ratio=0.02"],
    "correction": ["algorithm.recompute_old_logp=true", "algorithm.off_policy='icepop'"],
}


def _launch(name, overrides, log_path):
    cmd = [sys.executable, "-m", "rljax.cli", "train", f"output_dir='{os.path.join(RUNS, name)}'",
           "metrics.progress_bar=false", *overrides]
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"{name} failed; see {log_path}")
    return time.perf_counter() - t0


def _warm_start(seed, extra):
    """The default job's warm start for `seed`, saved once as a HF directory (reused if present)."""
    done = os.path.join(WARM, "warm_start.json")
    if os.path.exists(done):
        return json.load(open(done))
    code = ("import json, sys, time; from rljax.train.config import load_config; "
            "from rljax.train.run import build_run; from rljax.train.start import warm_start; "
            "from rljax.models import save_hf; t = time.perf_counter(); "
            "run = build_run(load_config(None, sys.argv[2:]), resume=False); "
            "p = warm_start(run); save_hf(run.model_cfg, p, sys.argv[1]); "
            "print(json.dumps({'seconds': time.perf_counter() - t}))")
    out_dir = os.path.join(RUNS, "warm_start_run")
    proc = subprocess.run([sys.executable, "-c", code, WARM, f"seed={seed}", f"output_dir='{out_dir}'", *extra],
                          cwd=ROOT, capture_output=True, text=True)
    with open(os.path.join(RUNS, "warm_start.log"), "w") as log:
        log.write(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"warm start failed:\n{proc.stderr[-2000:]}")
    info = {"seed": seed, "overrides": list(extra), "log": proc.stdout.strip().splitlines()[-3:-1],
            **json.loads(proc.stdout.strip().splitlines()[-1])}
    json.dump(info, open(done, "w"), indent=1)
    return info


def _pass_at_k(run_dir, samples):
    """`rljax eval` of the run's last checkpoint: greedy accuracy, pass@k and mean@k (JSON)."""
    proc = subprocess.run([sys.executable, "-m", "rljax.cli", "eval", run_dir, "--step", "latest",
                           "--samples", str(samples)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr[-500:]}
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def _series(run_dir):
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    ent = [(r["step"], r["entropy"]) for r in rows if r.get("entropy") is not None]
    evals = [(r["step"], {k: v for k, v in r.items() if k.startswith("eval/")}) for r in rows
             if r.get("eval/accuracy") is not None]
    return ent, evals


def _summary(run_dir, wall):
    ent, evals = _series(run_dir)
    first, last = (ent[0][1], ent[-1][1]) if ent else (None, None)
    return {"wall_s": wall, "entropy_first": first, "entropy_last": last,
            "entropy_min": min(v for _, v in ent) if ent else None,
            "entropy_kept": (last / first) if ent and first else None,
            "eval_first": evals[0][1] if evals else None, "eval_last": evals[-1][1] if evals else None,
            "entropy": ent}


def _table(results):
    """One markdown row per run and the median over seeds per arm: entropy at the first update,
    its minimum over the run (min / first: the target keeps it above 0.5), its last value, and the
    last checkpoint's held-out greedy accuracy, pass@k and mean@k (`rljax eval`)."""
    import statistics
    keys = sorted({k for r in results.values() for k in r.get("held_out", {}) if k.startswith(("pass@", "mean@"))
                   and "/" not in k})
    cols = ["entropy first", "min", "min / first", "last", "greedy", *keys]
    print("| run | " + " | ".join(cols) + " | wall s |\n|" + "---|" * (len(cols) + 2))
    per_arm = {}
    for name, r in sorted(results.items()):
        h = r.get("held_out", {})
        vals = [r["entropy_first"], r["entropy_min"], r["entropy_min"] / r["entropy_first"], r["entropy_last"],
                h.get("greedy_accuracy"), *[h.get(k) for k in keys]]
        per_arm.setdefault(name.split("_seed")[0], []).append(vals)
        print(f"| {name} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals) + f" | {r['wall_s']:.0f} |")
    for arm, rows in per_arm.items():
        med = [statistics.median(v[i] for v in rows if v[i] is not None) if any(v[i] is not None for v in rows)
               else None for i in range(len(cols))]
        print(f"| **{arm}, median of {len(rows)}** | " + " | ".join("-" if v is None else f"{v:.3f}" for v in med)
              + " | |")


def _plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    colors = {"plain": "tab:gray", "entropy": "tab:blue", "correction": "tab:orange"}
    for name, row in sorted(results.items()):
        arm = name.split("_seed")[0]
        steps, vals = zip(*row["entropy"]) if row["entropy"] else ((), ())
        seed = int(name.split("_seed")[1]) if "_seed" in name else 0
        ax.plot(steps, vals, color=colors.get(arm), alpha=0.8, label=name, linestyle=["-", "--", ":"][seed % 3])
    firsts = [r["entropy_first"] for r in results.values() if r.get("entropy_first")]
    if firsts:
        ax.axhline(0.5 * sum(firsts) / len(firsts), color="k", linewidth=0.6, linestyle="-.",
                   label="50% of the first update's entropy")
    ax.set_xlabel("RL iteration")
    ax.set_ylabel("policy entropy (nats / token)")
    ax.set_title("Entropy under a collapsing setting (bench/stability.py)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS))
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--eval-samples", type=int, default=8, help="samples per held-out problem for pass@k")
    ap.add_argument("--short", action="store_true", help="warm start to 15%% of the way, not 30%%")
    ap.add_argument("--lr", default="2e-3", help="the RL learning rate of the collapsing setting")
    ap.add_argument("--parallel", type=int, default=1, help="arms of one seed run side by side")
    ap.add_argument("--warm-seed", type=int, default=0, help="the seed of the one shared warm start")
    ap.add_argument("--collect-only", action="store_true")
    args = ap.parse_args()
    os.makedirs(RUNS, exist_ok=True)
    dest = os.path.join(HERE, "results", "stability.json")
    out = json.load(open(dest)) if os.path.exists(dest) else {"runs": {}}
    if not args.collect_only:
        warm = _warm_start(args.warm_seed, SHORT if args.short else [])
        out["warm_start"] = warm
        print("warm start", json.dumps(warm), flush=True)
        every = max(args.iterations // 3, 1)

        def arm_run(seed, arm):
            name = f"{arm}_seed{seed}"
            ov = [f"seed={seed}", f"rl.iterations={args.iterations}", f"eval.every={every}",
                  f"checkpoint.every={args.iterations}", f"optim.learning_rate={args.lr}", *COLLAPSE,
                  f"model.checkpoint='{WARM}'", "warm_start.steps=0", *ARMS[arm]]
            wall = _launch(name, ov, os.path.join(RUNS, f"{name}.log"))
            row = _summary(os.path.join(RUNS, name), wall) | {"overrides": ov, "load_1min_end": os.getloadavg()[0]}
            row["held_out"] = _pass_at_k(os.path.join(RUNS, name), args.eval_samples)
            return name, row

        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            for seed in args.seeds:  # the arms of a seed side by side (--parallel 3): the same load on each
                for name, row in pool.map(lambda arm: arm_run(seed, arm), args.arms):
                    out["runs"][name] = row
                    print(name, json.dumps({k: v for k, v in row.items() if k != "entropy"}), flush=True)
                out.update(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           machine={"platform": platform.platform(), "cpus": os.cpu_count()})
                with open(dest, "w") as f:
                    json.dump(out, f, indent=1)
    _table(out["runs"])
    _plot(out["runs"], os.path.join(ROOT, "docs", "img", "stability_entropy.png"))


if __name__ == "__main__":
    main()
