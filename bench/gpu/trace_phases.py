"""Issue 48's decode trace: where one decode step's time goes, kernel by kernel.

Phase `decode_trace`, cases `TRACE_CASES`: rljax's static `generate` at Qwen2.5-0.5B shapes (bf16,
prompt 128 + 512 new, no EOS), called once to compile, then once under `jax.profiler.trace`. The
device events of the traced call are summed by kernel name: kernels per decode step and per layer
per step (the issue's "count the kernels per layer per step, before and after"), the busy share of
the wall, and the top kernels' microseconds per step. CUDA graphs stay on under the profiler
(`--xla_enable_command_buffers_during_profiling=true`; XLA turns them off there by default).
--small shrinks the shapes (a CPU smoke test: a CPU trace has no device stream, so it records
the host's events only).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile
import time
from collections import defaultdict

TRACE_CASES = {"static-256": {}, "static-256-w8a8-kv8": {"weight_dtype": "fp8_w8a8", "kv_dtype": "fp8"}}
TOP_KERNELS = 30


def device_events(trace_dir: str) -> tuple[list[dict], str]:
    """(the complete events on device streams, the trace file) of the newest trace under `trace_dir`."""
    paths = sorted(p for p in glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True) if "perfetto" not in p)
    if not paths:
        return [], ""
    raw = json.load(gzip.open(paths[-1]))
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e.get("pid"), e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    gpu = {p for (p, t), n in names.items() if t is None and "GPU" in n}
    out = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu
           and "stream" in names.get((e["pid"], e.get("tid")), "").lower()]
    return out, paths[-1]


def decode_trace(args, case, record):
    """One traced decode call (module docstring)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_enable_command_buffers_during_profiling=true")
    import jax
    import numpy as np

    from gpu.shapes import hf_config
    from rljax.models import from_hf_dict, init_params
    from rljax.models.attention import resolve_decode_attention
    from rljax.sampling import SampleControls, generate

    batch, prompt, new = (32, 16, 32) if args.small else (256, 128, 512)
    hf = hf_config("0.5B", args.small)
    cfg = from_hf_dict(hf, compute_dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(2, hf["vocab_size"] - 1, (batch, prompt)).astype(np.int32)
    controls = SampleControls(max_new_tokens=new, num_samples=1, temperature=1.0, **TRACE_CASES[case])
    call = lambda k: jax.block_until_ready(generate(cfg, params, tokens, key=jax.random.key(k), controls=controls).tokens)  # noqa: E731
    call(0)
    t = time.perf_counter()
    call(1)
    untraced_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as trace_dir:
        t = time.perf_counter()
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            call(2)
        traced_s = time.perf_counter() - t
        events, path = device_events(trace_dir)
    by_us, count = defaultdict(float), defaultdict(int)
    spans = []
    for e in events:
        by_us[e["name"]] += float(e["dur"])
        count[e["name"]] += 1
        spans.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    spans.sort()
    busy, end = 0.0, -1e30
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    wall_us = spans[-1][1] - spans[0][0] if spans else 0.0
    layers = hf["num_hidden_layers"]
    top = sorted(by_us.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    record(system="rljax", batch=batch, prompt=prompt, new=new, weight_dtype=controls.weight_dtype,
           kv_dtype=controls.kv_dtype, decode_attention=resolve_decode_attention(cfg), untraced_s=untraced_s,
           traced_s=traced_s, trace_file=os.path.basename(path), kernels=len(spans),
           kernels_per_step=len(spans) / new, kernels_per_layer_step=len(spans) / new / layers,
           distinct_kernels=len(by_us), busy_share=busy / wall_us if wall_us else None,
           device_us_per_step=sum(by_us.values()) / new, wall_us_per_step=wall_us / new,
           top=[dict(kernel=n[:100], us_per_step=round(us / new, 2), per_step=round(count[n] / new, 2))
                for n, us in top])
