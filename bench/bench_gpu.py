"""rljax on one GPU, side by side with PyTorch / transformers on the same card (issues 35 and 36).

    python bench/bench_gpu.py                       # on the GPU machine, from the repo root
    python bench/bench_gpu.py --deadline 540        # the whole run within 540 s (default 560)
    python bench/bench_gpu.py --only update decode  # some sections (without ceilings, give
                                                    # --peak-tflops and --hbm-tb-s)
    .venv/bin/python bench/bench_gpu.py --small --out /tmp/gpu_smoke   # CPU smoke test of the script

Sections, in priority order (a phase starts only while the deadline leaves it time; one skipped
is recorded as skipped):
1. ceilings      bf16 matmul TFLOP/s (8192^3) and HBM bandwidth (z + 1 over 4 GiB f32).
2. update        rljax `update_step` at Qwen2.5-0.5B shapes with `model.attention` "auto" (cuDNN
                 on a GPU in bf16) and "xla" (the einsum reference), and at 1.5B shapes (remat,
                 8 micro-batches): tokens/s, MFU against the measured peak, first-call (compile)
                 seconds, programs compiled, peak memory.
3. torch_update  the PyTorch eager step on the same shapes (`bench/gpu/torch_phases.py`).
4. decode        rljax `generate`, 0.5B shapes in bf16, prompt 128 + 512 new tokens, no EOS: static
                 at batch 64 and 256, continuous with 256 slots (decode attention "auto": the
                 Pallas decode kernel on one GPU), and static 256 with the einsum decode ("xla"):
                 tokens/s, share of the HBM roofline, first-call seconds, programs compiled
                 (`jax.monitoring`).
5. hf_decode     transformers `generate` (sdpa, bf16) at batch 64; batch 256 runs last, after
                 parity, under a short limit (it did not finish in 70 s on an H200).
6. parity        f32 logits vs transformers at matmul precision default / highest, and the bf16
                 sampler/trainer log-prob gap, on a 4-layer model.
7. remat         (issue 53) the 1.5B update with remat none / selective / full at 4 and 8
                 micro-batches, and "auto-mb4": the mode `update.remat = "auto"` picks from the
                 memory plan on this device (`bench/gpu/remat_phases.py`).
8. torch_peer    (issue 53) the PyTorch step with forward + loss under `torch.compile`, and with
                 Liger's `LigerFusedLinearGRPOLoss` (skipped, saying why, without a GPU or the
                 liger_kernel package) (`bench/gpu/torch_peers.py`).
9. moe           (issue 47) the update of a Qwen3-MoE-shaped model (8 layers, hidden 2048, 64
                 experts of width 768, top-8; 2.9B params, bf16 params and moments) with grouped
                 experts (ragged_dot's Pallas Triton lowering on GPU) and the dense all-experts
                 reference: tokens/s, MFU over ACTIVE params (`bench/gpu/moe_phases.py`); about 3
                 minutes on an H200 (`--only ceilings moe` measures the peak it divides by).
10. update 3B/7B (issue 53) `--only update:3B-auto torch_update:3B update:7B-auto torch_update:7B`:
                 Qwen2.5-3B in full (f32, AdamW; PyTorch with gradient checkpointing) and Qwen2.5-7B
                 with LoRA rank 16 on a bf16 base (PyTorch: peft), rljax at the remat mode and
                 micro-batch count `update.remat = "auto"`, `update.num_microbatches = "auto"` pick
                 from the memory plan on this device (plan compiles included in the phase).
11. iteration    (issue 53) the whole GRPO iteration at 0.5B shapes: "rljax", `rljax train`'s compiled
                 iteration (sync mode, random weights, rljax's exact-value verifier: no extra
                 package), 8 iterations after compile, tokens/s, its parts (sampling, verification,
                 update) compiled and timed alone, the device's wait on the host; "trl", TRL's
                 `GRPOTrainer` (dr_grpo, transformers generate) on the same prompts, group, lengths
                 and optimiser, per iteration after one warm-up (needs trl + datasets)
                 (`bench/gpu/iteration_phases.py`).

Each (phase, case) runs in its own child process (`--phase`, `--case`) under its own time limit,
so a failure, an OOM or a hang costs only that row. Results go to
`<out>/gpu_<device>_<date>.json` and `.md` (a section ready for BENCHMARKS.md, also printed),
rewritten after every phase so a run cut short keeps what it measured. `--out` defaults to
bench/results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):  # bench/gpu helpers and the rljax checkout (not installed on the GPU machine)
    if path not in sys.path:
        sys.path.insert(0, path)

from gpu.report import markdown  # noqa: E402
from gpu.shapes import nvidia_smi, package_versions  # noqa: E402
from gpu.decode_phases import DECODE_ROOFLINE_CASES  # noqa: E402
from gpu.iteration_phases import ITERATION_CASES  # noqa: E402
from gpu.long_phases import LONG_CASES  # noqa: E402
from gpu.trace_phases import TRACE_CASES  # noqa: E402
from gpu.vl_phases import VL_CASES  # noqa: E402
from gpu.moe_phases import MOE_CASES  # noqa: E402
from gpu.remat_phases import REMAT_CASES  # noqa: E402
from gpu.torch_peers import PEER_CASES  # noqa: E402

UPDATE_CASES = ["0.5B-auto", "0.5B-xla", "1.5B-auto"]
# issue 53: Qwen2.5-3B in full and Qwen2.5-7B with LoRA on a bf16 base, the schedule "auto" picks (name the H200)
BIG_UPDATE_CASES = ["3B-auto", "7B-auto"]
DECODE_CASES = ["static-64", "static-256", "continuous-256", "static-256-xla"]
HF_CASES = ["64", "256"]

# (phase, case, time limit in seconds), in priority order. transformers at batch 256 goes last:
# a reference that did not finish in 70 s on an H200 is worth less than the parity check.
PHASES = [("ceilings", None, 60),
          *[("update", c, 150) for c in UPDATE_CASES],
          ("torch_update", "0.5B", 90), ("torch_update", "1.5B", 120),
          *[("decode", c, 100) for c in DECODE_CASES],
          # issue 48: both floors, one-pass vs reference draw, FP8 weights, the long tail (bench/gpu/decode_phases.py)
          *[("decode_roofline", c, 110 if c.startswith("longtail") else 90) for c in DECODE_ROOFLINE_CASES],
          ("hf_decode", "64", 80), ("parity", None, 60), ("hf_decode", "256", 45),
          # issue 53: the 1.5B update at each remat mode and what "auto" picks, and the stronger PyTorch peers
          *[("remat", c, 240 if c.startswith("auto") else 110) for c in REMAT_CASES],
          *[("torch_peer", c, 150) for c in PEER_CASES],
          *[("moe", c, 90) for c in MOE_CASES],  # issue 47: grouped vs dense MoE update
          # issue 53: 3B full and 7B LoRA (each rljax row plans its schedule first), with their PyTorch peers
          ("update", "3B-auto", 360), ("torch_update", "3B", 240), ("update", "7B-auto", 360), ("torch_update", "7B", 240),
          # issue 53: the whole iteration, rljax's compiled one and TRL's GRPOTrainer (bench/gpu/iteration_phases.py)
          *[("iteration", c, 240 if c == "rljax" else 300) for c in ITERATION_CASES],
          # issue 48: one traced decode call, its kernels per step and per layer (bench/gpu/trace_phases.py)
          *[("decode_trace", c, 90) for c in TRACE_CASES],
          # issue 49: the VL update and sampler at Qwen2.5-VL-3B shapes, and transformers' (bench/gpu/vl_phases.py)
          *[("vl", c, 150) for c in VL_CASES],
          # issue 50: the update and the sampler on 4k / 8k / 32k-token rows (bench/gpu/long_phases.py)
          *[("long", c, 150) for c in LONG_CASES]]
START_SHARE = 0.5  # a phase starts only with at least this share of its limit left before the deadline
RESERVE_S = 5  # kept back from the deadline for writing the results
TAIL_LINES = 30  # output lines kept in the JSON of a phase that did not finish cleanly


def run_phase(args) -> None:
    """Child process: run one (phase, case) and append its records."""
    from gpu import iteration_phases, jax_phases, long_phases, moe_phases, remat_phases, torch_peers, torch_phases, \
        trace_phases, vl_phases
    from gpu.shapes import Recorder

    fn = next(getattr(m, args.phase) for m in (jax_phases, torch_phases, remat_phases, torch_peers, moe_phases,
                                               iteration_phases, trace_phases, vl_phases, long_phases)
              if hasattr(m, args.phase))
    fn(args, args.case, Recorder(args.records, args.phase, args.case))


def spawn(args, phase: str, case: str | None, limit: float, records: str, peak, hbm) -> tuple[str, str]:
    """Runs one phase as a child (its own process group, killed whole at the limit): (status, output)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--records", records, "--budget", f"{limit:.0f}"]
    cmd += ["--case", case] if case else []
    cmd += ["--peak-tflops", str(peak)] if peak else []
    cmd += ["--hbm-tb-s", str(hbm)] if hbm else []
    cmd += ["--small"] if args.small else []
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
        return ("ok" if proc.returncode == 0 else f"failed (rc {proc.returncode})"), out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", out or ""


def read_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "") if out.returncode == 0 else None
    except Exception:
        return None


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


def write_outputs(run: dict, out_dir: str) -> tuple[str, str]:
    """Writes gpu_<device>_<date>.json and .md; returns the JSON's path and the markdown."""
    if not run.get("device_kind"):  # the ceilings phase did not run: name the card from nvidia-smi
        run["device_kind"] = (nvidia_smi() or "unknown").split(",")[0].strip() or "unknown"
    stem = os.path.join(out_dir, f"gpu_{slug(run['device_kind'])}_{run['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(run, f, indent=1, default=str)
    text = markdown(run, UPDATE_CASES + BIG_UPDATE_CASES, DECODE_CASES, HF_CASES)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    return stem + ".json", text


def selected(args) -> list[tuple[str, str | None, int]]:
    """The phases to run: all in PHASES' order, or those `--only` names, in the order it names them
    (a short device budget measures what matters most first)."""
    if not args.only:
        return list(PHASES)
    rank = lambda p: min(i for i, name in enumerate(args.only) if name in (p[0], f"{p[0]}:{p[1]}"))  # noqa: E731
    return sorted((p for p in PHASES if p[0] in args.only or f"{p[0]}:{p[1]}" in args.only), key=rank)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="shrink every shape (a CPU smoke test)")
    ap.add_argument("--deadline", type=float, default=560, help="seconds for the whole run")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the JSON and markdown")
    ap.add_argument("--only", nargs="*", help="phases (or phase:case) to run, e.g. update decode:static-256")
    ap.add_argument("--peak-tflops", type=float, help="bf16 peak when the ceilings phase does not run")
    ap.add_argument("--hbm-tb-s", type=float, help="HBM bandwidth when the ceilings phase does not run")
    # child-process arguments
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--records", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=100, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        return run_phase(args)

    os.makedirs(args.out, exist_ok=True)
    t_run = time.time()
    now = datetime.datetime.now(datetime.timezone.utc)
    fd, records = tempfile.mkstemp(prefix="bench_gpu_", suffix=".jsonl")
    os.close(fd)
    run = dict(date=now.strftime("%Y-%m-%d"), started_utc=now.strftime("%Y-%m-%d %H:%M UTC"), commit=git_commit(),
               device_kind=None, nvidia_smi=None, versions=package_versions(), accelerator={},
               args=dict(small=args.small, deadline=args.deadline, only=args.only), phases=[], records=[])
    peak, hbm = args.peak_tflops, args.hbm_tb_s
    try:
        for phase, case, limit in selected(args):
            label = phase + (f" {case}" if case else "")
            left = args.deadline - RESERVE_S - (time.time() - t_run)
            if left < START_SHARE * limit:
                print(f"== {label}: skipped, {left:.0f} s left of the deadline", flush=True)
                run["phases"].append(dict(phase=phase, case=case, status="skipped", limit_s=limit, seconds=0))
                continue
            limit = min(limit, left)
            print(f"== {label} (limit {limit:.0f} s)", flush=True)
            t = time.time()
            status, out = spawn(args, phase, case, limit, records, peak, hbm)
            entry = dict(phase=phase, case=case, status=status, limit_s=round(limit), seconds=round(time.time() - t, 1))
            if status != "ok":
                entry["tail"] = out.splitlines()[-TAIL_LINES:]
                print("\n".join("   " + line for line in entry["tail"][-10:]), flush=True)
            print(f"   {status} in {entry['seconds']} s", flush=True)
            run["phases"].append(entry)
            run["records"] = read_records(records)
            for r in run["records"]:  # the measured ceilings feed the later phases
                if r.get("what") == "device":
                    run.update(device_kind=r["device_kind"], nvidia_smi=r["nvidia_smi"], accelerator=r["accelerator"])
                peak = r["tflops"] if r.get("what") == "bf16_matmul" else peak
                hbm = r["tb_s"] if r.get("what") == "hbm" else hbm
            run["elapsed_s"] = round(time.time() - t_run, 1)
            write_outputs(run, args.out)
    finally:
        os.unlink(records)
    run["elapsed_s"] = round(time.time() - t_run, 1)
    path, text = write_outputs(run, args.out)
    print(f"\n{text}\nwrote {path} and its .md in {run['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    main()
