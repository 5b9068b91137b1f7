"""End-to-end RL iteration time on the default job's model, split by stage, plus compile counts.

The loop runs rollout -> update as one compiled program; to split it, this script also times each
stage compiled on its own (`sample`, the verifier callback's host time, `update_step` on the
`RolloutBatch`) on the same batch. It counts XLA compilations (jax.monitoring) over several
iterations to show that a run compiles once, and records the sampler/trainer log-prob gap the
update reports (`update/logp_diff_mean|max`). Writes bench/results/iteration.json.

    .venv/bin/python bench/bench_iteration.py [--iterations 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rljax.rewards.config import build_reward
from rljax.models.setup import build_policy, build_tokenizer
from rljax.data.example import verifier_metadata  # noqa: E402
from rljax.data.pipeline import prompt_batches  # noqa: E402
from rljax.rewards import as_callback  # noqa: E402
from rljax.sampling import sample  # noqa: E402
from rljax.train import setup  # noqa: E402
from rljax.train.config import load_config  # noqa: E402
from rljax.stages.iteration import make_iteration  # noqa: E402
from rljax.train.run import sample_controls  # noqa: E402
from rljax.update import RolloutBatch, init_train_state, update_step  # noqa: E402

_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: _COMPILES.append(secs) if name == "/jax/core/compile/backend_compile_duration" else None)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "iteration.json"))
    args = ap.parse_args()

    cfg = load_config(None, ["data.size=3000"])
    tok = build_tokenizer(cfg.model)
    model_cfg, params = build_policy(cfg.model, tok, jax.random.key(0))
    train_set, _, _ = setup.build_splits(cfg.data)
    data = prompt_batches(train_set, tokenizer=tok, batch_size=cfg.rl.prompts_per_iteration, seed=0,
                          max_prompt_len=cfg.data.max_prompt_tokens, fmt=setup.prompt_format(cfg.data), add_bos=True)
    callback = as_callback(build_reward(cfg.reward), tok, [verifier_metadata(e) for e in data.examples])
    controls = sample_controls(cfg, tok)
    state = init_train_state(model_cfg, params, cfg.algorithm, cfg.optim, update_cfg=cfg.update,
                             shaping=cfg.shaping)
    iteration = make_iteration(controls, callback, num_groups=cfg.rl.prompts_per_iteration)
    it = iter(data.dataset)

    fused, compiles_first = [], None
    for i in range(args.iterations):
        b = next(it)
        t0 = time.perf_counter()
        state, metrics, _ = iteration(state, b.tokens_bt, b.mask_bt, b.indices_b.astype(np.int32), jax.random.key(i))
        jax.block_until_ready(metrics)
        fused.append(time.perf_counter() - t0)
        if i == 0:
            compiles_first = len(_COMPILES)
    compiles_total = len(_COMPILES)
    gap = {k: float(metrics[f"update/logp_diff_{k}"]) for k in ("mean", "max")}  # last iteration's

    # The same stages compiled separately, on one batch.
    b = next(it)
    sample_jit = jax.jit(sample, static_argnames=("cfg", "controls"))
    _timed(sample_jit, model_cfg, state.params, b.tokens_bt, b.mask_bt, jax.random.key(0), controls)
    out, t_sample = _timed(sample_jit, model_cfg, state.params, b.tokens_bt, b.mask_bt, jax.random.key(1), controls)
    rows = np.repeat(b.indices_b.astype(np.int32), controls.num_samples)
    t0 = time.perf_counter()
    rewards = callback.eager(out.tokens, out.mask, rows)
    t_verify = time.perf_counter() - t0
    n = controls.num_samples
    prompt = np.repeat(b.tokens_bt, n, 0)
    pmask = np.repeat(b.mask_bt, n, 0)
    batch = RolloutBatch(tokens_bt=np.concatenate([prompt, out.tokens], 1),
                         attn_mask_bt=np.concatenate([pmask, out.mask], 1),
                         loss_mask_bt=np.concatenate([np.zeros_like(pmask), out.mask], 1),
                         sampler_logp_bt=np.concatenate([np.zeros(pmask.shape, np.float32), out.logprobs], 1),
                         rewards_b=rewards.total_b, group_ids_b=np.repeat(np.arange(len(b.tokens_bt)), n),
                         completion_len=controls.max_new_tokens)
    (state, _), _ = _timed(update_step, state, batch, jax.random.key(2))
    _, t_update = _timed(update_step, state, batch, jax.random.key(3))

    steady = float(np.median(fused[1:])) if len(fused) > 1 else fused[0]
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "backend": jax.default_backend()},
        "versions": {"python": platform.python_version(), "jax": jax.__version__},
        "setup": {"model_params": int(sum(x.size for x in jax.tree.leaves(params))),
                  "prompts": cfg.rl.prompts_per_iteration, "samples_per_prompt": n,
                  "max_new_tokens": controls.max_new_tokens, "algorithm": cfg.algorithm.algorithm},
        "fused_iteration_s": {"first_with_compile": fused[0], "steady_median": steady},
        "stages_separately_s": {"sample": t_sample, "verify": t_verify, "update": t_update},
        "compilations": {"first_iteration": compiles_first, "after_all_iterations": compiles_total,
                         "recompiles_after_first": compiles_total - compiles_first},
        "sampler_trainer_logp_gap_nats": gap,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
