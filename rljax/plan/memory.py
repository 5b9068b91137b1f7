"""The memory plan of a run: per-device bytes, from abstract inputs, before anything is allocated.

    state    = jax.eval_shape(init_train_state ...)             # shapes only
    sharded  = ShapeDtypeStructs carrying the trainer layout    # Layout.tree, as the run places it
    update   = jit(update, donate state).lower(sharded, batch, key).compile().memory_analysis()
    sampler  = jit(rollout).lower(params, prompts, ...).compile().memory_analysis()

Both programs are the ones the run compiles (`rljax.stages.iteration`), at the recipe's shapes:
the sampler takes `num_prompts` prompt rows of the widest prompt bucket and makes
prompts x `num_samples` rows of `max_new_tokens` (its KV cache and decode buffers are its
temporaries); the update takes that rollout batch. The bytes of a program are those of one
device's share of the SPMD program.

Peak per device:

    peak = max(update peak, sampler peak)
    update peak  = arguments + outputs - aliased + temporaries       (the state is an argument;
                   donated, its outputs alias it, so it is counted once)
    sampler peak = live state - policy params + arguments + outputs + temporaries
                   (the trainer's state stays resident while sampling; the policy params are
                   the sampler's argument in the shared layout, so they are not counted twice;
                   with `mesh.sampler = "tensor"` the argument is the sampler's own copy of the
                   params, which is added)

When the sampler shares the trainer's layout (`mesh.sampler = "shared"`) the run compiles the two
stages as ONE program (`rljax.stages.iteration.make_iteration`); the plan compiles that program
too, and its peak (arguments + outputs - aliased + temporaries, the whole state being an
argument) is the plan's peak: the compiler decides how the stages share buffers and where the
rollout batch lives between them, and the stage programs cannot say. `one_program=False` skips
it (one compile fewer; the peak is then the stages' formula above).

The bytes come from the compiler that runs the plan, normally XLA:CPU with simulated devices
(`rljax plan`): its buffer assignment approximates the TPU and GPU compilers' (fusion and
rematerialisation choices differ); the state's bytes are exact.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax

from rljax.models.setup import build_tokenizer, policy_config
from rljax.rewards.config import build_reward
from rljax.sharding.placement import build_layouts
from rljax.models import ModelConfig
from rljax.rewards import as_callback
from rljax.sharding import Layout, abstract_like
from rljax.stages.iteration import make_iteration, pinned_update
from rljax.stages.rollout import rollout
from rljax.update.abstract import abstract_train_state
from rljax.update import TrainState

RunConfig = Any  # a `rljax.train.config.TrainConfig`: read here, never imported (plan sits below train)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One compiled program's bytes per device (`Compiled.memory_analysis()`) and compile time."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    compile_seconds: float

    @property
    def peak_bytes(self) -> int:
        """What the program holds while it runs: arguments, outputs not aliased to an argument,
        temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @classmethod
    def compile(cls, jitted, *abstract_args) -> ProgramMemory:
        start = time.perf_counter()
        compiled = jitted.lower(*abstract_args).compile()
        seconds = time.perf_counter() - start
        ma = compiled.memory_analysis()
        return cls(argument_bytes=ma.argument_size_in_bytes, output_bytes=ma.output_size_in_bytes,
                   alias_bytes=ma.alias_size_in_bytes, temp_bytes=ma.temp_size_in_bytes, compile_seconds=seconds)


@dataclasses.dataclass(frozen=True)
class StateMemory:
    """The train state's bytes per device, resident for the whole run (exact: each leaf's shard).
    `mesh`: the trainer's axis sizes ({} on one device); `sampler_mesh`: the sampler's own mesh
    (None when it shares the trainer's layout), whose copy of the params is `sampler_params_bytes`."""

    mesh: dict[str, int]
    sampler_mesh: dict[str, int] | None
    params_bytes: int
    opt_state_bytes: int
    reference_bytes: int
    value_bytes: int
    other_bytes: int  # the step counter (and a learned reward's running moments)
    sampler_params_bytes: int
    adapter_bytes: int = 0  # LoRA adapters (`params` is then the frozen base)
    sampler_merged: bool = False  # LoRA: the sampler decodes a merged copy, not the state's params
    teacher_bytes: int = 0  # a frozen distillation teacher (`algorithm.distill`)
    reward_model_bytes: int = 0  # a learned reward model (`reward.model`)

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.opt_state_bytes + self.reference_bytes + self.value_bytes + self.other_bytes
                + self.adapter_bytes + self.teacher_bytes + self.reward_model_bytes)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A run's memory per device (bytes): the state, the compiled programs, the peak."""

    state: StateMemory
    update: ProgramMemory
    sampler: ProgramMemory
    iteration: ProgramMemory | None = None  # the one-program iteration (shared layout), when compiled

    @property
    def update_peak_bytes(self) -> int:
        return self.update.peak_bytes

    @property
    def sampler_peak_bytes(self) -> int:
        shared = 0 if self.state.sampler_mesh is not None or self.state.sampler_merged else self.state.params_bytes
        return self.state.total_bytes - shared + self.sampler.peak_bytes

    @property
    def peak_bytes(self) -> int:
        """The run's peak per device: the one-program iteration's when compiled, else the larger
        stage's."""
        if self.iteration is not None:
            return self.iteration.peak_bytes
        return max(self.update_peak_bytes, self.sampler_peak_bytes)

    @property
    def peak_stage(self) -> str:
        """The stage with the larger peak ("update" or "sampler")."""
        return "update" if self.update_peak_bytes >= self.sampler_peak_bytes else "sampler"

    @property
    def compile_seconds(self) -> float:
        programs = (self.update, self.sampler, self.iteration)
        return sum(p.compile_seconds for p in programs if p is not None)


# ----------------------------------------------------------------------------- abstract inputs


def device_bytes(tree) -> int:
    """Bytes one device holds of `tree`'s ShapeDtypeStructs: each leaf's shard (or all of it)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


def prompt_width(cfg: RunConfig) -> int:
    """The widest prompt bucket: the worst case the pipeline pads a batch to."""
    return max(cfg.data.prompt_buckets or (cfg.data.max_prompt_tokens,))


def _rows(layout: Layout | None, rows: int):
    return None if layout is None else layout.rows(rows)


def _controls(cfg: RunConfig, model_cfg: ModelConfig, tokenizer):
    if tokenizer is not None:
        return cfg.sampling.with_tokenizer(tokenizer)
    s = cfg.sampling
    return s.replace(eos_ids=model_cfg.eos_ids if s.eos_ids is None else s.eos_ids,
                     pad_id=(model_cfg.pad_token_id or 0) if s.pad_id is None else s.pad_id)


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """The abstract inputs and programs of one run, as the loop builds them."""

    cfg: RunConfig
    model_cfg: ModelConfig
    trainer: Layout | None
    sampler: Layout | None
    state: TrainState
    params: Any  # the sampler's params: the trainer's, or the sampler layout's copy
    prompts: tuple
    controls: Any
    callback: Any

    @classmethod
    def build(cls, cfg: RunConfig, model_cfg: ModelConfig | None, tokenizer) -> _Pieces:
        if model_cfg is None:
            tokenizer = tokenizer or build_tokenizer(cfg.model)
            model_cfg = policy_config(cfg.model, tokenizer)
        trainer, sampler = build_layouts(cfg.mesh)
        state = abstract_state_in(cfg, model_cfg, trainer)
        params = state.params
        if state.lora is not None:  # the sampler's params: the base with the adapters merged
            params = jax.eval_shape(TrainState.sampler_params, state)
            params = params if trainer is None else abstract_like(params, trainer.params(params))
        params = params if sampler is None else abstract_like(params, sampler.params(params))
        callback = as_callback(build_reward(cfg.reward), lambda ids: [""] * len(ids), ())  # never called
        return cls(cfg, model_cfg, trainer, sampler, state, params, abstract_prompts(cfg, sampler or trainer),
                   _controls(cfg, model_cfg, tokenizer), callback)

    @property
    def rows(self) -> int:
        return self.cfg.rl.prompts_per_iteration * self.controls.num_samples

    def sample_program(self, params, prompt_tokens_pt, prompt_mask_pt, index_p, key):
        k_sample, _ = jax.random.split(key)
        return rollout(self.model_cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, k_sample,
                       controls=self.controls, reward_callback=self.callback,
                       num_groups=self.cfg.rl.prompts_per_iteration, needs=self.cfg.algorithm.needs,
                       dynamic_sampling=self.cfg.rl.dynamic_sampling)

    def state_memory(self) -> StateMemory:
        s = self.state
        return StateMemory(
            mesh=dict(self.trainer.mesh.shape) if self.trainer is not None else {},
            sampler_mesh=dict(self.sampler.mesh.shape) if self.sampler is not None else None,
            params_bytes=device_bytes(s.params), opt_state_bytes=device_bytes(s.opt_state),
            reference_bytes=device_bytes(s.ref_params), value_bytes=device_bytes(s.value_params),
            other_bytes=device_bytes((s.step, None if s.reward_model is None else s.reward_model.moments)),
            adapter_bytes=device_bytes(s.adapters), teacher_bytes=device_bytes(s.teacher),
            reward_model_bytes=device_bytes(None if s.reward_model is None else s.reward_model.model),
            sampler_params_bytes=device_bytes(self.params) if self.sampler is not None or s.lora is not None else 0,
            sampler_merged=s.lora is not None and s.lora.merge_for_sampling)

    def sampler_memory(self) -> ProgramMemory:
        """The sampling program, as `make_split_iteration` compiles it (in the trainer's layout
        when the sampler shares it)."""
        layout = self.sampler or self.trainer
        key = _key(layout)
        if layout is None:
            return ProgramMemory.compile(jax.jit(self.sample_program), self.params, *self.prompts, key)
        prompts_in = _rows(layout, self.prompts[0].shape[0])
        jitted = jax.jit(self.sample_program,
                         in_shardings=(_shardings(self.params), prompts_in, prompts_in, prompts_in, layout.replicated),
                         out_shardings=(_rows(layout, self.rows), layout.replicated, layout.replicated))
        return ProgramMemory.compile(jitted, self.params, *self.prompts, key)

    def update_memory(self) -> ProgramMemory:
        """The update program, as `make_split_iteration` compiles it: state donated, batch rows
        over the batch axes."""
        batch, _, _ = jax.eval_shape(self.sample_program, self.params, *self.prompts, _key(self.sampler or self.trainer))

        update_in_layout = pinned_update(self.trainer)

        def update_program(state, batch, key):
            _, k_update = jax.random.split(key)
            return update_in_layout(state, batch, k_update)

        key = _key(self.trainer)
        if self.trainer is None:
            return ProgramMemory.compile(jax.jit(update_program, donate_argnums=(0,)), self.state, batch, key)
        state_sh, batch_sh = _shardings(self.state), _rows(self.trainer, self.rows)
        batch = abstract_like(batch, jax.tree.map(lambda _: batch_sh, batch))
        jitted = jax.jit(update_program, donate_argnums=(0,), in_shardings=(state_sh, batch_sh, self.trainer.replicated),
                         out_shardings=(state_sh, self.trainer.replicated))
        return ProgramMemory.compile(jitted, self.state, batch, key)

    def iteration_memory(self) -> ProgramMemory:
        """The one-program iteration (`make_iteration`, as the loop builds it)."""
        iteration = make_iteration(self.controls, self.callback, num_groups=self.cfg.rl.prompts_per_iteration,
                                   dynamic_sampling=self.cfg.rl.dynamic_sampling, layout=self.trainer)
        return ProgramMemory.compile(iteration, self.state, *self.prompts, _key(self.trainer))


def state_memory(cfg: RunConfig, model_cfg: ModelConfig | None = None, *, tokenizer=None) -> StateMemory:
    """The train state's bytes per device on `cfg`'s mesh, without compiling anything."""
    return _Pieces.build(cfg, model_cfg, tokenizer).state_memory()


def update_memory(cfg: RunConfig, model_cfg: ModelConfig | None = None, *, tokenizer=None) -> ProgramMemory:
    """The compiled update program's memory per device alone."""
    return _Pieces.build(cfg, model_cfg, tokenizer).update_memory()


def plan_memory(cfg: RunConfig, model_cfg: ModelConfig | None = None, *, tokenizer=None,
                one_program: bool = True, sampler: ProgramMemory | None = None) -> MemoryPlan:
    """The per-device memory of `cfg`'s run on its configured devices (`cfg.mesh`), with the
    policy `model_cfg` (default: the recipe's, `policy_config`). Abstract inputs only:
    nothing is allocated on any device. Compiles the sampler and the update programs, and the
    one-program iteration when the sampler shares the trainer's layout and `one_program`.
    `sampler`: a sampler program's memory to reuse (re-planning a change that leaves it alone)."""
    pieces = _Pieces.build(cfg, model_cfg, tokenizer)
    iteration = pieces.iteration_memory() if pieces.sampler is None and one_program else None
    return MemoryPlan(state=pieces.state_memory(), update=pieces.update_memory(),
                      sampler=sampler or pieces.sampler_memory(), iteration=iteration)


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def abstract_state_in(cfg: RunConfig, model_cfg: ModelConfig, layout: Layout | None) -> TrainState:
    """The abstract train state placed in `layout` (the trainer's), as the run places the real one."""
    state = abstract_train_state(cfg, model_cfg)
    return state if layout is None else abstract_like(state, layout.tree(state))


def abstract_prompts(cfg: RunConfig, layout: Layout | None) -> tuple[Any, Any, Any]:
    """(tokens, mask, example index) of one iteration's prompts, rows over the batch axes."""
    p, w = cfg.rl.num_prompts, prompt_width(cfg)
    sh = _rows(layout, p)
    return (jax.ShapeDtypeStruct((p, w), jax.numpy.int32, sharding=sh),
            jax.ShapeDtypeStruct((p, w), jax.numpy.bool_, sharding=sh),
            jax.ShapeDtypeStruct((p,), jax.numpy.int32, sharding=sh))


def _key(layout: Layout | None):
    key = jax.eval_shape(lambda: jax.random.key(0))
    return key if layout is None else jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=layout.replicated)
