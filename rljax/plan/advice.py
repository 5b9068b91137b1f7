"""Does the plan fit, and if not, which setting to change: re-plan with one change at a time.

Candidates, in the order tried (each alone, then all together):

    update.num_microbatches x2, x4, ...   the update's activations scale with the micro-batch rows;
                                          stops while each micro-batch still has a row per device
                                          (with `update.packing`: max_tokens_per_microbatch / 2,
                                          / 4, ... while a micro-batch holds a buffer per device)
    update.remat = true                   layer activations recomputed in the backward pass
    mesh.context = 2, 4, ... (fsdp / 2 ..) rows of >= 4,096 tokens: each row's tokens split over
                                          the context axis (`rljax.models.context_parallel`), with
                                          the micro-batches cut to one row (packed: one buffer) per
                                          data x fsdp group, so a device holds T / C tokens; the
                                          first that fits is the smallest CP degree that does
    mesh.context = C / 2, C / 4, ... 1    a recipe with a context axis of C: devices given back to
                                          fsdp (the params are replicated over context, so each
                                          halving of C halves the state); the first that fits is
                                          the largest CP degree that does
    mesh: every device on fsdp            params, optimiser state and reference split further
    update.logprob_chunk = chunk / 4      the [rows, chunk, vocab] logits of the scoring pass

The first candidate whose plan fits is the advice; when none fits, the smallest plan is named
(when the train state alone does not fit: the first candidate whose state fits, else the smallest
state).
Update-only candidates recompile only the update program (the sampler's is reused). When the base
plan compiled the one-program iteration, a candidate's peak is its stage peak plus what the one
program held beyond the base's stages (`MemoryPlan.peak_bytes` minus the stage formula), so each
candidate costs one or two compiles instead of three.

When the train state alone exceeds the device memory, no program is compiled: only a larger FSDP
axis changes the state, and its bytes are computed from shapes.
"""

from __future__ import annotations

from typing import Any

import dataclasses
from collections.abc import Iterator

from rljax.models.setup import build_tokenizer, policy_config
from rljax.errors import ConfigError
from rljax.models import ModelConfig
from rljax.plan.accelerators import format_gib
from rljax.plan.memory import MemoryPlan, plan_memory, prompt_width, state_memory

RunConfig = Any  # a `rljax.train.config.TrainConfig`: read here, never imported (plan sits below train)
LONG_ROW_TOKENS = 4096  # rows at least this long try context parallelism


@dataclasses.dataclass(frozen=True)
class Candidate:
    setting: str  # as `key=value` overrides, e.g. "update.num_microbatches=16"
    cfg: RunConfig
    update_only: bool  # leaves the state and the sampler program as they are


@dataclasses.dataclass(frozen=True)
class Advice:
    """A plan checked against `limit_bytes` per device of `device` (a name for the message)."""

    device: str
    limit_bytes: int
    estimate_bytes: int
    stage: str  # what binds: "the train state", "the update step", "sampling", "the iteration"
    setting: str | None = None  # the first change that fits (or the smallest, when none does)
    setting_bytes: int | None = None

    @property
    def fits(self) -> bool:
        return self.estimate_bytes <= self.limit_bytes

    def line(self) -> str:
        """One line: the device memory, the estimate, the setting to change."""
        head = (f"the plan needs {_gib(self.estimate_bytes)} per device ({self.stage}) but {self.device} has "
                f"{_gib(self.limit_bytes)}")
        if self.setting is None:
            return f"{head}; no setting tried helps: use more devices, model.param_dtype=bfloat16 or a larger accelerator"
        what = "train state" if self.stage == "the train state" else "plan"
        if self.setting_bytes <= self.limit_bytes:
            return f"{head}; set {self.setting} ({what}: {_gib(self.setting_bytes)})"
        return (f"{head}; no setting tried fits, the smallest {what} is {_gib(self.setting_bytes)} with "
                f"{self.setting}: use more devices, model.param_dtype=bfloat16 or a larger accelerator")


def _gib(n: int) -> str:
    return format_gib(n)


def _with(cfg: RunConfig, section: str, **changes) -> RunConfig:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def _mesh_sizes(cfg: RunConfig) -> tuple[int, int, int]:
    import jax

    n = cfg.mesh.devices or len(jax.devices())
    return cfg.mesh.resolve(n)


def _row_per_group(u, rows: int, groups: int, width: int) -> tuple[str, int] | None:
    """The update change that leaves each micro-batch one row (padded) or one buffer (packed) per
    data x fsdp group, when it holds more: (setting, value), else None.

    A CP candidate takes devices from fsdp, so at the same micro-batch a device holds twice the
    rows at half their tokens each: the same tokens, the same activations. Only with fewer rows
    per micro-batch does each device hold T / C tokens (one row's share), which is what context
    parallelism is for."""
    if u.packing:
        buffers, length = u.packed_shape(rows, width)
        return ("max_tokens_per_microbatch", groups * length) if buffers > groups else None
    if not isinstance(u.num_microbatches, int) or rows % groups or rows // groups <= u.num_microbatches:
        return None
    return "num_microbatches", rows // groups


def candidates(cfg: RunConfig, model_cfg: ModelConfig) -> Iterator[Candidate]:
    """The changes tried, in order (see the module docstring); the last combines them."""
    u = cfg.update
    data, fsdp, tensor = _mesh_sizes(cfg)
    rows = cfg.rl.prompts_per_iteration * cfg.sampling.num_samples // u.num_minibatches
    time = prompt_width(cfg) + cfg.sampling.max_new_tokens - 1
    best = None
    if u.packing:  # micro-batches are token budgets: halve the budget, keeping a buffer per device
        buffers, length = u.packed_shape(rows, time + 1)  # rows are prompt + completion wide
        while buffers // 2 >= data * fsdp:
            buffers //= 2
            best = ("max_tokens_per_microbatch", buffers * length)
            yield Candidate(f"update.max_tokens_per_microbatch={buffers * length}",
                            _with(cfg, "update", max_tokens_per_microbatch=buffers * length), True)
    micro = u.num_microbatches * 2
    while not u.packing and rows % micro == 0 and rows // micro >= data * fsdp:
        best = ("num_microbatches", micro)
        yield Candidate(f"update.num_microbatches={micro}", _with(cfg, "update", num_microbatches=micro), True)
        micro *= 2
    if u.remat in (False, "none", "selective"):  # full remat not yet tried
        yield Candidate("update.remat=true", _with(cfg, "update", remat=True), True)
    cp = 2
    while time + 1 >= LONG_ROW_TOKENS and fsdp % cp == 0:  # context parallelism, taken from fsdp
        context = cfg.mesh.context * cp
        setting = f"mesh.context={context} mesh.fsdp={fsdp // cp}"
        cand = _with(cfg, "mesh", context=context, fsdp=fsdp // cp)
        if (finer := _row_per_group(u, rows, data * (fsdp // cp), time + 1)) is not None:
            cand, setting = _with(cand, "update", **dict([finer])), f"{setting} update.{finer[0]}={finer[1]}"
        yield Candidate(setting, cand, False)
        cp *= 2
    context = cfg.mesh.context
    while context > 1 and context % 2 == 0:  # a context axis given back to fsdp, halving at a time
        context //= 2
        more = fsdp * cfg.mesh.context // context
        yield Candidate(f"mesh.context={context} mesh.fsdp={more}", _with(cfg, "mesh", context=context, fsdp=more),
                        False)
    if data > 1:
        yield Candidate(f"mesh.data=1 mesh.fsdp={data * fsdp}", _with(cfg, "mesh", data=1, fsdp=data * fsdp), False)
    chunk = min(u.chunk_for(rows // u.num_microbatches, time, model_cfg.vocab_size).time, time)  # steps per chunk
    if chunk > 1:
        yield Candidate(f"update.logprob_chunk={max(1, chunk // 4)}",
                        _with(cfg, "update", logprob_chunk=max(1, chunk // 4)), True)
    combined = _with(cfg, "update", remat=True, **dict([best] if best else []))
    setting = "update.remat=true" + (f" update.{best[0]}={best[1]}" if best else "")
    if data > 1:
        combined, setting = _with(combined, "mesh", data=1, fsdp=data * fsdp), setting + f" mesh.data=1 mesh.fsdp={data * fsdp}"
    yield Candidate(setting, combined, data == 1)


def advise(cfg: RunConfig, limit_bytes: int, device: str, *, model_cfg: ModelConfig | None = None,
           tokenizer=None, plan: MemoryPlan | None = None) -> Advice:
    """Checks `cfg`'s plan against `limit_bytes` per device; when it does not fit, re-plans with
    each candidate change and names the first that fits (or the smallest)."""
    if model_cfg is None:
        tokenizer = tokenizer or build_tokenizer(cfg.model)
        model_cfg = policy_config(cfg.model, tokenizer)
    state = state_memory(cfg, model_cfg, tokenizer=tokenizer) if plan is None else plan.state
    if state.total_bytes > limit_bytes:  # nothing compiled: only a larger FSDP axis shrinks the state
        best = None
        for cand in candidates(cfg, model_cfg):
            if not cand.update_only:
                size = state_memory(cand.cfg, model_cfg, tokenizer=tokenizer).total_bytes
                if size <= limit_bytes:  # the first whose state fits, as for the programs below
                    return Advice(device, limit_bytes, state.total_bytes, "the train state", cand.setting, size)
                if best is None or size < best[1]:
                    best = (cand.setting, size)
        return Advice(device, limit_bytes, state.total_bytes, "the train state",
                      *(best if best and best[1] < state.total_bytes else (None, None)))
    plan = plan or plan_memory(cfg, model_cfg, tokenizer=tokenizer)
    stage = "the iteration" if plan.iteration is not None else \
        ("the update step" if plan.peak_stage == "update" else "sampling")
    if plan.peak_bytes <= limit_bytes:
        return Advice(device, limit_bytes, plan.peak_bytes, stage)
    excess = plan.peak_bytes - max(plan.update_peak_bytes, plan.sampler_peak_bytes)
    sampler_bound = plan.sampler_peak_bytes > limit_bytes
    best = None
    for cand in candidates(cfg, model_cfg):
        if cand.update_only and sampler_bound:
            continue  # leaves the sampler's peak as it is
        c = plan_memory(cand.cfg, model_cfg, tokenizer=tokenizer, one_program=False,
                        sampler=plan.sampler if cand.update_only else None)
        size = max(c.update_peak_bytes, c.sampler_peak_bytes) + excess
        if size <= limit_bytes:
            return Advice(device, limit_bytes, plan.peak_bytes, stage, cand.setting, size)
        if best is None or size < best[1]:
            best = (cand.setting, size)
    return Advice(device, limit_bytes, plan.peak_bytes, stage,
                  *(best if best and best[1] < plan.peak_bytes else (None, None)))


def check_fits(cfg: RunConfig, limit_bytes: int, device: str, *, model_cfg: ModelConfig | None = None,
               tokenizer=None, plan: MemoryPlan | None = None) -> Advice:
    """`advise`, raising `ConfigError` with its one line when the plan does not fit."""
    advice = advise(cfg, limit_bytes, device, model_cfg=model_cfg, tokenizer=tokenizer, plan=plan)
    if not advice.fits:
        raise ConfigError(advice.line())
    return advice
