"""Scaling benchmark: the RL update step and the sampler on 1, 2, 4 and 8 devices, and the weight
sync between the trainer and sampler layouts. Writes bench/results/scaling.json.

    .venv/bin/python bench/bench_scaling.py [--model qwen2-tiny] [--batch 16] [--seq 64]

On CPU it simulates 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8): they share
the host's cores, so the numbers measure sharding overhead, not speed-up. On an accelerator it
uses the real devices; `--peak-tflops` (per device) adds the update step's MFU, counting
6 * params * tokens per trained token pass plus 2 * params * tokens per no-grad scoring pass
(`prepare_batch` scores the batch only for a reference policy or `recompute_old_logp`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rljax import sharding  # noqa: E402
from rljax.models import init_params, preset  # noqa: E402
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids  # noqa: E402
from rljax.optim import OptimConfig  # noqa: E402
from rljax.sampling import SampleControls, generate  # noqa: E402
from rljax.update import RolloutBatch, init_train_state, update_step  # noqa: E402


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _batch(cfg, b: int, t: int, prompt: int) -> RolloutBatch:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    attn = np.ones((b, t), bool)
    loss = np.zeros((b, t), bool)
    loss[:, prompt:] = True
    sampler_logp = np.where(loss, rng.normal(-4.0, 0.5, (b, t)), 0.0).astype(np.float32)
    return RolloutBatch(tokens, attn, loss, sampler_logp, rng.integers(0, 2, b).astype(np.float32),
                        prompt_major_group_ids(b, 4), completion_len=t - prompt)


def bench_update(cfg, algo, mesh_cfg, devices, batch, repeats):
    """Median seconds of one sharded update_step (compiled once, then timed)."""
    layout = sharding.trainer_layout(sharding.make_mesh(mesh_cfg, devices))
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), algo, OptimConfig(learning_rate=1e-5))
    state_sh, batch_sh = layout.tree(state), layout.batch(batch)
    step = sharding.make_sharded(update_step, layout.mesh, (state_sh, batch_sh, layout.replicated),
                                 (state_sh, layout.replicated))
    state, batch = jax.device_put(state, state_sh), jax.device_put(batch, batch_sh)
    key = jax.random.key(0)
    start = time.perf_counter()
    state, _ = jax.block_until_ready(step(state, batch, key))
    compile_s = time.perf_counter() - start
    holder = {"state": state}

    def once():
        holder["state"], metrics = step(holder["state"], batch, key)
        return metrics
    return compile_s, _median_seconds(once, repeats)


def bench_sampler(cfg, mesh_cfg, devices, prompts, max_new, repeats):
    """Median seconds of one generate call on params in the sampler layout."""
    mesh = sharding.make_mesh(mesh_cfg, devices)
    params = sharding.shard_params(init_params(cfg, jax.random.key(0)), mesh, fsdp=False)
    controls = SampleControls(max_new_tokens=max_new, eos_ids=())
    run = lambda: generate(cfg, params, prompts, key=jax.random.key(1), controls=controls).tokens  # noqa: E731
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start, _median_seconds(run, repeats)


def bench_sync(cfg, trainer_cfg, sampler_cfg, repeats):
    """Median seconds of sync_weights from the trainer layout to the sampler layout (all devices)."""
    params = init_params(cfg, jax.random.key(0))
    trainer = sharding.trainer_layout(sharding.make_mesh(trainer_cfg))
    sampler = sharding.sampler_layout(sharding.make_mesh(sampler_cfg))
    train_params = sharding.shard_params(params, trainer.mesh)
    target = sampler.params(params)
    sharding.sync_weights(train_params, target)  # warm-up
    seconds = [sharding.sync_weights(train_params, target)[1] for _ in range(repeats)]
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return statistics.median(seconds), nbytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-device peak, for MFU")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "scaling.json"))
    args = parser.parse_args(argv)

    cfg = preset(args.model, param_dtype=args.dtype, compute_dtype=args.dtype)
    algo = AlgorithmConfig(algorithm="grpo", kl_coef=0.0)
    batch = _batch(cfg, args.batch, args.seq, args.prompt)
    prompts = np.asarray(batch.tokens_bt[:, :args.prompt])
    tokens_per_update = args.batch * args.seq
    rows = []
    for n in (1, 2, 4, 8):
        if n > jax.device_count():
            break
        devices = jax.devices()[:n]
        for name, mesh_cfg in (("fsdp", sharding.MeshConfig(fsdp=n)),
                               ("fsdp_tp2", sharding.MeshConfig(fsdp=max(n // 2, 1), tensor=2))):
            if name == "fsdp_tp2" and n < 2:
                continue
            compile_s, update_s = bench_update(cfg, algo, mesh_cfg, devices, batch, args.repeats)
            row = {"devices": n, "layout": name, "mesh": dict(zip(sharding.AXES, mesh_cfg.resolve(n))),
                   "update_compile_s": round(compile_s, 3), "update_s": round(update_s, 4),
                   "update_tokens_per_s": round(tokens_per_update / update_s, 1)}
            if args.peak_tflops:
                scoring = int(algo.needs.reference_logp) + int(algo.recompute_old_logp)  # prepare_batch's passes
                flops = (6 + 2 * scoring) * cfg.num_params() * tokens_per_update
                row["update_mfu"] = round(flops / update_s / (args.peak_tflops * 1e12 * n), 4)
            s_mesh = sharding.MeshConfig(data=-1, fsdp=1, tensor=1 if name == "fsdp" else 2)
            s_compile, s_time = bench_sampler(cfg, s_mesh, devices, prompts, args.max_new, args.repeats)
            row.update({"sampler_mesh": dict(zip(sharding.AXES, s_mesh.resolve(n))),
                        "sampler_compile_s": round(s_compile, 3), "sampler_s": round(s_time, 4),
                        "sampler_tokens_per_s": round(args.batch * args.max_new / s_time, 1)})
            rows.append(row)
            print(json.dumps(row), flush=True)

    sync_s, nbytes = bench_sync(cfg, sharding.MeshConfig(fsdp=-1),
                                sharding.MeshConfig(data=-1, fsdp=1, tensor=2 if jax.device_count() % 2 == 0 else 1),
                                max(args.repeats, 5))
    result = {
        "model": args.model, "dtype": args.dtype, "num_params": cfg.num_params(),
        "batch": args.batch, "seq": args.seq, "prompt": args.prompt, "max_new_tokens": args.max_new,
        "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
        "host_cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(),
        "jax": jax.__version__,
        "note": ("simulated CPU devices share the host cores: timings show sharding overhead, not speed-up; "
                 "the host was shared with other jobs, so expect noise") if jax.default_backend() == "cpu" else "",
        "scaling": rows,
        "weight_sync": {"from": "trainer fsdp=all", "to": "sampler data x tensor=2, no fsdp",
                        "param_bytes": nbytes, "seconds": round(sync_s, 5),
                        "gb_per_s": round(nbytes / sync_s / 1e9, 3)},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["weight_sync"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
