"""Shapes, FLOP and byte formulas, timing and recording shared by the GPU bench's phases.

The model shapes are Qwen2.5-0.5B's, 1.5B's, 3B's and 7B's published `config.json` fields (random
weights: speed does not depend on their values). `--small` swaps in a 2-3 layer, width-128 model
with a 4,096-token vocabulary so the whole bench runs on a CPU.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time

QWEN = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    # issue 53: Qwen2.5-3B (full fine-tuning) and Qwen2.5-7B (LoRA on a bf16 base)
    "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
SMALL = {
    "0.5B": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "1.5B": dict(hidden_size=192, intermediate_size=384, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2),
    "3B": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2),
    "7B": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False),
}
COMMON = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
              max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, vocab_size=151936,
              tie_word_embeddings=True, use_sliding_window=False, bos_token_id=151643, eos_token_id=None)

VERSION_PACKAGES = ("jax", "jaxlib", "flax", "optax", "chex", "numpy", "torch", "transformers")
# Modules the GPU machine's Python lacks: the bench must run without them.
ABSENT_ON_GPU_MACHINE = ("grain", "math_verify", "reasoning_gym")


def hf_config(name: str, small: bool) -> dict:
    """config.json fields of `name` ("0.5B", "1.5B", "3B" or "7B"), no EOS (decode runs to its budget)."""
    cfg = {**COMMON, **(SMALL if small else QWEN)[name]}
    if small:
        cfg.update(vocab_size=4096, bos_token_id=1)
    return cfg


def matmul_params(hf: dict) -> int:
    """Weights a token's matmuls multiply by: every layer's q, k, v, o and MLP, plus the tied
    vocabulary projection (the embedding lookup itself is free)."""
    d, f, n, k = hf["hidden_size"], hf["intermediate_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    h = d // n
    return hf["num_hidden_layers"] * (d * (n + 2 * k) * h + n * h * d + 3 * d * f) + hf["vocab_size"] * d


def train_flops_per_token(hf: dict, seq: int) -> float:
    """Model FLOPs of one training token: 6 N (forward 2 N, backward 4 N) over the matmul weights,
    plus causal attention counted as the full square (QK^T and PV over all `seq` keys, as the
    kernels compute it), also x3 for the backward. The convention of the H200 note."""
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    attention = hf["num_hidden_layers"] * 2 * n * (d // n) * seq
    return 6.0 * (matmul_params(hf) + attention)


def kv_bytes_per_token(hf: dict, dtype_bytes: int = 2) -> int:
    d, n, k = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    return hf["num_hidden_layers"] * 2 * k * (d // n) * dtype_bytes


def decode_floor_bytes(hf: dict, weight_bytes: int, batch: int, prompt: int, new: int) -> float:
    """The fewest bytes a decode of `new` tokens must read: every weight once per step, plus each
    row's KV cache up to its current length (prompt + tokens so far) at every step."""
    kv_rows = batch * sum(prompt + t for t in range(new))
    return new * weight_bytes + kv_rows * kv_bytes_per_token(hf)


def timed(fn, reps: int, budget_s: float = float("inf")) -> tuple[float, list[float]]:
    """Median wall seconds of up to `reps` calls of `fn` (which blocks until its work is done),
    stopping early once `budget_s` is spent (at least one call)."""
    times, start = [], time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start + times[-1] > budget_s:
            break
    ordered = sorted(times)
    return ordered[len(ordered) // 2], times


def timed_first(step, reps: int, budget_s: float) -> tuple[float, float, list[float]]:
    """(seconds of a first `step()`, the median and times of up to `reps` more): a step that blocks
    until its work is done."""
    t = time.perf_counter()
    step()
    first_s = time.perf_counter() - t
    med, times = timed(step, reps, budget_s=budget_s)
    return first_s, med, times


def timed_update(update_step, state, batch, counter, reps: int, budget_s: float):
    """(first-call seconds, the compiles it made, median seconds of up to `reps` timed steps, their
    times, the first step's metrics) of `update_step(state, batch, key)`, each step fed the last
    one's state (so donated buffers stay valid) and blocked on until done. `counter` is a
    `CompileCounter`, taken before the first call."""
    import jax

    jax.block_until_ready(state)
    counter.take()
    t = time.perf_counter()
    state, metrics = update_step(state, batch, jax.random.key(0))
    jax.block_until_ready((state.params, metrics))
    first_s, first = time.perf_counter() - t, counter.take()
    holder = [state]
    del state

    def step():
        new, m = update_step(holder[0], batch, jax.random.key(1))
        jax.block_until_ready((new.params, m))
        holder[0] = new

    med, times = timed(step, reps, budget_s=budget_s)
    return first_s, first, med, times, metrics


class Recorder:
    """Appends one JSON line per result to the run's records file, flushed at once, so a phase
    killed by its time limit keeps what it measured."""

    def __init__(self, path: str, phase: str, case: str | None):
        self.path, self.phase, self.case = path, phase, case

    def __call__(self, **fields) -> dict:
        rec = {"phase": self.phase, "case": self.case, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        print("RESULT", json.dumps(rec, default=str)[:600], flush=True)
        return rec


class CompileCounter:
    """Programs XLA compiles while it listens, from `jax.monitoring`: one backend-compile event
    per program (with its seconds), and one lowering event per program lowered."""

    BACKEND = "/jax/core/compile/backend_compile"  # "..._duration" in jax 0.10; a prefix, to be safe
    LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"

    def __init__(self):
        import jax

        self.compiles, self.lowerings, self.compile_s = 0, 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, *_args, **_kw):
        if event.startswith(self.BACKEND):
            self.compiles += 1
            self.compile_s += float(duration)
        elif event == self.LOWERING:
            self.lowerings += 1

    def take(self) -> dict:
        """Counts since the last take."""
        out = dict(programs_compiled=self.compiles, programs_lowered=self.lowerings,
                   backend_compile_s=round(self.compile_s, 3))
        self.compiles, self.lowerings, self.compile_s = 0, 0, 0.0
        return out


def package_versions() -> dict:
    """Installed versions (metadata only: nothing is imported) and the Python's."""
    out = {"python": sys.version.split()[0]}
    for name in VERSION_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    for dist in importlib.metadata.distributions():  # jax's CUDA plugin, e.g. jax-cuda13-plugin
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("jax-cuda") or name.startswith("jax_cuda"):
            out[name] = dist.version
    return out


def accelerator_versions() -> dict:
    """CUDA and cuDNN as jax's plugin and torch see them (None where unavailable)."""
    out: dict = {}
    try:
        from jax._src.lib import cuda_versions  # private, but what jax itself reports from
        if cuda_versions is not None:
            for key, fn in (("cuda_runtime", "cuda_runtime_get_version"), ("cuda_driver", "cuda_driver_get_version"),
                            ("cudnn", "cudnn_get_version")):
                try:
                    out[f"jax_{key}"] = getattr(cuda_versions, fn)()
                except Exception:
                    out[f"jax_{key}"] = None
    except Exception:
        pass
    try:
        import torch
        out["torch_cuda"] = torch.version.cuda
        out["torch_cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    except Exception:
        pass
    return out


def nvidia_smi() -> str | None:
    """Name, memory, clocks and driver of each GPU, or None without nvidia-smi."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        return None


def absent_module_imports() -> list[str]:
    """Modules the GPU machine lacks that this process has imported (should be none)."""
    return [m for m in ABSENT_ON_GPU_MACHINE if m in sys.modules]
