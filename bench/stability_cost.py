"""What each stability control (issue 51) costs in the update step, as paired ratios.

One update step (GRPO, one epoch, one mini-batch, AdamW, f32) of a preset model on a random
batch of `--batch` rows x `--seq` tokens (the last 3/4 of each row are the completion). Every arm
is compiled once; then, `--repeats` times, each control runs back to back with its baseline,
in alternating order (baseline first on even repeats, the control first on odd ones), so both
halves of a pair see the same machine load. Per pair: the control's time / the baseline's; the
report is the median pair ratio with its min and max, for process CPU time (all threads; what
the step costs in work, robust to other jobs on a shared CPU) and for wall time.

Baselines: plain GRPO for the entropy controls; GRPO with `recompute_old_logp` for the rollout
corrections (they all need that recompute, so its own cost is not theirs) and for KL-Cov on its
fast path (the recomputed old log-probs serve as the selection's log-probs, no scoring pass).

The token controls (Clip-Cov, KL-Cov, the entropy mask) select from the loss's own forward at
this shape (one unpacked micro-batch, `rljax.update.controls.controls_in_loss`). Their
"... (scoring pass)" arms are the same configs compiled with that off, so the reference path's
no-gradient scoring forward runs, as it does with several micro-batches or packing: the cost the
loss's path removes, measured in the same process and minutes.

    .venv/bin/python bench/stability_cost.py [--config qwen2-tiny] [--batch 16] [--seq 64] [--repeats 9]

Writes bench/results/stability_cost_CONFIG.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import init_params, preset
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update_step
from rljax.update import step as step_mod

R = dict(recompute_old_logp=True)
# name: (algorithm overrides, baseline arm; None: a baseline)
ARMS = {
    "plain": ({}, None),
    "clip_cov": (dict(policy_loss="clip_cov"), "plain"),
    "kl_cov": (dict(policy_loss="kl_cov"), "plain"),
    "top_entropy_quantile=0.2": (dict(top_entropy_quantile=0.2), "plain"),
    "entropy_target": (dict(entropy_target=1.0, entropy_coef=1e-3), "plain"),
    "clip_cov (scoring pass)": (dict(policy_loss="clip_cov"), "plain"),
    "kl_cov (scoring pass)": (dict(policy_loss="kl_cov"), "plain"),
    "top_entropy_quantile=0.2 (scoring pass)": (dict(top_entropy_quantile=0.2), "plain"),
    "plain+recompute": (R, None),
    "kl_cov+recompute (fast path)": (dict(policy_loss="kl_cov", **R), "plain+recompute"),
    "icepop": (dict(off_policy="icepop", **R), "plain+recompute"),
    "seq_reject": (dict(off_policy="seq_reject", **R), "plain+recompute"),
    "mask_kl": (dict(off_policy="mask_kl", **R), "plain+recompute"),
}
GROUP = 8
SCORING = " (scoring pass)"  # arms compiled with the selection taken by the reference scoring pass


def make_batch(cfg, b: int, t: int, seed: int = 0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    prompt = t // 4
    loss = np.zeros((b, t), bool)
    loss[:, prompt:] = True
    return RolloutBatch(jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)),
                        jnp.ones((b, t), bool), jnp.asarray(loss),
                        jnp.asarray((-rng.random((b, t)) * 5).astype(np.float32)),
                        jnp.asarray(rng.integers(0, 2, b).astype(np.float32)),
                        prompt_major_group_ids(b, GROUP), completion_len=t - prompt)


def _step_fn(name):
    """The compiled update of an arm: `update_step`, or for a scoring-pass arm a separately traced
    copy with `controls_in_loss` off while it is traced (its own function object: no shared trace)."""
    if not name.endswith(SCORING):
        return update_step

    jitted = jax.jit(lambda s, b, k: step_mod.update(s, b, k), donate_argnums=(0,))

    def traced_off(state, batch, key):
        inside, step_mod.controls_in_loss = step_mod.controls_in_loss, lambda st: False
        try:
            return jitted(state, batch, key)
        finally:
            step_mod.controls_in_loss = inside
    return traced_off


def _timed(states, name, batch, key, steps):
    c, w = time.process_time(), time.perf_counter()
    states[name], m = steps[name](states[name], batch, key)
    jax.block_until_ready((states[name].params, m))
    return time.process_time() - c, time.perf_counter() - w


def _spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--config", default="qwen2-tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--tag", default="", help="appended to the output file's name")
    ap.add_argument("--arms", nargs="+", default=[a for a, (_, base) in ARMS.items() if base],
                    help="controls to time (their baselines are added)")
    args = ap.parse_args()
    controls = [a for a in args.arms if ARMS[a][1]]
    arms = {a: ARMS[a] for a in ARMS if a in controls or any(ARMS[c][1] == a for c in controls)}
    cfg = preset(args.config)
    params = init_params(cfg, jax.random.key(0))
    batch = make_batch(cfg, args.batch, args.seq)
    load0 = os.getloadavg()
    states, compile_s = {}, {}
    steps = {name: _step_fn(name) for name in arms}
    for name, (kw, _) in arms.items():
        algo = AlgorithmConfig(algorithm="grpo", kl_coef=0.0, **kw)
        states[name] = init_train_state(cfg, jax.tree.map(jnp.copy, params), algo, OptimConfig(learning_rate=1e-6),
                                        update_cfg=UpdateConfig(unroll_layers=True))
        t = time.perf_counter()
        _timed(states, name, batch, jax.random.key(0), steps)  # compile
        _timed(states, name, batch, jax.random.key(0), steps)  # warm
        compile_s[name] = time.perf_counter() - t
        print(f"compiled {name} ({compile_s[name]:.0f} s)", flush=True)
    loads = [os.getloadavg()[0]]
    pairs = {c: {"cpu": [], "wall": [], "base_cpu": [], "ctl_cpu": []} for c in controls}
    for i in range(args.repeats):
        key = jax.random.key(i + 1)
        for c in controls:
            base = ARMS[c][1]
            order = (base, c) if i % 2 == 0 else (c, base)
            got = {name: _timed(states, name, batch, key, steps) for name in order}
            pairs[c]["cpu"].append(got[c][0] / got[base][0])
            pairs[c]["wall"].append(got[c][1] / got[base][1])
            pairs[c]["base_cpu"].append(got[base][0])
            pairs[c]["ctl_cpu"].append(got[c][0])
        loads.append(os.getloadavg()[0])
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _commit(), "config": args.config, "B": args.batch, "T": args.seq,
           "repeats": args.repeats, "load_1min": {"start": load0[0], "during": loads},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "compile_s": compile_s,
           "controls": {}}
    print(f"{args.config} B={args.batch} T={args.seq}, {args.repeats} alternating pairs; load {min(loads):.1f}-"
          f"{max(loads):.1f}")
    print(f"{'control':32s} {'baseline':16s} {'base CPU s':>10s} {'CPU ratio (min-max)':>22s} {'wall ratio':>10s}")
    for c in controls:
        p = pairs[c]
        row = {"baseline": ARMS[c][1], "cpu_ratio": _spread(p["cpu"]), "wall_ratio": _spread(p["wall"]),
               "baseline_cpu_s": statistics.median(p["base_cpu"]), "control_cpu_s": statistics.median(p["ctl_cpu"]),
               "pairs": p}
        out["controls"][c] = row
        r = row["cpu_ratio"]
        print(f"{c:32s} {row['baseline']:16s} {row['baseline_cpu_s']:10.3f} "
              f"{r['median']:8.3f} ({r['min']:.3f}-{r['max']:.3f}) {row['wall_ratio']['median']:10.3f}", flush=True)
    with open(os.path.join(os.path.dirname(__file__), "results", f"stability_cost_{args.config}{args.tag}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
