"""Issue 50's long rows on one card: the update and the sampler at 4k / 8k / 32k tokens a row.

Phase `long`, cases `LONG_CASES`, at Qwen2.5-1.5B shapes (f32 params, bf16 compute, cuDNN
attention where the backend has it):
- "update-<L>": `update_step` (dr_grpo, AdamW) on rows of L tokens, one row per micro-batch, full
  remat, the same 32,768 tokens per step at every L (8 x 4k, 4 x 8k, 1 x 32k): tokens/s against
  the 4k row says what the longer attention costs per token (the FLOPs per token grow with L:
  `train_flops_per_token` counts the causal square in full, so MFU stays comparable);
- "sample-<L>": the static sampler, bf16 weights, a 128-token prompt and L new tokens, no EOS:
  tokens/s, ms a step, and peak memory (the KV cache grows with L); the 32k row is timed once
  after its first call, to fit the device budget.

--small shrinks the model and the lengths by 64 (a CPU smoke test).
"""

from __future__ import annotations

import time

from gpu.shapes import CompileCounter, hf_config, matmul_params, timed, timed_update, train_flops_per_token

LONG_MODEL = "1.5B"
# case -> (kind, rows, tokens a row (update) or new tokens (sample))
LONG_CASES = {"update-4k": ("update", 8, 4096), "update-8k": ("update", 4, 8192), "update-32k": ("update", 1, 32768),
              "sample-8k": ("sample", 8, 8192), "sample-32k": ("sample", 4, 32640)}
SMALL_DIVISOR = 64


def long(args, case, record):
    """One row of the module docstring's table."""
    import jax
    import numpy as np

    from gpu.jax_phases import peak_memory_gib, ratio, synthetic_rollout
    from rljax.models import from_hf_dict, init_params
    from rljax.models.attention import describe_attention

    kind, rows, length = LONG_CASES[case]
    length = length // SMALL_DIVISOR if args.small else length
    hf = hf_config(LONG_MODEL, args.small)
    counter = CompileCounter()
    if kind == "update":
        from rljax.objectives import AlgorithmConfig
        from rljax.optim import OptimConfig
        from rljax.update import UpdateConfig, init_train_state, update_step

        cfg = from_hf_dict(hf, compute_dtype="bfloat16", param_dtype="float32")
        batch = synthetic_rollout(rows, length, hf["vocab_size"])
        state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(algorithm="dr_grpo"),
                                 OptimConfig(learning_rate=1e-6, max_grad_norm=1.0),
                                 update_cfg=UpdateConfig(num_microbatches=rows, remat=True))
        first_s, first, med, times, metrics = timed_update(update_step, state, batch, counter, 3, args.budget * 0.3)
        del state
        tokens = rows * length
        tflops = train_flops_per_token(hf, length) * tokens / med / 1e12
        record(system="rljax", kind=kind, model=LONG_MODEL, rows=rows, tokens_per_row=length, microbatches=rows,
               remat=True, attention_line=describe_attention(cfg), first_call_s=first_s, **first,
               recompiles=counter.take()["programs_compiled"], step_s=med, times=times, tokens_per_s=tokens / med,
               model_tflops=tflops, mfu=ratio(tflops, args.peak_tflops),
               peak_mem_gib=peak_memory_gib(jax.devices()[0]),
               loss=next((float(v) for k, v in metrics.items() if k.endswith("loss")), None))
        return

    from rljax.sampling import SampleControls, generate

    cfg = from_hf_dict(hf, compute_dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    prompt = 128 // (SMALL_DIVISOR // 8) if args.small else 128
    tokens = np.random.default_rng(0).integers(0, hf["vocab_size"] - 1, (rows, prompt)).astype(np.int32)
    controls = SampleControls(max_new_tokens=length, num_samples=1, temperature=1.0)
    t = time.perf_counter()
    result = generate(cfg, params, tokens, key=jax.random.key(0), controls=controls)
    jax.block_until_ready(result.tokens)
    first_s, first = time.perf_counter() - t, counter.take()
    drawn = int(np.asarray(result.lengths).sum())
    reps = 1 if length >= 16384 and not args.small else 2  # the 32k row: one timed call after the first
    med, times = timed(lambda: jax.block_until_ready(
        generate(cfg, params, tokens, key=jax.random.key(1), controls=controls).tokens), reps, budget_s=args.budget * 0.3)
    record(system="rljax", kind=kind, model=LONG_MODEL, rows=rows, prompt=prompt, new=length, scheduler="static",
           first_call_s=first_s, **first, seconds=med, times=times, tokens_per_s=drawn / med,
           ms_per_step=1e3 * med / length, matmul_params=matmul_params(hf),
           peak_mem_gib=peak_memory_gib(jax.devices()[0]))
