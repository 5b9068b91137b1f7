"""Sampling throughput: rljax.sampling.generate vs transformers generate on the same weights.

Fixed length (bench/results/sampling.json). New tokens/s at batch 64, prompt 32, 64 new tokens
(no early stop: no EOS), plain sampling at temperature 1, on qwen2-tiny and qwen2-small; then an
RL-length case, qwen2-tiny with 512 new tokens, where attention over the growing cache dominates.
Also the fractions of the f32 compute roofline and of the memory roofline (the bytes a step must
read, weights and KV cache, over the bandwidth measured here: HBM on a GPU) reached by decode. And
a ceiling estimate: the same decode steps running only their weight matmuls
(`matmul_only_decode_tok_s`), after a prefill at the measured peak, as a speedup over
transformers (`ceiling_speedup`): the best this op structure (one unfused matmul per weight, one
device) could do on this machine.

On a CPU with more than one core, each case also runs data-parallel in a child process: one XLA
host device per core (`--xla_force_host_platform_device_count`), params replicated on a data mesh,
so `generate` splits the rows and each core decodes its own (the `rljax_dp_*` fields).

Long tail (bench/results/sampling_longtail.json). The RL-shaped workload of `longtail`: 64
prompts x 8 samples whose completion lengths are long-tailed and imposed on every system, sampled
by transformers `generate` in static batches of 64 rows, rljax static (the same 8 calls, and on
`--static-one-call` configs one call over all 512 rows) and rljax continuous (one call, 32 / 64 /
128 slots, and prefill_batch=8 beside prefill_batch=0 at 64 slots), repeats interleaved. Per
system: useful tokens/s, decode steps, occupancy and the share of row-steps spent on finished rows
(or empty slots). `--longtail-only` runs it alone; `--longtail` with no config skips it.

The transformers baseline. transformers runs in a child process of this script at each torch
thread count of `--torch-threads` (default 1 and the CPU count), interleaved, and reports the
faster; every run records the CPU seconds other processes used meanwhile (`other_cpu_s`). Why: on
a 2-core machine shared with other jobs, transformers' speed depends mostly on the neighbours.
With the machine to itself, the child process and the same call inside this process (after rljax
had run) measure the same, and 2 threads beat 1. But at 2 threads torch's OpenMP workers wait for
each other at every op, so a neighbour that takes one core for a moment stalls both, and the
same call runs several times slower (2-10x was measured with a busy neighbour), while 1 thread
slows by at most the share of the core it loses. Two transformers numbers taken at different
times (in a child, in one process) can therefore differ by 3x with no difference in setting; the
faster of the interleaved thread counts, and the other-process CPU beside it, keep the baseline
honest. The long tail's child also tries transformers' two KV caches on the first of its 8 calls,
"dynamic" (the default, grown by concatenation every step, so a step copies the whole cache) and
"static" (preallocated), with every thread count, and runs the full pass with the fastest.

    .venv/bin/python bench/bench_sampling.py [--configs qwen2-tiny qwen2-small] [--long qwen2-tiny]
                                             [--repeats 3] [--host-devices N] [--torch-threads 1 2]
                                             [--longtail qwen2-tiny qwen2-small] [--longtail-only]
                                             [--longtail-repeats 1] [--slots 32 64 128]
                                             [--prefill-batches 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import init_params, preset, save_hf
from rljax.sampling import SampleControls, generate
from rljax.sampling import sampler as generate_mod
from rljax.sampling.continuous import plan_layout as continuous_layout
import longtail  # noqa: E402  (bench/ is on sys.path when run as a script)
from longtail import measure  # noqa: E402
from peak import matmul_peak_gflops, memory_bandwidth_gbs  # noqa: E402

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


def machine_record() -> dict:
    """The machine a record was measured on: ratios flip between CPUs (an AVX-512 Xeon, an AVX2
    EPYC), so every table carries the CPU model and its vector flags."""
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v for k, v in (line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines()
                                               if ":" in line)}
        model, flags = info["model name"].strip(), set(info["flags"].split())
    except (OSError, KeyError):
        pass
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(), cpu_model=model,
                avx512f="avx512f" in flags, avx2="avx2" in flags, cpus=len(os.sched_getaffinity(0)),
                jax_backend=jax.default_backend(), devices=str(jax.devices()[0]))


def versions_record() -> dict:
    """Package versions, read without importing torch into this process."""
    from importlib.metadata import PackageNotFoundError, version

    def get(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return dict(python=sys.version.split()[0], jax=jax.__version__, jaxlib=get("jaxlib"), torch=get("torch"),
                transformers=get("transformers"))


def bench_prompts(cfg) -> np.ndarray:
    """The benchmark's [BATCH, PROMPT] prompts: the same in every process of a run."""
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)


def time_it(fn, repeats: int, other_cpu_s: list | None = None) -> list[float]:
    """Wall seconds of `repeats` calls; appends to `other_cpu_s` the CPU seconds other processes
    used during each (`longtail.measure`)."""
    out = []
    for _ in range(repeats):
        measured = measure(fn)[1]
        out.append(measured.wall_s)
        if other_cpu_s is not None:
            other_cpu_s.append(round(measured.other_cpu_s, 2))
    return out


def bench_rljax(cfg, params, prompts, repeats, new, prefill=True, other_cpu_s=None):
    key = jax.random.key(0)
    controls = SampleControls(max_new_tokens=new, temperature=1.0)

    def run():
        r = generate(cfg, params, prompts, key=key, controls=controls)
        r.tokens.block_until_ready()
        assert int(r.lengths.min()) == new
        return r

    run()  # compile
    total = time_it(run, repeats, other_cpu_s)
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


def bench_transformers(cfg, params, prompts, repeats, new, threads):
    """transformers in a child process of this script (same weights, saved as a HF directory), at
    each torch thread count in `threads`, interleaved. Returns the child's record (see
    `transformers_child`) and the fastest setting's median wall seconds and thread count.

    Why a child and several thread counts: see "The transformers baseline" in the module docstring."""
    with tempfile.TemporaryDirectory() as d:
        save_hf(cfg, params, d)
        np.save(os.path.join(d, "prompts.npy"), np.asarray(prompts))
        out = subprocess.run([sys.executable, __file__, "--transformers-child", d, "--repeats", str(repeats),
                              "--new", str(new), "--torch-threads", *map(str, threads)],
                             check=True, capture_output=True, text=True).stdout
    child = json.loads(out.strip().splitlines()[-1])
    best = min(child["runs"], key=lambda t: statistics.median(m["wall_s"] for m in child["runs"][t]))
    return child, statistics.median(m["wall_s"] for m in child["runs"][best]), int(best)


def transformers_child(d, repeats, new, threads):
    import torch
    import transformers

    default_threads = torch.get_num_threads()
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
    runs = {t: [] for t in threads}
    for _ in range(repeats):
        for t in threads:
            torch.set_num_threads(t)
            runs[t].append(measure(run)[1].as_dict())
    print(json.dumps(dict(runs=runs, default_threads=default_threads, transformers=transformers.__version__,
                          torch=torch.__version__)))


def bench_longtail(name: str, args) -> dict:
    """The long-tail RL workload (`longtail`) on config `name`: every system in one run, repeats
    interleaved, each output's lengths asserted equal to the imposed ones."""
    cfg = preset(name)
    params = init_params(cfg, jax.random.key(0))
    workload = longtail.make_workload(cfg.vocab_size)
    # Static batching of 64 rows decodes 1,023 steps in every batch (each holds a row at the cap;
    # asserted below from the lengths), so with --static-batches K only the first K batches run
    # and their time is scaled by 8 / K: the same rows-x-steps of work, a K / 8 share of the wait.
    batches = len(range(0, longtail.PROMPTS, longtail.BATCH_PROMPTS))
    k = args.static_batches or batches
    scale = batches / k
    per_batch = longtail.static_schedule(workload.lengths_r, longtail.BATCH_PROMPTS * longtail.SAMPLES)
    if k < batches:
        assert per_batch.decode_steps == batches * (longtail.CAP - 1), "a static batch ends before the cap"
    head = longtail.Workload(workload.prompts_qp[:k * longtail.BATCH_PROMPTS],
                             workload.lengths_r[:k * longtail.BATCH_PROMPTS * longtail.SAMPLES])
    systems = {"rljax_static_8x64": longtail.rljax_system(cfg, params, head, scheduler="static",
                                                          batch_prompts=longtail.BATCH_PROMPTS)}
    inputs = {"rljax_static_8x64": head}
    if name in args.static_one_call:
        systems["rljax_static_one_call"] = longtail.rljax_system(cfg, params, workload, scheduler="static")
    variants = {}  # continuous system -> its SlotLayout (slots, refill, drain), for the replay
    for slots, prefill_batch in [(s, 0) for s in args.slots] + [(64, p) for p in args.prefill_batches if p]:
        system = f"rljax_continuous_s{slots}_p{prefill_batch}"
        systems[system] = longtail.rljax_system(cfg, params, workload, scheduler="continuous", slots=slots,
                                                prefill_batch=prefill_batch)
        variants[system] = continuous_layout(SampleControls(
            max_new_tokens=longtail.CAP, num_samples=longtail.SAMPLES, scheduler="continuous", slots=slots,
            prefill_batch=prefill_batch), longtail.PROMPTS, longtail.PROMPT_LEN)
    runs = {system: [] for system in ["transformers_8x64", *systems]}
    schedules = {}
    with tempfile.TemporaryDirectory() as d:
        save_hf(cfg, params, d)
        np.save(os.path.join(d, "prompts.npy"), workload.prompts_qp)
        np.save(os.path.join(d, "lengths.npy"), workload.lengths_r)
        for repeat in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--transformers-longtail-child", d, "--torch-threads",
                                  *map(str, args.torch_threads), "--hf-caches", *args.hf_caches,
                                  "--static-batches", str(args.static_batches)],
                                 check=True, capture_output=True, text=True).stdout
            child = json.loads(out.strip().splitlines()[-1])
            runs["transformers_8x64"].append(dict(child["run"], setting=child["setting"],
                                                  calibration_first_call=child["calibration"]))
            schedules["transformers_8x64"] = longtail.Schedule(**child["schedule"])
            print(f"{name} repeat {repeat} transformers: {runs['transformers_8x64'][-1]}", flush=True)
            for system, run in systems.items():
                output, measured = longtail.measure(run)
                expected = inputs.get(system, workload).lengths_r
                assert np.array_equal(output.lengths_r, expected), f"{system} did not honour the lengths"
                if system in inputs and scale != 1:
                    wall = measured.compile_s + scale * measured.net_s  # CPU seconds scale with the wall
                    measured = longtail.Measured(wall_s=wall, compile_s=measured.compile_s,
                                                 own_cpu_s=measured.own_cpu_s * wall / measured.wall_s,
                                                 other_cpu_s=measured.other_cpu_s * wall / measured.wall_s)
                    runs[system].append(dict(measured.as_dict(), extrapolated_from_batches=k))
                    schedules[system] = per_batch
                else:
                    runs[system].append(measured.as_dict())
                    schedules[system] = output.schedule
                print(f"{name} repeat {repeat} {system}: {measured.as_dict()}", flush=True)
    total = int(workload.lengths_r.sum())
    rows = []
    for system, measured in runs.items():
        net = statistics.median(m["net_s"] for m in measured)
        row = dict(system=system, useful_tok_s=round(total / net, 1), net_s=round(net, 2), runs=measured,
                   **schedules[system].as_dict())
        if system in variants:  # the refill order replayed from the lengths, beside rljax's counters
            layout = variants[system]
            row.update(slots=layout.slots, drain_slots=layout.drain_slots, **longtail.continuous_schedule(
                workload.lengths_r, layout.slots, layout.refill, layout.drain_slots).as_dict("replayed_"))
        rows.append(row)
    best = lambda prefix: min((r for r in rows if r["system"].startswith(prefix)), key=lambda r: r["net_s"])
    main_cont = next((r for r in rows if r["system"] == "rljax_continuous_s64_p0"), best("rljax_continuous"))
    static, theirs, fastest = best("rljax_static"), best("transformers"), best("rljax_continuous")
    ratios = dict(continuous=main_cont["system"], static=static["system"], transformers=theirs["system"],
                  continuous_vs_static=round(static["net_s"] / main_cont["net_s"], 2),
                  continuous_vs_transformers=round(theirs["net_s"] / main_cont["net_s"], 2),
                  fastest_continuous=fastest["system"],
                  fastest_continuous_vs_static=round(static["net_s"] / fastest["net_s"], 2),
                  fastest_continuous_vs_transformers=round(theirs["net_s"] / fastest["net_s"], 2),
                  static_vs_transformers=round(theirs["net_s"] / static["net_s"], 2))
    # Every transformers call decodes 1,023 steps of 64 rows (finished rows are still computed), so
    # 8 x its fastest first-call calibration estimates a full pass free of the full pass's neighbours.
    first_call_x8 = min(8 * m["wall_s"] for run in runs["transformers_8x64"]
                        for m in run["calibration_first_call"].values())
    ratios.update(transformers_first_call_x8_s=round(first_call_x8, 1),
                  continuous_vs_transformers_first_call_x8=round(first_call_x8 / main_cont["net_s"], 2))
    print(json.dumps(dict(config=name, **ratios)), flush=True)
    return dict(config=name, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                repeats=args.repeats, ratios=ratios, systems=rows)


def transformers_longtail_child(d: str, threads: list[int], caches: list[str], static_batches: int = 0):
    """transformers over the long-tail workload (one pass per call of this child, so repeats
    interleave with the parent's rljax systems). Every (KV cache, torch threads) setting first
    runs the first call of 64 rows (each call decodes 1,023 steps of 64 rows, so this is 1/8 of
    the work); the full pass then runs at the fastest of them."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    workload = longtail.Workload(prompts_qp=np.load(os.path.join(d, "prompts.npy")),
                                 lengths_r=np.load(os.path.join(d, "lengths.npy")))
    warm = longtail.Workload(workload.prompts_qp, np.ones_like(workload.lengths_r))
    calibration = {}
    for cache in caches:
        longtail.transformers_system(model, warm, cache, batches=1)()  # first-call costs (one token per row)
        for t in threads:
            torch.set_num_threads(t)
            output, measured = longtail.measure(longtail.transformers_system(model, workload, cache, batches=1))
            assert np.array_equal(output.lengths_r, workload.lengths_r[:output.lengths_r.size]), "lengths not honoured"
            calibration[f"{cache}_t{t}"] = measured.as_dict()
    best = min(calibration, key=lambda k: calibration[k]["wall_s"])
    cache, t = best.rsplit("_t", 1)
    torch.set_num_threads(int(t))
    batches = len(range(0, longtail.PROMPTS, longtail.BATCH_PROMPTS))
    if static_batches == 1:  # the fastest calibration call is the first batch at the chosen setting
        c = calibration[best]
        run = dict(wall_s=round(batches * c["wall_s"], 3), compile_s=0.0, net_s=round(batches * c["net_s"], 3),
                   own_cpu_s=round(batches * c["own_cpu_s"], 2), other_cpu_s=round(batches * c["other_cpu_s"], 2),
                   extrapolated_from_batches=1)
        schedule = longtail.static_schedule(workload.lengths_r, longtail.BATCH_PROMPTS * longtail.SAMPLES)
    else:
        output, measured = longtail.measure(longtail.transformers_system(model, workload, cache,
                                                                         batches=static_batches))
        expected = workload.lengths_r[:output.lengths_r.size]
        assert np.array_equal(output.lengths_r, expected), "transformers did not honour the lengths"
        scale = batches / (static_batches or batches)
        run = dict(measured.as_dict(), **({"extrapolated_from_batches": static_batches} if scale != 1 else {}))
        for name in ("wall_s", "net_s", "own_cpu_s", "other_cpu_s"):
            run[name] = round(scale * run[name], 3)
        schedule = longtail.static_schedule(workload.lengths_r, longtail.BATCH_PROMPTS * longtail.SAMPLES)
    print(json.dumps(dict(setting=best, run=run, calibration=calibration,
                          schedule=dataclasses.asdict(schedule))))


def write_longtail(results: list[dict], path: str):
    """Writes the long-tail record, keeping earlier entries of configs not run this time."""
    previous = {}
    if os.path.exists(path):
        with open(path) as f:
            previous = {r["config"]: r for r in json.load(f).get("results", [])}
    previous.update({r["config"]: r for r in results})
    record = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=machine_record(), versions=versions_record(),
        workload=dict(prompts=longtail.PROMPTS, samples=longtail.SAMPLES, prompt_len=longtail.PROMPT_LEN,
                      cap=longtail.CAP, median_target=longtail.MEDIAN, cap_share_target=longtail.CAP_SHARE,
                      eos_id=longtail.EOS_ID, pad_id=longtail.PAD_ID, seed=longtail.SEED,
                      lengths=longtail.length_summary(longtail.imposed_lengths()),
                      static_batch_rows=longtail.BATCH_PROMPTS * longtail.SAMPLES),
        results=list(previous.values()),
        note=("useful_tok_s = imposed tokens / median net_s; net_s = wall_s - compile_s (JAX tracing and "
              "compiling inside the call); other_cpu_s = CPU seconds other processes used during the run "
              "(this is a shared 2-core machine)"))
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=["qwen2-tiny", "qwen2-small"])
    ap.add_argument("--long", nargs="*", default=["qwen2-tiny"], help=f"configs also run with {LONG_NEW} new tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--host-devices", type=int, default=len(os.sched_getaffinity(0)),
                    help="XLA host devices of the data-parallel run (default: the CPUs; < 2 skips it)")
    ap.add_argument("--torch-threads", nargs="+", type=int, default=sorted({1, len(os.sched_getaffinity(0))}),
                    help="torch thread counts transformers runs at, interleaved; the faster is reported")
    ap.add_argument("--hf-caches", nargs="+", default=["dynamic", "static"],
                    help="transformers KV caches tried on the long tail's first call; the full pass uses the faster")
    ap.add_argument("--longtail", nargs="*", default=["qwen2-tiny", "qwen2-small"],
                    help="configs run on the long-tail RL workload (bench/longtail.py)")
    ap.add_argument("--longtail-only", action="store_true", help="run only the long-tail workload")
    ap.add_argument("--longtail-repeats", type=int, default=1)
    ap.add_argument("--slots", nargs="*", type=int, default=[32, 64, 128], help="continuous slot counts (long tail)")
    ap.add_argument("--prefill-batches", nargs="*", type=int, default=[8],
                    help="in-loop prefill batch sizes run at 64 slots beside prefill_batch=0 (long tail)")
    ap.add_argument("--static-one-call", nargs="*", default=["qwen2-tiny"],
                    help="configs whose long-tail run adds static batching over all 512 rows in one call "
                         "(its KV cache is 512 x 1088 slots: 1.1 GB on qwen2-tiny, 9 GB on qwen2-small)")
    ap.add_argument("--static-batches", type=int, default=0,
                    help="long tail: run only the first K of the 8 static batches (transformers and rljax static) "
                         "and scale their time by 8 / K; every batch decodes the same 1,023 steps of 64 rows "
                         "(asserted). 0 runs all 8")
    ap.add_argument("--transformers-child", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--transformers-longtail-child", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--rljax-child", metavar="CONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--new", type=int, default=NEW, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sampling.json"))
    ap.add_argument("--longtail-out", default=os.path.join(os.path.dirname(__file__), "results",
                                                           "sampling_longtail.json"))
    args = ap.parse_args(argv)
    if args.transformers_child:
        return transformers_child(args.transformers_child, args.repeats, args.new, args.torch_threads)
    if args.transformers_longtail_child:
        return transformers_longtail_child(args.transformers_longtail_child, args.torch_threads, args.hf_caches,
                                           args.static_batches)
    if args.rljax_child:
        return rljax_child(args.rljax_child, args.repeats, args.new, args.host_devices)
    if not args.longtail_only:
        short_cases(args)
    if args.longtail:
        args.repeats = args.longtail_repeats
        write_longtail([bench_longtail(name, args) for name in args.longtail], args.longtail_out)


def short_cases(args):
    """Batch 64, prompt 32, a fixed number of new tokens (no EOS): bench/results/sampling.json."""
    data_parallel = args.host_devices >= 2 and jax.default_backend() == "cpu"
    peak = matmul_peak_gflops()
    bandwidth = memory_bandwidth_gbs()
    print(f"f32 matmul peak: {peak:.1f} GFLOP/s; memory bandwidth {bandwidth:.1f} GB/s")
    results = []
    for name, new in [(c, NEW) for c in args.configs] + [(c, LONG_NEW) for c in args.long]:
        cfg = preset(name)
        params = init_params(cfg, jax.random.key(0))
        prompts = bench_prompts(cfg)
        rljax_other = []
        total, pre = bench_rljax(cfg, params, prompts, args.repeats, new, other_cpu_s=rljax_other)
        child, hf_s, threads = bench_transformers(cfg, params, prompts, args.repeats, new, args.torch_threads)
        new_tokens = BATCH * new
        ours, theirs = new_tokens / statistics.median(total), new_tokens / hf_s
        decode_s = statistics.median(total) - statistics.median(pre)
        decode_tps = BATCH * (new - 1) / decode_s  # token 0 comes from prefill
        flops = decode_flops_per_token(cfg, slots=PROMPT + new // 2)
        row = dict(config=name, batch=BATCH, prompt=PROMPT, new_tokens=new,
                   rljax_new_tok_s=round(ours, 1), transformers_new_tok_s=round(theirs, 1),
                   speedup=round(ours / theirs, 2), rljax_runs_s=[round(x, 4) for x in total],
                   transformers_runs_s=[round(m["wall_s"], 4) for m in child["runs"][str(threads)]],
                   transformers_threads=threads, transformers_default_threads=child["default_threads"],
                   transformers_new_tok_s_by_threads={
                       t: round(new_tokens / statistics.median(m["wall_s"] for m in runs), 1)
                       for t, runs in child["runs"].items()},
                   transformers_other_cpu_s={t: [m["other_cpu_s"] for m in runs] for t, runs in child["runs"].items()},
                   rljax_other_cpu_s=rljax_other, prefill_s=round(statistics.median(pre), 4),
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
        machine=machine_record(), versions=versions_record(),
        matmul_peak_gflops=round(peak, 1), memory_bandwidth_gbs=round(bandwidth, 1), results=results,
        note=("shared 2-core CPU with other jobs running: timings are noisy; medians of the repeats. "
              "transformers_new_tok_s is its faster torch thread count (transformers_threads); *_other_cpu_s: "
              "CPU seconds other processes used during each run"))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
