"""What each stability control (issue 51) costs in the update step, on bench_update.py's shapes.

qwen2-tiny, B=32, T=128, one epoch, one mini-batch, unrolled layers (bench/bench_update.py's
setup). Each arm's compiled update is timed `--repeats` times, arms interleaved round by round;
reported: the median process CPU time (the machine is shared, so wall time is noisy) and its ratio
to the baseline of the same family (plain for the entropy controls; plain with the old log-probs
recomputed for the rollout corrections, which all need that recompute). Writes
bench/results/stability_cost_CONFIG.json.

    .venv/bin/python bench/stability_cost.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from bench_update import B, GROUP, PROMPT, T, make_batch  # noqa: E402  (bench/ is on sys.path)
from rljax.models import init_params, preset
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update_step

R = dict(recompute_old_logp=True)
ARMS = {
    "plain": ({}, None),
    "clip_cov": (dict(policy_loss="clip_cov"), "plain"),
    "kl_cov": (dict(policy_loss="kl_cov"), "plain"),
    "top_entropy_quantile=0.2": (dict(top_entropy_quantile=0.2), "plain"),
    "entropy_target": (dict(entropy_target=1.0, entropy_coef=1e-3), "plain"),
    "plain+recompute": (R, None),
    "kl_cov+recompute (no scoring pass)": (dict(policy_loss="kl_cov", **R), "plain+recompute"),
    "icepop": (dict(off_policy="icepop", **R), "plain+recompute"),
    "seq_reject": (dict(off_policy="seq_reject", **R), "plain+recompute"),
    "mask_kl": (dict(off_policy="mask_kl", **R), "plain+recompute"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--config", default="qwen2-tiny")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help="a subset of the arms (with their baselines)")
    args = ap.parse_args()
    arms = {name: ARMS[name] for name in ARMS if name in args.arms or any(ARMS[a][1] == name for a in args.arms)}
    cfg = preset(args.config)
    params = init_params(cfg, jax.random.key(0))
    toks, attn, loss, old_logp, rewards = make_batch(cfg)
    batch = RolloutBatch(jnp.asarray(toks), jnp.asarray(attn), jnp.asarray(loss), jnp.asarray(old_logp),
                         jnp.asarray(rewards), prompt_major_group_ids(B, GROUP), completion_len=T - PROMPT)
    states = {}
    for name, (kw, _) in arms.items():
        algo = AlgorithmConfig(algorithm="grpo", kl_coef=0.0, **kw)
        states[name] = init_train_state(cfg, jax.tree.map(jnp.copy, params), algo, OptimConfig(learning_rate=1e-6),
                                        update_cfg=UpdateConfig(unroll_layers=True))
        states[name], m = update_step(states[name], batch, jax.random.key(0))  # compile
        jax.block_until_ready(m)
    cpu = {name: [] for name in arms}
    for i in range(args.repeats):
        for name in arms:
            t = time.process_time()
            states[name], m = update_step(states[name], batch, jax.random.key(i + 1))
            jax.block_until_ready((states[name].params, m))
            cpu[name].append(time.process_time() - t)
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": args.config, "B": B, "T": T,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "arms": {}}
    for name, (_, base) in arms.items():
        med = statistics.median(cpu[name])
        out["arms"][name] = {"cpu_s_median": med, "cpu_s": cpu[name],
                             "vs_baseline": None if base is None else med / statistics.median(cpu[base])}
        print(f"{name:40s} {med:7.3f} s  " + ("" if base is None else f"x{med / statistics.median(cpu[base]):.3f}"))
    with open(os.path.join(os.path.dirname(__file__), "results", f"stability_cost_{args.config}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
