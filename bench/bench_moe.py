"""The MoE update step on CPU: grouped experts (`model.moe_impl = "grouped"`: sorted, capacity-
padded blocks and a batched matmul) against the dense all-experts reference, at 8 and 32 experts,
top-2 and top-8 (issue 47).

    flock /tmp/rljax_heavy.lock timeout 1800 .venv/bin/python bench/bench_moe.py [--out bench/results]

Each case compiles `rljax.update.update` (dr_grpo, AdamW, f32) for a tiny Qwen3-MoE-shaped model
(2 layers, hidden 128, 4 query / 2 kv heads of 32, experts of width 64, 512-token vocabulary) on a
batch of 16 rows x 64 tokens, and reports tokens/s (median of the timed steps after a warm-up
call) and the compiled program's memory (`memory_analysis`: temporaries, and the peak = arguments
+ outputs - aliased + temporaries). The grouped path's work grows with k, the dense path's with E.
Prints a markdown table with the date, CPU model and versions; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CASES = [(e, k, impl) for e in (8, 32) for k in (2, 8) for impl in ("grouped", "dense")]
ROWS, SEQ = 16, 64


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def run_case(num_experts: int, top_k: int, impl: str, reps: int) -> dict:
    import jax
    import numpy as np

    from rljax.models import init_params, preset
    from rljax.models.moe_config import MoEConfig
    from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
    from rljax.optim import OptimConfig
    from rljax.update import RolloutBatch, init_train_state, update

    cfg = preset("qwen2-test").replace(model_type="qwen3_moe", vocab_size=512, hidden_size=128, num_heads=4,
                                       num_kv_heads=2, head_dim=32, qkv_bias=False, qk_norm=True,
                                       moe=MoEConfig(num_experts=num_experts, top_k=top_k, expert_size=64,
                                                     norm_topk_prob=True, impl=impl))
    rng = np.random.default_rng(0)
    prompt = SEQ // 4
    batch = RolloutBatch(tokens_bt=rng.integers(0, cfg.vocab_size, (ROWS, SEQ)).astype(np.int32),
                         attn_mask_bt=np.ones((ROWS, SEQ), bool),
                         loss_mask_bt=np.arange(SEQ)[None].repeat(ROWS, 0) >= prompt,
                         sampler_logp_bt=(-rng.random((ROWS, SEQ)) * 5).astype(np.float32),
                         rewards_b=rng.integers(0, 2, ROWS).astype(np.float32),
                         group_ids_b=np.asarray(prompt_major_group_ids(ROWS, 4)), completion_len=SEQ - prompt)
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(algorithm="dr_grpo"),
                             OptimConfig(learning_rate=1e-4))
    t = time.perf_counter()
    compiled = jax.jit(update, donate_argnums=(0,)).lower(state, batch, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t
    ma = compiled.memory_analysis()
    state, metrics = compiled(state, batch, jax.random.key(0))  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for i in range(reps):
        t = time.perf_counter()
        state, metrics = compiled(state, batch, jax.random.key(i + 1))
        jax.block_until_ready((state.params, metrics))
        times.append(time.perf_counter() - t)
    med = sorted(times)[len(times) // 2]
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    return dict(experts=num_experts, top_k=top_k, impl=impl, tokens_per_s=ROWS * SEQ / med, step_s=med, times=times,
                compile_s=compile_s, temp_mib=ma.temp_size_in_bytes / 2**20, peak_mib=peak / 2**20,
                params=cfg.num_params(), active_params=cfg.num_active_params())


def table(rows: list[dict]) -> str:
    lines = ["| experts | top-k | impl | tokens/s | step s | temporaries MiB | peak MiB | grouped / dense tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["experts"], r["top_k"], r["impl"]): r for r in rows}
    for r in rows:
        dense = by.get((r["experts"], r["top_k"], "dense"))
        speedup = f"{r['tokens_per_s'] / dense['tokens_per_s']:.2f}x" if r["impl"] == "grouped" and dense else ""
        lines.append(f"| {r['experts']} | {r['top_k']} | {r['impl']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
                     f"{r['temp_mib']:.1f} | {r['peak_mib']:.1f} | {speedup} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args(argv)
    import jax

    rows = []
    for e, k, impl in CASES:
        rows.append(run_case(e, k, impl, args.reps))
        print(f"E={e} k={k} {impl}: {rows[-1]['tokens_per_s']:,.0f} tokens/s, peak {rows[-1]['peak_mib']:.1f} MiB",
              flush=True)
    head = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, {cpu_model()}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, jax {jax.__version__}, "
            f"Python {platform.python_version()}; {ROWS} rows x {SEQ} tokens, f32")
    print(head + "\n\n" + table(rows))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_moe.json")
    with open(path, "w") as f:
        json.dump(dict(header=head, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
