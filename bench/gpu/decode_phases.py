"""Issue 48's decode rows: `generate` at Qwen2.5-0.5B shapes (bf16, prompt 128 + 512 new, no EOS)
against both floors, the bytes one (every weight once per step + the KV read) and the compute one
(2 x matmul weights FLOPs per token at the measured bf16 peak); the one-pass draw against the
reference draw; the loop decoded in chunks of 16 steps (`sampling.decode_chunk`); FP8 rollout weights (`sampling.weight_dtype = "fp8"`: emulated weight-only, so
the same bf16 bytes are read: it measures the round trip's cost, not an FP8 GEMM); real FP8
(`weight_dtype = "fp8_w8a8"`: e4m3 weights and per-row e4m3 activations, FP8 x FP8 dots, half
the weight bytes; `-kv8` adds `kv_dtype = "fp8"`, half the KV bytes: the bytes floor counts the
sampler's own bytes); and the long tail of `bench/longtail.py` (its imposed lengths, EOS forced,
cap 1,024) static vs continuous.

Phase `decode_roofline`, cases `DECODE_ROOFLINE_CASES`; --small divides batches by 8 and shrinks
the lengths (a CPU smoke test of the script).
"""

from __future__ import annotations

import os
import sys
import time

from gpu.shapes import CompileCounter, decode_floor_bytes, hf_config, matmul_params, timed

# case -> (scheduler, batch, SampleControls extras, long tail?)
DECODE_ROOFLINE_CASES = {
    "static-256": ("static", 256, {}, False),
    "static-256-refdraw": ("static", 256, {"draw": "reference"}, False),
    "static-256-chunk16": ("static", 256, {"decode_chunk": 16}, False),
    "static-64-fp8": ("static", 64, {"weight_dtype": "fp8"}, False),
    "static-256-fp8": ("static", 256, {"weight_dtype": "fp8"}, False),
    "static-64-w8a8": ("static", 64, {"weight_dtype": "fp8_w8a8"}, False),
    "static-256-w8a8": ("static", 256, {"weight_dtype": "fp8_w8a8"}, False),
    "static-64-w8a8-kv8": ("static", 64, {"weight_dtype": "fp8_w8a8", "kv_dtype": "fp8"}, False),
    "static-256-w8a8-kv8": ("static", 256, {"weight_dtype": "fp8_w8a8", "kv_dtype": "fp8"}, False),
    "continuous-256": ("continuous", 256, {}, False),
    "continuous-256-w8a8-kv8": ("continuous", 256, {"weight_dtype": "fp8_w8a8", "kv_dtype": "fp8"}, False),
    "longtail-static-256": ("static", 256, {}, True),
    "longtail-continuous-256": ("continuous", 256, {}, True),
}


def decode_roofline(args, case, record):
    """One row of the table in the module docstring."""
    import jax
    import numpy as np

    from rljax.models import from_hf_dict, init_params
    from rljax.models.attention import resolve_decode_attention
    from rljax.sampling import SampleControls, generate
    from rljax.sampling.fp8 import sampler_params

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for longtail
    import longtail

    scheduler, batch, extra, tail = DECODE_ROOFLINE_CASES[case]
    batch = batch // 8 if args.small else batch
    prompt, new = (16, 32) if args.small else (128, 512)
    hf = hf_config("0.5B", args.small)
    cfg = from_hf_dict(hf, compute_dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    controls = SampleControls(max_new_tokens=new, num_samples=1, temperature=1.0, **extra)
    # the bytes the sampler reads: its own weight copy (FP8 for W8A8) and, with an FP8 KV cache,
    # e4m3 keys and values plus one f32 scale per head_dim values (bf16: 2 bytes per value)
    sampler_copy = jax.eval_shape(lambda p: sampler_params(p, controls.weight_dtype), params)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(sampler_copy))
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv_factor = (1 + 4 / head_dim) / 2 if controls.kv_dtype == "fp8" else 1.0
    tokens = np.random.default_rng(0).integers(2, hf["vocab_size"] - 1, (batch, prompt)).astype(np.int32)
    lengths = None
    if tail:
        cap = new * 2 if not args.small else new
        lengths = np.clip(longtail.imposed_lengths()[:batch], 1, cap).astype(np.int32)
        controls = controls.replace(max_new_tokens=cap, eos_ids=(longtail.EOS_ID,),
                                    logits_processor=longtail.forced_lengths_jax(lengths))
    if scheduler == "continuous":
        controls = controls.replace(scheduler="continuous", slots=batch)
    counter = CompileCounter()
    t = time.perf_counter()
    result = generate(cfg, params, tokens, key=jax.random.key(0), controls=controls)
    jax.block_until_ready(result.tokens)
    first_s = time.perf_counter() - t
    first = counter.take()
    med, times = timed(lambda: jax.block_until_ready(
        generate(cfg, params, tokens, key=jax.random.key(1), controls=controls).tokens), 2, budget_s=args.budget * 0.3)
    drawn = int(np.asarray(result.lengths).sum())
    if tail:
        assert (np.asarray(result.lengths) == lengths).all(), "imposed lengths not honoured"
    bytes_s = compute_s = None
    if not tail and args.hbm_tb_s:
        kv_bytes = decode_floor_bytes(hf, 0, batch, prompt, new) * kv_factor
        bytes_s = (new * weight_bytes + kv_bytes) / (args.hbm_tb_s * 1e12)
    if not tail and args.peak_tflops:  # at the bf16 peak, also for FP8 rows (FP8 doubles the layers' peak)
        compute_s = 2.0 * matmul_params(hf) * batch * new / (args.peak_tflops * 1e12)
    share = lambda floor: None if floor is None else floor / med
    record(system="rljax", scheduler=scheduler, batch=batch, prompt=prompt, new=controls.max_new_tokens,
           long_tail=tail, draw=controls.static().draw if controls.logits_processor is None else "reference (processor)",
           weight_dtype=controls.weight_dtype, kv_dtype=controls.kv_dtype, weight_bytes=weight_bytes,
           decode_attention=resolve_decode_attention(cfg), first_call_s=first_s,
           **first, recompiles=counter.take()["programs_compiled"], seconds=med, times=times,
           tokens_per_s=drawn / med, tokens=drawn, ms_per_step=1e3 * med / int(np.asarray(result.lengths).max()),
           bytes_floor_s=bytes_s, bytes_share=share(bytes_s), compute_floor_s=compute_s,
           compute_share=share(compute_s))
