"""Padding-free updates (issue 37): useful tokens/s of the packed update against the padded one,
in one process, on two workloads. Writes bench/results/packing.json.

    .venv/bin/python bench/bench_packing.py [--rows 16] [--repeats 3]

- long-tail: the completion lengths of `bench/longtail.py` (lognormal, median 100, mean 212, 5% at
  the 1,024 cap; the first `--rows` of its 256), a 64-token prompt, rows 64 + 1,024 wide;
  qwen2-tiny, f32. Padded: `--rows / 8` rows per micro-batch (8 micro-batches). Packed: buffers of
  1,088 tokens, micro-batches of the same token budget (`max_tokens_per_microbatch`).
- default job: the default job's model (3 layers, width 128, a 17-symbol vocabulary) and shapes,
  512 rows x 18 columns (prompt 10, completion up to 8), one micro-batch; packed with buffers of
  36 tokens (two rows fit one).
- gsm8k-shape (an iteration, reduced): the GSM8K recipe's row shape (`configs/gsm8k_qwen.toml`:
  prompt bucket 256, 512 new tokens, remat, micro-batches of 8 rows) on qwen2-tiny with
  `--gsm8k-rows` rows (default 32: 4 prompts x 8 samples), completion lengths lognormal with median
  150 and 5% at the 512 cap (imposed on the sampler, as `bench/longtail.py` does). One iteration =
  the continuous sampler's call + one update step; the sampler's time is the same for both.
Useful tokens are the rows' real tokens (prompt + completion). Times are per update step, the
median of `--repeats` steps after the compile; process CPU seconds (all threads) beside wall
seconds, because the machine is shared (the load average is recorded).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import ModelConfig, init_params, preset
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update_step

sys.path.insert(0, os.path.dirname(__file__))
from longtail import imposed_lengths  # noqa: E402


def batch_for(cfg, prompt: int, lengths: np.ndarray, width: int, seed: int = 0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    rows = len(lengths)
    toks = rng.integers(2, cfg.vocab_size, (rows, width)).astype(np.int32)
    col = np.arange(width)[None, :]
    attn = col < prompt + lengths[:, None]
    loss = attn & (col >= prompt)
    return RolloutBatch(tokens_bt=jnp.asarray(np.where(attn, toks, 0)), attn_mask_bt=jnp.asarray(attn),
                        loss_mask_bt=jnp.asarray(loss),
                        sampler_logp_bt=jnp.asarray(np.where(loss, -rng.random((rows, width)) * 3, 0), jnp.float32),
                        rewards_b=jnp.asarray(rng.integers(0, 2, rows), jnp.float32),
                        group_ids_b=prompt_major_group_ids(rows, min(8, rows)), completion_len=width - prompt)


def time_steps(cfg: ModelConfig, batch: RolloutBatch, update_cfg: UpdateConfig, repeats: int) -> dict:
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(algorithm="grpo"),
                             OptimConfig(learning_rate=1e-6), update_cfg=update_cfg)
    t = time.perf_counter()
    state, m = update_step(state, batch, jax.random.key(0))
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t
    wall, cpu = [], []
    for i in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        state, m = update_step(state, batch, jax.random.key(i + 1))
        jax.block_until_ready((state.params, m))
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    useful = int(np.asarray(batch.attn_mask_bt).sum())
    out = {"wall_s": round(statistics.median(wall), 3), "cpu_s": round(statistics.median(cpu), 3),
           "compile_s": round(compile_s, 1), "useful_tokens": useful,
           "useful_tokens_per_s": round(useful / statistics.median(wall), 1),
           "useful_tokens_per_cpu_s": round(useful / statistics.median(cpu), 1),
           "loss": float(m["loss/policy"])}
    for k in ("update/pad_fraction_padded", "update/pad_fraction", "update/packed_microbatches"):
        if k in m:
            out[k.split("/")[1]] = round(float(m[k]), 4)
    return out


def gsm8k_lengths(rows: int, median: int = 150, cap: int = 512, cap_share: float = 0.05) -> np.ndarray:
    """`rows` completion lengths: lognormal quantiles with `median` and `cap_share` of the rows at
    `cap` (the long-tail construction of `bench/longtail.py` at the GSM8K recipe's cap)."""
    normal = statistics.NormalDist()
    sigma = np.log(cap / median) / normal.inv_cdf(1 - cap_share)
    q = [float(np.exp(np.log(median) + sigma * normal.inv_cdf((i + 0.5) / rows))) for i in range(rows)]
    return np.random.default_rng(7).permutation(np.clip(np.rint(q), 1, cap).astype(np.int32))


def gsm8k_iteration(rows: int, repeats: int) -> dict:
    """The GSM8K recipe's shape, reduced (see the module docstring): sampler seconds, then the
    padded and packed update steps on the sampled rows; iteration = sampler + update."""
    from longtail import EOS_ID, PAD_ID, forced_lengths_jax

    from rljax.sampling import SampleControls, generate

    prompt, new, samples = 256, 512, 8
    cfg = preset("qwen2-tiny")
    params = init_params(cfg, jax.random.key(0))
    lengths = gsm8k_lengths(rows)
    prompts = np.random.default_rng(3).integers(2, cfg.vocab_size, (rows // samples, prompt)).astype(np.int32)
    controls = SampleControls(max_new_tokens=new, num_samples=samples, temperature=1.0, eos_ids=(EOS_ID,),
                              pad_id=PAD_ID, scheduler="continuous", logits_processor=forced_lengths_jax(lengths))
    run = lambda i: jax.block_until_ready(generate(cfg, params, prompts, key=jax.random.key(i), controls=controls))
    result = run(0)  # compiles
    wall, cpu = [], []
    for i in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        result = run(i + 1)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    got = np.asarray(result.lengths)
    assert np.array_equal(np.sort(got), np.sort(lengths)), "the sampler did not impose the lengths"
    batch = batch_for(cfg, prompt, got, prompt + new)
    micro = 8  # the recipe's rows per micro-batch
    out = {"rows": rows, "lengths": {"median": float(np.median(got)), "mean": float(got.mean()), "max": int(got.max())},
           "sample": {"wall_s": round(statistics.median(wall), 3), "cpu_s": round(statistics.median(cpu), 3)}}
    for name, ucfg in (("padded", UpdateConfig(num_microbatches=rows // micro, remat=True)),
                       ("packed", UpdateConfig(packing=True, remat=True, max_tokens_per_microbatch=micro * (prompt + new)))):
        out[name] = row = time_steps(cfg, batch, ucfg, repeats)
        row["iteration_wall_s"] = round(out["sample"]["wall_s"] + row["wall_s"], 3)
        row["iteration_cpu_s"] = round(out["sample"]["cpu_s"] + row["cpu_s"], 3)
        print("gsm8k-shape", name, json.dumps(row), flush=True)
    out["update_packed_over_padded_wall"] = round(out["padded"]["wall_s"] / out["packed"]["wall_s"], 2)
    out["iteration_packed_over_padded_wall"] = round(out["padded"]["iteration_wall_s"] / out["packed"]["iteration_wall_s"], 2)
    out["iteration_packed_over_padded_cpu"] = round(out["padded"]["iteration_cpu_s"] / out["packed"]["iteration_cpu_s"], 2)
    return out


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gsm8k-rows", type=int, default=32)
    parser.add_argument("--only", choices=("long-tail", "default-job", "gsm8k-shape"), nargs="*",
                        help="workloads to run (default: all)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "packing.json"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    cases = {}

    only = set(args.only or ("long-tail", "default-job", "gsm8k-shape"))
    if "long-tail" in only:
        cfg = preset("qwen2-tiny")
        lengths = imposed_lengths()[:args.rows]
        batch = batch_for(cfg, 64, lengths, 64 + 1024)
        micro = max(1, args.rows // 8)
        padded = UpdateConfig(num_microbatches=args.rows // micro)
        packed = UpdateConfig(packing=True, max_tokens_per_microbatch=micro * 1088)
        cases["long-tail"] = {"lengths": {"median": float(np.median(lengths)), "mean": float(lengths.mean()),
                                          "max": int(lengths.max())}}
        for name, ucfg in (("padded", padded), ("packed", packed)):
            cases["long-tail"][name] = row = time_steps(cfg, batch, ucfg, args.repeats)
            print("long-tail", name, json.dumps(row), flush=True)

    dj = ModelConfig(vocab_size=17, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=32, qkv_bias=True, max_positions=256)
    rng = np.random.default_rng(1)
    batch = batch_for(dj, 10, rng.integers(2, 9, 512), 18)
    if "default-job" in only:
        cases["default-job"] = {}
        for name, ucfg in (("padded", UpdateConfig()), ("packed", UpdateConfig(packing=True, pack_length=36,
                                                                               max_tokens_per_microbatch=512 * 18))):
            cases["default-job"][name] = row = time_steps(dj, batch, ucfg, args.repeats)
            print("default-job", name, json.dumps(row), flush=True)
    for case in cases.values():
        case["packed_over_padded_wall"] = round(case["padded"]["wall_s"] / case["packed"]["wall_s"], 2)
        case["packed_over_padded_cpu"] = round(case["padded"]["cpu_s"] / case["packed"]["cpu_s"], 2)
    if "gsm8k-shape" in only:
        cases["gsm8k-shape"] = gsm8k_iteration(args.gsm8k_rows, args.repeats)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
                          "load_before": load_before},
              "versions": {"python": sys.version.split()[0], "jax": jax.__version__},
              "cases": cases}
    result["machine"]["load_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
