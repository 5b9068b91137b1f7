"""LoRA against full fine-tuning: update-step tokens/s, params + optimiser bytes, and sampler tokens/s
with the adapters merged and unmerged.

For each model (qwen2-small, and Qwen2.5-0.5B's published shapes, random init):

- update: one GRPO-style update (`rljax.update.update_step`, DAPO loss, one epoch and mini-batch) at
  B x T tokens, full fine-tuning (f32 params) against LoRA at rank r on every attention and MLP
  projection (f32 base, and a bf16 base), f32 compute; tokens/s = B * T / step seconds, the median
  of `--repeats` after a compiling call, the variants timed in turn (one step of each per round)
  so that load from other processes falls on all of them alike.
- bytes: the train state's params + optimiser state (+ adapters) of the whole model, exact from
  its shapes (nothing allocated); the KL reference a full fine-tune also holds (a copy of the
  params) is listed apart.
- sampler: `rljax.sampling.generate` new tokens/s at batch `--sample-batch`, prompt 32, `--new`
  new tokens (no EOS), with plain base params, LoRA merged (`rljax.lora.merge`, what the trainer's
  sampler decodes by default) and LoRA unmerged (`attach`: two extra thin matmuls per projection
  and token), timed in turn. The merge itself is timed too (it runs once per iteration).

Timed runs may use fewer layers than the model has (`--layers`; by default 6 of Qwen2.5-0.5B's 24,
so that a full fine-tune's f32 params, gradients and Adam moments fit a small machine beside
other jobs); every width, the vocabulary and the head count stay the model's.

Writes bench/results/lora.json.

    .venv/bin/python bench/bench_lora.py [--models qwen2-small Qwen2.5-0.5B] [--rank 16] [--repeats 3]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rljax.lora import LoraConfig, attach, init_adapters, merge  # noqa: E402
from rljax.models import init_params, preset  # noqa: E402
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids  # noqa: E402
from rljax.optim import OptimConfig  # noqa: E402
from rljax.plan.shapes import model_config  # noqa: E402
from rljax.sampling import SampleControls, generate  # noqa: E402
from rljax.update import RolloutBatch, init_train_state, update_step  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PROMPT, GROUP = 32, 8


def _model(name: str):
    if name.startswith("qwen2-"):
        return preset(name)
    return model_config(name)


def _bytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _batch(cfg, b: int, t: int):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    loss = np.zeros((b, t), bool)
    loss[:, PROMPT:] = True
    return RolloutBatch(jnp.asarray(toks), jnp.ones((b, t), bool), jnp.asarray(loss),
                        jnp.asarray((-rng.random((b, t)) * 5).astype(np.float32)),
                        jnp.asarray(rng.integers(0, 2, b).astype(np.float32)), prompt_major_group_ids(b, GROUP),
                        completion_len=t - PROMPT)


def state_bytes(cfg, lora: LoraConfig | None) -> dict:
    """Exact bytes of the fresh train state's parts, from shapes alone (`jax.eval_shape`)."""
    state = jax.eval_shape(lambda: init_train_state(cfg, init_params(cfg, jax.random.key(0)),
                                                    AlgorithmConfig(algorithm="dapo"), OptimConfig(), lora=lora))
    out = {"params_bytes": _bytes(state.params), "opt_state_bytes": _bytes(state.opt_state),
           "adapter_bytes": _bytes(state.adapters),
           "trainable_params": sum(x.size for x in jax.tree.leaves(state.trainable))}
    out["params_plus_optimiser_bytes"] = out["params_bytes"] + out["opt_state_bytes"] + out["adapter_bytes"]
    return out


def _round_robin(calls: dict, repeats: int) -> dict:
    """Median seconds of each call, timed in turn (one of each per round), so load from other
    processes drifting during the run falls on every variant alike."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_update(variants: dict, batch, repeats: int) -> dict:
    """Update-step seconds and tokens/s of each (cfg, lora) variant, compiled first, timed in turn."""
    states, out, calls = {}, {}, {}
    for name, (cfg, lora) in variants.items():
        state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(algorithm="dapo"),
                                 OptimConfig(learning_rate=1e-6, max_grad_norm=None), lora=lora)
        t0 = time.perf_counter()
        state, m = update_step(state, batch, jax.random.key(0))
        jax.block_until_ready(m)
        out[name] = {"compile_and_first_step_s": time.perf_counter() - t0}
        states[name] = state

        def call(name=name):
            states[name], m = update_step(states[name], batch, jax.random.key(1))
            jax.block_until_ready((states[name], m))
        calls[name] = call
    for name, seconds in _round_robin(calls, repeats).items():
        out[name].update(step_s=seconds, tokens_per_s=batch.tokens_bt.size / seconds)
    return out


def bench_sampler(cfg, lora: LoraConfig, batch: int, new: int, repeats: int) -> dict:
    """New tokens/s of `generate` with the base, LoRA merged and LoRA unmerged, timed in turn."""
    params = init_params(cfg, jax.random.key(0))
    adapters = jax.tree.map(lambda x: x + 0.01, init_adapters(cfg, lora, jax.random.key(1)))  # B != 0
    controls = SampleControls(max_new_tokens=new, num_samples=1, temperature=1.0, eos_ids=(), pad_id=0)
    prompts = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, PROMPT)), jnp.int32)
    merge_jit = jax.jit(lambda p, a: merge(p, a, lora))
    jax.block_until_ready(merge_jit(params, adapters))
    t0 = time.perf_counter()
    merged = jax.block_until_ready(merge_jit(params, adapters))
    out = {"merge_s": time.perf_counter() - t0, "batch": batch, "prompt": PROMPT, "new": new}
    variants = {"base": params, "lora_merged": merged, "lora_unmerged": attach(params, adapters, lora)}
    calls = {name: (lambda p=p: jax.block_until_ready(
        generate(cfg, p, prompts, key=jax.random.key(0), controls=controls).tokens)) for name, p in variants.items()}
    for call in calls.values():
        call()  # compile
    for name, seconds in _round_robin(calls, repeats).items():
        out[f"{name}_tok_s"] = batch * new / seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen2-small", "Qwen2.5-0.5B"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 6],
                    help="layers of each model for the timed runs (0: all); bytes are always the whole model's")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 8], help="update rows per model (B)")
    ap.add_argument("--time", type=int, nargs="+", default=[128, 128], help="update tokens per row (T)")
    ap.add_argument("--sample-batch", type=int, nargs="+", default=[64, 8])
    ap.add_argument("--new", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    pick = lambda xs, i: xs[min(i, len(xs) - 1)]  # noqa: E731
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    results = {}
    for i, name in enumerate(args.models):
        whole = _model(name)
        layers = pick(args.layers, i) or whole.num_layers
        cfg = whole.replace(num_layers=layers)
        bf16 = cfg.replace(param_dtype="bfloat16")
        row = {"layers_timed": layers, "layers": whole.num_layers,
               "bytes": {"full": state_bytes(whole, None), "lora": state_bytes(whole, lora),
                         "lora_bf16_base": state_bytes(whole.replace(param_dtype="bfloat16"), lora)}}
        row["bytes"]["full"]["reference_copy_bytes"] = row["bytes"]["full"]["params_bytes"]  # a KL term's copy
        batch = _batch(cfg, pick(args.batch, i), pick(args.time, i))
        row["update_batch"] = list(batch.tokens_bt.shape)
        row["update"] = bench_update({"full": (cfg, None), "lora": (cfg, lora), "lora_bf16_base": (bf16, lora)},
                                     batch, args.repeats)
        row["sampler"] = bench_sampler(cfg, lora, pick(args.sample_batch, i), pick(args.new, i), args.repeats)
        results[name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu": _cpu_model(),
                       "load_average": os.getloadavg()},
           "jax": jax.__version__, "rank": args.rank, "alpha": 2.0 * args.rank,
           "targets": list(lora.targets), "results": results}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "lora.json"), "w") as f:
        json.dump(out, f, indent=2)


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
