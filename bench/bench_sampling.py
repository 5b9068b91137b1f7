"""Sampling throughput: rljax.sampling.generate vs transformers generate on the same weights.

New tokens/s at batch 64, prompt 32, 64 new tokens (no early stop: no EOS), plain sampling at
temperature 1, on qwen2-tiny and qwen2-small; then an RL-length case, qwen2-tiny with 512 new
tokens, where attention over the growing cache dominates. Also the fractions of the f32 compute
roofline and of the memory roofline (the bytes a step must read, weights and KV cache, over the
bandwidth measured here: HBM on a GPU) reached by decode. And a ceiling estimate: the same decode
steps running only their weight matmuls (`matmul_only_decode_tok_s`), after a prefill at the
measured peak, as a speedup over transformers (`ceiling_speedup`): the best this op structure
(one unfused matmul per weight, one device) could do on this machine.
Writes bench/results/sampling.json.

On a CPU with more than one core, each case also runs data-parallel in a child process: one XLA
host device per core (`--xla_force_host_platform_device_count`), params replicated on a data mesh,
so `generate` splits the rows and each core decodes its own (the `rljax_dp_*` fields).

    .venv/bin/python bench/bench_sampling.py [--configs qwen2-tiny qwen2-small] [--long qwen2-tiny]
                                             [--repeats 3] [--host-devices N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import init_params, preset, save_hf
from rljax.sampling import SampleControls, generate
from rljax.sampling import sampler as generate_mod
from peak import matmul_peak_gflops, memory_bandwidth_gbs  # noqa: E402  (bench/ is on sys.path when run as a script)

BATCH, PROMPT, NEW, LONG_NEW = 64, 32, 64, 512


def decode_flops_per_token(cfg, slots: int) -> float:
    """Matmul FLOPs of one decode token: 2 * (weights touched) + attention over `slots` keys."""
    d, n, k, h, f, v, layers = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                cfg.intermediate_size, cfg.vocab_size, cfg.num_layers)
    per_layer = d * (n + 2 * k) * h + n * h * d + 3 * d * f
    attention = 2 * n * h * slots
    return 2.0 * (layers * (per_layer + attention) + v * d)


def decode_bytes_per_step(cfg, params, slots: int) -> float:
    """Bytes one decode step must read at least: every weight once (the embedding rows it gathers
    are negligible unless the embedding is also the LM head) plus the KV cache over `slots` keys."""
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not cfg.tie_embeddings:
        weights -= params["embed"].size * params["embed"].dtype.itemsize
    kv = cfg.num_layers * BATCH * 2 * cfg.num_kv_heads * cfg.head_dim * slots * jnp.dtype(cfg.compute_jnp_dtype).itemsize
    return float(weights + kv)


def matmul_only_decode_tok_s(cfg, params, steps: int, repeats: int) -> float:
    """New tokens/s of a decode that ran only the weight matmuls of each step: the model's own
    weights, q, k, v, o, gate, up and down per layer and the LM head, at batch BATCH, chained in a
    `lax.fori_loop` of `steps` steps with no attention, KV cache, norms or sampling. A decode that
    runs these matmuls one per weight on one device cannot be faster on this machine."""
    layers, d = params["layers"], cfg.hidden_size
    flat = lambda name, rows: [np.asarray(w).reshape(rows, -1) for w in np.asarray(layers[name])]
    per_layer = list(zip(flat("q", d), flat("k", d), flat("v", d), flat("o", cfg.num_heads * cfg.head_dim),
                         flat("gate", d), flat("up", d), flat("down", cfg.intermediate_size)))
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    weights = jax.device_put((per_layer, head))  # per-layer arrays, as the decode loop gets them

    def step(x_bd, w):
        per_layer, head = w
        for q, k, v, o, gate, up, down in per_layer:  # unrolled, as in the decode loop
            kv = jnp.mean(x_bd @ k, axis=1) + jnp.mean(x_bd @ v, axis=1)
            x_bd = x_bd + 0.5 * ((x_bd @ q) @ o) + kv[:, None]
            x_bd = x_bd + (jax.nn.silu(x_bd @ gate) * (x_bd @ up)) @ down
        logits_bv = jax.lax.dot_general(x_bd, head, (((1,), (1,)), ((), ())))
        return x_bd * 0.5 + 1e-3 * jnp.mean(logits_bv, axis=1, keepdims=True)

    run = jax.jit(lambda x, w: jax.lax.fori_loop(0, steps, lambda i, x: step(x, w), x))
    x0 = jax.random.normal(jax.random.key(1), (BATCH, d), jnp.float32)
    run(x0, weights).block_until_ready()
    runs = time_it(lambda: run(x0, weights).block_until_ready(), repeats)
    return BATCH * steps / statistics.median(runs)


def _cpu_model() -> str:
    """The CPU's model name (results differ a lot between the machines this runs on)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def bench_prompts(cfg) -> np.ndarray:
    """The benchmark's [BATCH, PROMPT] prompts: the same in every process of a run."""
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)


def time_it(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_rljax(cfg, params, prompts, repeats, new, prefill=True):
    key = jax.random.key(0)
    controls = SampleControls(max_new_tokens=new, temperature=1.0)

    def run():
        r = generate(cfg, params, prompts, key=key, controls=controls)
        r.tokens.block_until_ready()
        assert int(r.lengths.min()) == new
        return r

    run()  # compile
    total = time_it(run, repeats)
    if not prefill:
        return total, None
    # Everything before decode (input checks, the per-layer weight split, prefill), to isolate
    # decode for the rooflines.
    def prefill():
        state, _, decode_params = generate_mod.start(cfg, params, prompts, key=key, controls=controls)
        jax.block_until_ready((state, decode_params))

    prefill()
    pre = time_it(prefill, repeats)
    return total, pre


def bench_rljax_data_parallel(name, repeats, new, devices):
    """`generate` over `devices` XLA host devices in a child process (the device count is fixed
    when jax starts); the same params and prompts as the one-device run."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                      f" --xla_force_host_platform_device_count={devices}").strip())
    out = subprocess.run([sys.executable, __file__, "--rljax-child", name, "--repeats", str(repeats),
                          "--new", str(new), "--host-devices", str(devices)],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["runs"]


def rljax_child(name, repeats, new, devices):
    from jax.sharding import NamedSharding, PartitionSpec

    from rljax.sharding import MeshConfig, make_mesh

    cfg = preset(name)
    assert jax.device_count() == devices, jax.devices()
    mesh = make_mesh(MeshConfig(data=devices, fsdp=1, tensor=1))
    params = jax.device_put(init_params(cfg, jax.random.key(0)), NamedSharding(mesh, PartitionSpec()))
    prompts = bench_prompts(cfg)
    total, _ = bench_rljax(cfg, params, prompts, repeats, new, prefill=False)
    print(json.dumps(dict(runs=total)))


def bench_transformers(cfg, params, prompts, repeats, new):
    """transformers in a child process of this script (same weights, saved as a HF directory):
    torch and XLA thread pools in one process slow each other down by over 10x here."""
    with tempfile.TemporaryDirectory() as d:
        save_hf(cfg, params, d)
        np.save(os.path.join(d, "prompts.npy"), np.asarray(prompts))
        out = subprocess.run([sys.executable, __file__, "--transformers-child", d, "--repeats", str(repeats),
                              "--new", str(new)],
                             check=True, capture_output=True, text=True).stdout
    child = json.loads(out.strip().splitlines()[-1])
    return child["runs"], child["transformers"], child["torch"]


def transformers_child(d, repeats, new):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.tensor(np.load(os.path.join(d, "prompts.npy")))
    attn = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, use_cache=True,
                                 max_new_tokens=new, min_new_tokens=new, temperature=1.0, top_k=0,
                                 top_p=1.0, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] == PROMPT + new

    run()
    print(json.dumps(dict(runs=time_it(run, repeats), transformers=transformers.__version__,
                          torch=torch.__version__)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["qwen2-tiny", "qwen2-small"])
    ap.add_argument("--long", nargs="*", default=["qwen2-tiny"], help=f"configs also run with {LONG_NEW} new tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--host-devices", type=int, default=len(os.sched_getaffinity(0)),
                    help="XLA host devices of the data-parallel run (default: the CPUs; < 2 skips it)")
    ap.add_argument("--transformers-child", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--rljax-child", metavar="CONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--new", type=int, default=NEW, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sampling.json"))
    args = ap.parse_args(argv)
    if args.transformers_child:
        return transformers_child(args.transformers_child, args.repeats, args.new)
    if args.rljax_child:
        return rljax_child(args.rljax_child, args.repeats, args.new, args.host_devices)
    data_parallel = args.host_devices >= 2 and jax.default_backend() == "cpu"
    peak = matmul_peak_gflops()
    bandwidth = memory_bandwidth_gbs()
    print(f"f32 matmul peak: {peak:.1f} GFLOP/s; memory bandwidth {bandwidth:.1f} GB/s")
    results = []
    for name, new in [(c, NEW) for c in args.configs] + [(c, LONG_NEW) for c in args.long]:
        cfg = preset(name)
        params = init_params(cfg, jax.random.key(0))
        prompts = bench_prompts(cfg)
        total, pre = bench_rljax(cfg, params, prompts, args.repeats, new)
        hf, tf_version, torch_version = bench_transformers(cfg, params, prompts, args.repeats, new)
        new_tokens = BATCH * new
        ours, theirs = new_tokens / statistics.median(total), new_tokens / statistics.median(hf)
        decode_s = statistics.median(total) - statistics.median(pre)
        decode_tps = BATCH * (new - 1) / decode_s  # token 0 comes from prefill
        flops = decode_flops_per_token(cfg, slots=PROMPT + new // 2)
        row = dict(config=name, batch=BATCH, prompt=PROMPT, new_tokens=new,
                   rljax_new_tok_s=round(ours, 1), transformers_new_tok_s=round(theirs, 1),
                   speedup=round(ours / theirs, 2), rljax_runs_s=[round(x, 4) for x in total],
                   transformers_runs_s=[round(x, 4) for x in hf], prefill_s=round(statistics.median(pre), 4),
                   decode_tok_s=round(decode_tps, 1), decode_gflops=round(decode_tps * flops / 1e9, 1),
                   decode_roofline_fraction=round(decode_tps * flops / 1e9 / peak, 3))
        step_bytes = decode_bytes_per_step(cfg, params, slots=PROMPT + new // 2)
        decode_gbs = decode_tps / BATCH * step_bytes / 1e9
        row.update(decode_gbs=round(decode_gbs, 1), decode_bandwidth_fraction=round(decode_gbs / bandwidth, 3))
        floor_tps = matmul_only_decode_tok_s(cfg, params, new, args.repeats)
        # The fastest whole run this op structure could make: prefill at the measured peak, then
        # decode steps that are nothing but their weight matmuls.
        prefill_flops = BATCH * PROMPT * (decode_flops_per_token(cfg, slots=PROMPT // 2)
                                          - 2.0 * cfg.vocab_size * cfg.hidden_size)
        ceiling_s = prefill_flops / (peak * 1e9) + BATCH * (new - 1) / floor_tps
        row.update(matmul_only_decode_tok_s=round(floor_tps, 1),
                   ceiling_speedup=round(new_tokens / ceiling_s / theirs, 2))
        if data_parallel:
            dp = bench_rljax_data_parallel(name, args.repeats, new, args.host_devices)
            dp_tps = new_tokens / statistics.median(dp)
            row.update(rljax_dp_host_devices=args.host_devices, rljax_dp_new_tok_s=round(dp_tps, 1),
                       rljax_dp_speedup=round(dp_tps / theirs, 2), rljax_dp_runs_s=[round(x, 4) for x in dp])
        print(json.dumps(row))
        results.append(row)
    record = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                     cpu_model=_cpu_model(),
                     cpus=len(os.sched_getaffinity(0)), jax_backend=jax.default_backend(), devices=str(jax.devices()[0])),
        versions=dict(python=sys.version.split()[0], jax=jax.__version__, transformers=tf_version,
                      torch=torch_version),
        matmul_peak_gflops=round(peak, 1), memory_bandwidth_gbs=round(bandwidth, 1), results=results,
        note="shared 2-core CPU with other jobs running: timings are noisy; medians of the repeats")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
