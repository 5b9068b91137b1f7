"""Update-step throughput: rljax.update.update_step vs a plain PyTorch step on the same HF weights.

One GRPO-style clipped-surrogate update at B=32, T=128 (one epoch, one mini-batch): forward,
log-softmax gather, clipped loss, backward, AdamW. Reports tokens/s (B*T per step), the ratio to
PyTorch, and achieved FLOP/s against this machine's measured matmul peak (f32 and bf16), for f32
compute and for bf16 compute (rljax compute_dtype=bfloat16 vs torch.autocast bfloat16). rljax runs with
UpdateConfig(unroll_layers=True), the setting recommended for small models on CPU.
Writes bench/results/update.json.

    .venv/bin/python bench/bench_update.py [--configs qwen2-tiny qwen2-small] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import init_params, preset, save_hf
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update_step
from peak import matmul_peak_gflops  # noqa: E402  (bench/ is on sys.path when run as a script)

B, T, PROMPT, GROUP = 32, 128, 32, 8
LR, EPS_CLIP = 1e-6, 0.2


def train_flops(cfg) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3x forward) over B*T tokens."""
    d, n, k, h, f, v, layers = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                cfg.intermediate_size, cfg.vocab_size, cfg.num_layers)
    per_layer = d * (n + 2 * k) * h + n * h * d + 3 * d * f
    attention = 2 * n * h * T  # QK^T and PV over T keys (full square, as computed)
    return 3 * 2.0 * B * T * (layers * (per_layer + attention) + v * d)


def make_batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    attn = np.ones((B, T), bool)
    loss = np.zeros((B, T), bool)
    loss[:, PROMPT:] = True
    old_logp = (-rng.random((B, T)) * 5).astype(np.float32)
    rewards = rng.integers(0, 2, B).astype(np.float32)
    return toks, attn, loss, old_logp, rewards


def bench_jax(cfg, params, data, repeats):
    toks, attn, loss, old_logp, rewards = data
    batch = RolloutBatch(jnp.asarray(toks), jnp.asarray(attn), jnp.asarray(loss), jnp.asarray(old_logp),
                         jnp.asarray(rewards), prompt_major_group_ids(B, GROUP), completion_len=T - PROMPT)
    algo = AlgorithmConfig(algorithm="dapo", clip_eps_high=EPS_CLIP)
    state = init_train_state(cfg, jax.tree.map(jnp.copy, params), algo,
                             OptimConfig(learning_rate=LR, max_grad_norm=None),
                             update_cfg=UpdateConfig(unroll_layers=True))
    t = time.perf_counter()
    state, m = update_step(state, batch, jax.random.key(0))
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        state, m = update_step(state, batch, jax.random.key(i))
        jax.block_until_ready((state.params, m))
        times.append(time.perf_counter() - t)
    return times, compile_s


def bench_torch(path, data, repeats, bf16: bool):
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    toks, attn, loss_mask, old_logp, rewards = (torch.from_numpy(np.asarray(x)) for x in data)
    adv = ((rewards - rewards.view(-1, GROUP).mean(1).repeat_interleave(GROUP))
           / (rewards.view(-1, GROUP).std(1).repeat_interleave(GROUP) + 1e-6))
    mask = loss_mask[:, 1:].float()
    tgt = toks[:, 1:].long()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=toks.long(), attention_mask=attn.long()).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tgt[..., None])[..., 0]
        ratio = torch.exp(logp - old_logp[:, 1:])
        a = adv[:, None]
        per_tok = torch.maximum(-a * ratio, -a * ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP))
        loss = (per_tok * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["qwen2-tiny", "qwen2-small"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "update.json"))
    args = parser.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    peak = measure_peaks()  # measured again at the end; the best of both is the roof (contention lowers it)
    print(f"matmul peak GFLOP/s: f32 {peak['float32']:.1f}  bf16 {peak['bfloat16']:.1f}", flush=True)
    runs = {}
    for name in args.configs:
        for dtype in ("float32", "bfloat16"):
            cfg = preset(name, compute_dtype=dtype)
            params = init_params(cfg, jax.random.key(0))
            data = make_batch(cfg)
            with tempfile.TemporaryDirectory() as tmp:
                save_hf(cfg, params, tmp)
                t_torch = bench_torch(tmp, data, args.repeats, bf16=dtype == "bfloat16")
            t_jax, compile_s = bench_jax(cfg, params, data, args.repeats)
            flops = train_flops(cfg)
            jax_s, torch_s = statistics.median(t_jax), statistics.median(t_torch)
            row = {  # fractions of peak are recomputed below once the final peak is known
                "rljax_tokens_per_s": round(B * T / jax_s, 1),
                "torch_tokens_per_s": round(B * T / torch_s, 1),
                "ratio_vs_torch": round(torch_s / jax_s, 3),
                "rljax_gflops": round(flops / jax_s / 1e9, 1),
                "torch_gflops": round(flops / torch_s / 1e9, 1),
                "rljax_frac_of_f32_peak": round(flops / jax_s / 1e9 / peak["float32"], 3),
                "torch_frac_of_f32_peak": round(flops / torch_s / 1e9 / peak["float32"], 3),
                "rljax_frac_of_dtype_peak": round(flops / jax_s / 1e9 / peak[dtype], 3),
                "rljax_compile_s": round(compile_s, 1),
                "rljax_step_s": [round(x, 3) for x in t_jax],
                "torch_step_s": [round(x, 3) for x in t_torch],
                "train_gflop_per_step": round(flops / 1e9, 1),
            }
            runs[f"{name}/{dtype}"] = row
            print(name, dtype, json.dumps(row), flush=True)

    late = measure_peaks()
    best = {k: max(peak[k], late[k]) for k in peak}
    for key, row in runs.items():
        dtype = key.split("/")[1]
        for who in ("rljax", "torch"):
            row[f"{who}_frac_of_f32_peak"] = round(row[f"{who}_gflops"] / best["float32"], 3)
        row["rljax_frac_of_dtype_peak"] = round(row["rljax_gflops"] / best[dtype], 3)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor(),
                    "jax_backend": jax.default_backend()},
        "versions": {"python": sys.version.split()[0], "jax": jax.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "setup": {"batch": B, "seq_len": T, "prompt_len": PROMPT, "epochs": 1, "minibatches": 1,
                  "loss": "clipped surrogate, token-mean (DAPO preset, kl 0)", "optimizer": "AdamW",
                  "rljax": "UpdateConfig(unroll_layers=True): the layer scan unrolled (CPU recommendation)"},
        "matmul_peak_gflops": {k: round(v, 1) for k, v in best.items()},
        "matmul_peak_gflops_start_end": {k: [round(peak[k], 1), round(late[k], 1)] for k in peak},
        "note": "shared 2-core machine under contention from other jobs: numbers are noisy (median of repeats)",
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", args.out)


def measure_peaks() -> dict[str, float]:
    return {"float32": matmul_peak_gflops(jnp.float32), "bfloat16": matmul_peak_gflops(jnp.bfloat16)}


if __name__ == "__main__":
    main()
