"""The long-tail RL sampling workload (issue 19) and how each system runs it.

Workload. 64 prompts x 8 samples = 512 rows, prompts of 64 random token ids (fixed seed), and
completion lengths from a lognormal with median 100 tokens and 5% of the rows at the 1,024 cap:
sigma = ln(1024 / 100) / 1.645 (1.645 is the normal's 95% quantile), rounded and clipped to
[1, 1024]. RL completions look like this: most end early, a few run to the limit. The lengths are
the distribution's 512 quantiles at (i + 1/2) / 512, shuffled into rows with a fixed seed: a random
draw of 512 puts 5% +- 1% of the rows at the cap (3.9% with seed 19), while the quantiles put
exactly 26 there, so the workload has the stated shape, and only the row order is random.

Imposing the lengths. Every system decodes exactly these lengths: a logits processor forces EOS
at each row's length, and forbids it before, so no row stops early by chance. For row r at
completion index t it puts -inf on every token but EOS when t == length[r] - 1, and -inf on EOS
otherwise (`forced_lengths_jax`, `ForcedLengths` for transformers). In rljax the processor acts
on the sampling distribution only (`SampleControls.logits_processor`), so the policy log-probs are
the model's own.

Systems (`bench_sampling.py --longtail` runs them in one process, interleaved):
    transformers `generate`: 8 calls of 8 prompts x `num_return_sequences=8` (64 rows), as a
        user runs it; each call decodes until its longest row ends. In a child process.
    rljax static: the same 8 calls (`scheduler="static"`), and one call over all 512 rows.
    rljax continuous: one call over all 512 rows with S slots (`scheduler="continuous"`).

Counting. A row of length L costs L - 1 decode steps (token 0 comes from the prefill), so the
useful decode row-steps are sum(L - 1) for every system. Occupancy = useful row-steps / row-steps
computed (decode steps x rows per step, less after a continuous drain); the rest of the decode
compute went to rows that had ended (or, continuous, to empty slots). For a static batch the
steps are max(L) - 1 (`static_schedule`); for continuous batching rljax's own counters
(`SampleResult.decode_steps`, `slot_steps`, `live_row_steps`) are reported, beside a replay of the
refill order from the lengths (`continuous_schedule`).

Timing. `measure` records the wall time, the seconds JAX spent tracing and compiling inside it
(jax.monitoring events; subtracted, since compiling once per shape is not sampling), and the CPU
seconds other processes used meanwhile: on a shared 2-core machine a busy neighbour slows some
settings far more than others (torch's OpenMP threads spin at barriers), so a run with a large
`other_cpu_s` is not a clean number.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import statistics
import time

import numpy as np

PROMPTS, SAMPLES, PROMPT_LEN = 64, 8, 64
CAP, MEDIAN, CAP_SHARE = 1024, 100, 0.05
EOS_ID, PAD_ID = 1, 0  # prompts draw from [2, vocab), so neither appears in them
BATCH_PROMPTS = 8  # prompts per static call: 8 x 8 samples = 64 rows, as a transformers user batches
SEED = 19

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


@dataclasses.dataclass(frozen=True)
class Workload:
    """The long-tail workload: prompts [PROMPTS, PROMPT_LEN] and imposed lengths [PROMPTS * SAMPLES]
    (row i * SAMPLES + j is sample j of prompt i)."""

    prompts_qp: np.ndarray
    lengths_r: np.ndarray


def imposed_lengths(seed: int = SEED) -> np.ndarray:
    """The [PROMPTS * SAMPLES] completion lengths (see the module docstring for the distribution)."""
    normal = statistics.NormalDist()
    sigma = math.log(CAP / MEDIAN) / normal.inv_cdf(0.95)
    rows = PROMPTS * SAMPLES
    quantiles = [math.exp(math.log(MEDIAN) + sigma * normal.inv_cdf((i + 0.5) / rows)) for i in range(rows)]
    return np.random.default_rng(seed).permutation(np.clip(np.rint(quantiles), 1, CAP).astype(np.int32))


def make_workload(vocab_size: int, seed: int = SEED) -> Workload:
    """The fixed prompts (ids in [2, vocab_size)) and the imposed lengths."""
    prompts = np.random.default_rng(seed + 1).integers(2, vocab_size, (PROMPTS, PROMPT_LEN)).astype(np.int32)
    return Workload(prompts_qp=prompts, lengths_r=imposed_lengths(seed))


def length_summary(lengths_r: np.ndarray) -> dict:
    """Median, mean, p95, share at the cap and total of the imposed lengths."""
    lengths = np.asarray(lengths_r)
    return dict(rows=int(lengths.size), median=float(np.median(lengths)), mean=round(float(lengths.mean()), 1),
                p95=float(np.percentile(lengths, 95)), share_at_cap=round(float(np.mean(lengths == CAP)), 4),
                total_tokens=int(lengths.sum()), max=int(lengths.max()))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Decode work of one system on the workload (see "Counting" in the module docstring)."""

    decode_steps: int
    slot_steps: int  # row-steps computed
    useful_row_steps: int

    @property
    def occupancy(self) -> float:
        return self.useful_row_steps / max(self.slot_steps, 1)

    def as_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}decode_steps": self.decode_steps, f"{prefix}slot_steps": self.slot_steps,
                f"{prefix}occupancy": round(self.occupancy, 4),
                f"{prefix}wasted_row_step_share": round(1 - self.occupancy, 4)}


def static_schedule(lengths_r: np.ndarray, batch_rows: int) -> Schedule:
    """Batches of `batch_rows` consecutive rows, each decoded until its longest row ends."""
    lengths = np.asarray(lengths_r)
    steps = sum(int(lengths[i:i + batch_rows].max()) - 1 for i in range(0, lengths.size, batch_rows))
    return Schedule(decode_steps=steps, slot_steps=steps * batch_rows, useful_row_steps=int((lengths - 1).sum()))


def continuous_schedule(lengths_r: np.ndarray, slots: int, refill: int, drain: int = 0) -> Schedule:
    """Replays `rljax.sampling.continuous`'s loop: each iteration admits up to `refill` pending rows
    (input order) into free slots, drawing their token 0 from the prefill, then runs one decode
    step over all slots if any slot is running; a row leaves its slot after its L-th token. With
    `drain` > 0, once nothing is pending and at most `drain` rows run, the steps cost `drain`."""
    lengths = [int(x) for x in np.asarray(lengths_r)]
    remaining = [0] * slots  # tokens still to draw per slot; 0 = free
    next_row = steps = slot_steps = 0
    while next_row < len(lengths) or sum(r > 0 for r in remaining) > drain:
        free = [s for s in range(slots) if not remaining[s]]
        for s in free[:refill]:
            if next_row == len(lengths):
                break
            remaining[s] = lengths[next_row] - 1  # token 0 drawn at admission
            next_row += 1
        if any(remaining):
            steps, slot_steps = steps + 1, slot_steps + slots
            remaining = [max(r - 1, 0) for r in remaining]
    tail = max(remaining)  # drained: the running rows finish in `drain` slots
    return Schedule(decode_steps=steps + tail, slot_steps=slot_steps + tail * drain,
                    useful_row_steps=sum(x - 1 for x in lengths))


def forced_lengths_jax(lengths_r: np.ndarray, eos_id: int = EOS_ID):
    """`SampleControls.logits_processor` that imposes `lengths_r` (indexed by the row in input
    order; rows outside the table, as idle slots report, are clipped into it and never drawn)."""
    import jax.numpy as jnp

    lengths = np.asarray(lengths_r, np.int32)

    def impose(logits_bv, row_b, step_b):
        last_b = jnp.take(jnp.asarray(lengths), row_b, mode="clip") - 1 == step_b
        eos_v = jnp.arange(logits_bv.shape[-1]) == eos_id
        forced = jnp.where(eos_v, 0.0, -jnp.inf).astype(logits_bv.dtype)
        return jnp.where(last_b[:, None], forced[None, :], jnp.where(eos_v[None, :], -jnp.inf, logits_bv))

    return impose


def completion_lengths(tokens_rn: np.ndarray, eos_id: int = EOS_ID) -> np.ndarray:
    """Tokens up to and including the first EOS per row (the full width when there is none)."""
    tokens = np.asarray(tokens_rn)
    hit = tokens == eos_id
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, tokens.shape[1]).astype(np.int32)


# --- timing ---------------------------------------------------------------------------------------


def _busy_cpu_s() -> float:
    """CPU seconds all processes have used on this machine (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    self_, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + children.ru_utime + children.ru_stime


@dataclasses.dataclass(frozen=True)
class Measured:
    wall_s: float
    compile_s: float  # JAX tracing + lowering + compiling inside the wall time
    own_cpu_s: float  # this process and its waited-for children
    other_cpu_s: float  # every other process on the machine meanwhile

    @property
    def net_s(self) -> float:
        return self.wall_s - self.compile_s

    def as_dict(self) -> dict:
        return dict(wall_s=round(self.wall_s, 3), compile_s=round(self.compile_s, 3), net_s=round(self.net_s, 3),
                    own_cpu_s=round(self.own_cpu_s, 2), other_cpu_s=round(self.other_cpu_s, 2))


def measure(fn) -> tuple[object, Measured]:
    """(fn(), its Measured); JAX compile events are counted only when jax is already imported."""
    import sys

    compiled = []
    listen = lambda event, duration, **_kw: compiled.append(duration) if event in _COMPILE_EVENTS else None
    monitoring = sys.modules["jax"].monitoring if "jax" in sys.modules else None
    if monitoring:
        monitoring.register_event_duration_secs_listener(listen)
    busy0, own0, t0 = _busy_cpu_s(), _own_cpu_s(), time.perf_counter()
    try:
        out = fn()
    finally:
        wall = time.perf_counter() - t0
        busy, own = _busy_cpu_s() - busy0, _own_cpu_s() - own0
        if monitoring:
            monitoring.unregister_event_duration_listener(listen)
    return out, Measured(wall_s=wall, compile_s=float(sum(compiled)), own_cpu_s=own, other_cpu_s=max(busy - own, 0.0))


# --- the systems ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Output:
    """What one pass of a system over the workload produced: the completion lengths in row order
    and its decode work (rljax's counters, or the schedule computed from the lengths)."""

    lengths_r: np.ndarray
    schedule: Schedule


def rljax_system(cfg, params, workload: Workload, *, scheduler: str, batch_prompts: int = 0,
                 slots: int = 0, prefill_batch: int = 0, seed: int = 0):
    """A function that samples the whole workload with `rljax.sampling.generate` in calls of
    `batch_prompts` prompts (0: all) x SAMPLES and returns an `Output`. Each call gets its own length
    processor, made once here so that repeats reuse the compiled program."""
    import jax

    from rljax.sampling import SampleControls, generate

    controls = SampleControls(max_new_tokens=CAP, num_samples=SAMPLES, temperature=1.0, eos_ids=(EOS_ID,),
                              pad_id=PAD_ID, scheduler=scheduler, slots=slots, prefill_batch=prefill_batch)
    num_prompts = workload.prompts_qp.shape[0]
    batch_prompts = batch_prompts or num_prompts
    starts = range(0, num_prompts, batch_prompts)
    rows = batch_prompts * SAMPLES
    processors = [forced_lengths_jax(workload.lengths_r[q * SAMPLES:q * SAMPLES + rows]) for q in starts]
    key = jax.random.key(seed)

    def run() -> Output:
        lengths, steps, computed, live = [], 0, 0, 0
        for q, impose in zip(starts, processors):
            result = generate(cfg, params, workload.prompts_qp[q:q + batch_prompts], key=jax.random.fold_in(key, q),
                              controls=controls.replace(logits_processor=impose))
            tokens, got, decode_steps, slot_steps, live_row_steps = jax.device_get(
                (result.tokens, result.lengths, result.decode_steps, result.slot_steps, result.live_row_steps))
            assert np.array_equal(completion_lengths(tokens), got), "rljax lengths disagree with its tokens"
            lengths.append(got)
            steps, computed, live = steps + int(decode_steps), computed + int(slot_steps), live + int(live_row_steps)
        return Output(np.concatenate(lengths), Schedule(decode_steps=steps, slot_steps=computed, useful_row_steps=live))

    return run


def forced_lengths_torch(lengths_r: np.ndarray, prompt_len: int, eos_id: int = EOS_ID):
    """The transformers `LogitsProcessor` twin of `forced_lengths_jax` for one `generate` call whose
    rows are `lengths_r`: completion index t = input length - prompt_len."""
    import torch
    from transformers import LogitsProcessor

    lengths = torch.as_tensor(np.asarray(lengths_r, np.int64))

    class ForcedLengths(LogitsProcessor):
        def __call__(self, input_ids, scores):
            last_b = lengths - 1 == input_ids.shape[1] - prompt_len
            eos_v = torch.arange(scores.shape[-1]) == eos_id
            forced_v = torch.where(eos_v, 0.0, -math.inf).to(scores.dtype)
            return torch.where(last_b[:, None], forced_v[None, :], scores.masked_fill(eos_v[None, :], -math.inf))

    return ForcedLengths()


def transformers_system(model, workload: Workload, cache_implementation: str = "dynamic", batches: int = 0):
    """A function that samples the workload with transformers `generate` in calls of BATCH_PROMPTS
    prompts x `num_return_sequences=SAMPLES` and returns an `Output` (its schedule computed from
    the lengths: each call decodes until its longest row ends). `batches` > 0 runs only the first
    that many calls (every call here decodes 1,023 steps of 64 rows, so one is a fair sample).

    cache_implementation: "dynamic" (the default KV cache, which grows by concatenation each
    step) or "static" (preallocated to prompt + max_new_tokens; each step attends over all of it)."""
    import torch
    from transformers import LogitsProcessorList

    rows = BATCH_PROMPTS * SAMPLES
    num_prompts, prompt_len = workload.prompts_qp.shape
    starts = range(0, num_prompts, BATCH_PROMPTS)[:batches or None]
    processors = [LogitsProcessorList([forced_lengths_torch(workload.lengths_r[q * SAMPLES:q * SAMPLES + rows],
                                                            prompt_len)]) for q in starts]
    cache = {} if cache_implementation == "dynamic" else dict(cache_implementation=cache_implementation)

    def run() -> Output:
        lengths = []
        for q, processor in zip(starts, processors):
            ids = torch.as_tensor(workload.prompts_qp[q:q + BATCH_PROMPTS], dtype=torch.long)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     num_return_sequences=SAMPLES, max_new_tokens=CAP, temperature=1.0, top_k=0,
                                     top_p=1.0, eos_token_id=EOS_ID, pad_token_id=PAD_ID, logits_processor=processor,
                                     **cache)
            lengths.append(completion_lengths(out[:, prompt_len:].numpy()))
        lengths = np.concatenate(lengths)
        return Output(lengths, static_schedule(lengths, rows))

    return run
