"""Trained tokens per second of `rl.mode` sync, one_step_off and async (eta = 1, 2, 4), issue #20.

Each case is a child process running the RL loop's own pieces (`rljax.train.run.build_run`,
`new_train_state`, the mode's driver from `rljax.drivers.DRIVERS`, then `driver.step`, as `train`
calls them; no warm start, evaluation or checkpoints) on the same config and seed, for `--iterations`
iterations. The first `--skip` (compile, and async's queue filling) are left out: throughput =
tokens in the rows the loss saw (`train/rows x train/length_mean`, so dropped rows do not count)
over the wall seconds from the end of iteration `skip` to the end of the last one. The cases run
`--rounds` times, in alternating order, because the machine's load drifts; speed-ups are taken
within a round and averaged. A persistent compilation cache lets later cases skip recompiling the
update program (the sampling program, with its verifier callback, is compiled in every case).

Cases, on the 2 cores as 2 XLA host devices (`--xla_force_host_platform_device_count=2`) except
the first:
- `sync_1dev`: today's default run, one CPU device, the iteration as ONE compiled program.
- `sync_split`: `mesh.sampler_devices=1`, `rl.mode=sync`: the sampling program on device 1, the
  update on device 0, one after the other (plus the weight copy between them).
- `one_step_off`, `async_eta{1,2,4}`: the same two meshes, the programs overlapped
  (`rljax.drivers.overlap`; async with `rl.stale_rows=wait`, `rl.queue_batches=2`).

Models: (a) the default job's (rljax/configs/default.toml: 64 prompts x 8 samples, 6 new
tokens); (b) a qwen2-small-sized policy (hidden 512, 8 layers, 8/4 heads, MLP 1376, as
`rljax.models.config.preset("qwen2-small")`, but the default job's chars tokenizer) with 64 new
tokens and no EOS (every row runs its whole budget, as in bench_sampling) so sampling is a real
share, at 4 prompts x 4 samples so every case fits the time a shared 2-core machine allows. Both
start from random init (the loop's own `run.params`): rewards are mostly 0, and each iteration
does a run's compute, not its learning (equal learning is not measured here).

Recorded per case: throughput, s/iteration, the drivers' means of `time/sampler_busy_frac`,
`time/trainer_busy_frac`, `time/weight_sync_s`, `async/staleness_mean|max`, `async/dropped_rows`,
`async/queue_depth`, and the machine load: /proc/loadavg before and after, and the CPU seconds
other processes used while it ran (all CPU time from /proc/stat minus the child's own). Writes
bench/results/async.json (or `--out`; a model run later replaces only its own entry there).

    .venv/bin/python bench/bench_async.py [--models default qwen2-small] [--iterations 10] [--skip 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
TWO_DEVICES = "--xla_force_host_platform_device_count=2"
CACHE_DIR = os.path.join(tempfile.gettempdir(), "rljax_bench_async_cache")

# name -> (config overrides, XLA host devices)
CASES = {
    "sync_1dev": (["rl.mode=sync"], 1),
    "sync_split": (["rl.mode=sync", "mesh.sampler_devices=1"], 2),
    "one_step_off": (["rl.mode=one_step_off", "mesh.sampler_devices=1"], 2),
    "async_eta1": (["rl.mode=async", "mesh.sampler_devices=1", "rl.max_staleness=1"], 2),
    "async_eta2": (["rl.mode=async", "mesh.sampler_devices=1", "rl.max_staleness=2"], 2),
    "async_eta4": (["rl.mode=async", "mesh.sampler_devices=1", "rl.max_staleness=4"], 2),
}
MODELS = {
    "default": [],
    "qwen2-small": ["model.hidden_size=512", "model.intermediate_size=1376", "model.num_layers=8",
                    "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=64", "model.max_positions=128",
                    "sampling.max_new_tokens=64", "sampling.eos_ids=[]", "sampling.num_samples=4",
                    "rl.prompts_per_iteration=4"],
}
COMMON = ["data.size=2000", "data.eval_size=16", "eval.size=16", "metrics.tensorboard=false",
          "metrics.progress_bar=false", "metrics.samples_every=0", "rl.queue_batches=2", "rl.stale_rows=wait"]
MEANS = ("time/sampler_busy_frac", "time/trainer_busy_frac", "time/weight_sync_s", "time/sample_s", "time/update_s",
         "time/verify_s", "async/staleness_mean", "async/dropped_rows", "async/skipped_batches", "async/queue_depth")


# ----------------------------------------------------------------------------- child: one case


def run_case(overrides: list[str], iterations: int, skip: int) -> dict:
    """Runs the loop's steps for `iterations` iterations and returns throughput and metric means."""
    import jax
    import numpy as np

    from rljax.drivers import DRIVERS
    from rljax.train import loop
    from rljax.train.run import abstract_train_state, build_run, new_train_state
    from rljax.train.config import load_config

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"output_dir={out}", f"rl.iterations={iterations}", *overrides])
        run = build_run(cfg, resume=False, log=lambda s: None)
        state = new_train_state(run, run.params)
        driver = DRIVERS[cfg.driver].build(run, abstract_train_state(run))
        rows, ends = [], []
        try:
            for it in range(iterations):
                t0 = time.perf_counter()
                state, metrics, _ = driver.step(state, it)
                metrics = jax.block_until_ready(metrics)
                m = loop.step_metrics(metrics, driver.timings(time.perf_counter() - t0))
                ends.append(time.perf_counter())
                m["trained_tokens"] = m["train/rows"] * m["train/length_mean"]
                rows.append(m)
        finally:
            driver.close()
    timed = rows[skip:]
    wall = ends[-1] - ends[skip - 1]
    tokens = sum(r["trained_tokens"] for r in timed)
    out = {"devices": jax.device_count(), "model_params": int(sum(x.size for x in jax.tree.leaves(run.params))),
           "prompts": cfg.rl.prompts_per_iteration, "samples_per_prompt": cfg.sampling.num_samples,
           "max_new_tokens": cfg.sampling.max_new_tokens, "iterations_timed": len(timed),
           "trained_tokens_per_s": tokens / wall, "s_per_iteration": wall / len(timed),
           "first_iterations_s": [round(r["time/iteration_s"], 3) for r in rows[:skip]],
           "trained_tokens_per_iteration": tokens / len(timed),
           "generated_tokens_per_iteration": float(np.mean([r["rollout/tokens"] for r in timed])),
           "reward_mean": float(np.mean([r["train/reward_mean"] for r in timed])),
           "staleness_max": max((r.get("async/staleness_max", 0.0) for r in timed), default=0.0)}
    for key in MEANS:
        if key in timed[0]:
            out[key] = float(np.mean([r[key] for r in timed]))
    return out


# ----------------------------------------------------------------------------- parent: the cases in turn


def _cpu_jiffies() -> int:
    """Busy CPU time of the whole machine (user + nice + system + irq + softirq + steal), in jiffies."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]


def _loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def spawn(model: str, case: str, iterations: int, skip: int) -> dict:
    """Runs one case in a child process (its own XLA device count) and adds the machine's load."""
    overrides, devices = CASES[case]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = " ".join(f for f in [env.get("XLA_FLAGS", ""), TWO_DEVICES if devices == 2 else ""] if f)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)  # later cases reuse the update program's compile
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--iterations", str(iterations), "--skip", str(skip),
           "--overrides", *COMMON, *MODELS[model], *overrides]
    load_before, busy0, t0 = _loadavg(), _cpu_jiffies(), time.perf_counter()
    child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, busy = time.perf_counter() - t0, (_cpu_jiffies() - busy0) / os.sysconf("SC_CLK_TCK")
    if proc.returncode != 0:
        raise RuntimeError(f"{model}/{case} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    own = (child1.ru_utime - child0.ru_utime) + (child1.ru_stime - child0.ru_stime)
    result["load"] = {"loadavg_before": load_before, "loadavg_after": _loadavg(), "process_wall_s": round(wall, 1),
                      "own_cpu_s": round(own, 1), "other_processes_cpu_s": round(max(busy - own, 0.0), 1),
                      "other_processes_cores": round(max(busy - own, 0.0) / wall, 2)}
    return result


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per case: its rounds, the mean throughput, and speed-ups over each sync case taken within a
    round (same load period) and averaged. Plus the overlap's upper bound from sync_split's own
    stage times: (sample + sync + update) / max(sample, sync + update)."""
    cases = {}
    for case, rounds in runs.items():
        row = {"trained_tokens_per_s": statistics.mean(r["trained_tokens_per_s"] for r in rounds),
               "s_per_iteration": statistics.mean(r["s_per_iteration"] for r in rounds), "rounds": rounds}
        for base in ("sync_1dev", "sync_split"):
            if base in runs:
                row[f"speedup_vs_{base}"] = statistics.mean(
                    r["trained_tokens_per_s"] / b["trained_tokens_per_s"] for r, b in zip(rounds, runs[base]))
        cases[case] = row
    out = {"cases": cases}
    if "sync_split" in runs:
        split = runs["sync_split"]
        sample, sync, update = (statistics.mean(r[k] for r in split)
                                for k in ("time/sample_s", "time/weight_sync_s", "time/update_s"))
        out["overlap_bound_from_sync_split"] = (sample + sync + update) / max(sample, sync + update)
    return out


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2, help="leading iterations left out (compile, queue filling)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the cases, in alternating order")
    ap.add_argument("--out", default=os.path.join(RESULTS, "async.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_case(args.overrides, args.iterations, args.skip)))
        return

    import jax

    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform()},
              "versions": {"python": platform.python_version(), "jax": jax.__version__},
              "method": {"common_overrides": COMMON,
                         "models": MODELS, "cases": {k: {"overrides": v[0], "xla_host_devices": v[1]}
                                                      for k, v in CASES.items()}},
              "models": {}}
    if os.path.exists(args.out):  # the models run in separate invocations share one file
        with open(args.out) as f:
            result["models"] = json.load(f).get("models", {})
    for model in args.models:
        runs: dict[str, list[dict]] = {case: [] for case in args.cases}
        for r in range(args.rounds):  # alternate the order so drifting load falls on every case alike
            for case in args.cases if r % 2 == 0 else args.cases[::-1]:
                runs[case].append(spawn(model, case, args.iterations, args.skip))
                print(model, r, case, json.dumps(runs[case][-1]), flush=True)
        result["models"][model] = {"date": result["date"], "iterations": args.iterations, "skipped": args.skip,
                                   "rounds": args.rounds, **summarize(runs)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
