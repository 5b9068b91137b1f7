"""One RL iteration: rollout -> update, compiled as one program or as two.

    batch, rollout_metrics, preview = rollout(params, prompts)     # rljax.stages.rollout
    state, train_metrics = update(state, batch)                    # rljax.update

`make_iteration` compiles both as ONE program: no Python runs between the stages, the host is
visited once (inside the verifier callback), and the train state is donated.

`make_split_iteration` is the same iteration when the sampler has its own layout (e.g. params
replicated over data-parallel sampler replicas, split over tensor-parallel heads): the trainer's
params (under LoRA, the base with the adapters merged) are resharded on device into the sampler
layout (`rljax.sharding.sync_weights`, timed as weight-sync seconds), a sampling program builds
the `RolloutBatch` there, and the update program runs in the trainer layout. Both forms draw
the same keys, so they give the same result.

Across processes both forms work unchanged: inputs are global arrays and the verifier callback
runs once, on the process that holds device 0, which sees every row (every process holds the
same example table).

`make_stages` compiles the two stages as separate programs on one device, for iterations the
host steers between them (`rljax.drivers.host`: DAPO resampling rounds, replay, a mixture's
selection policy).

Both return `(state, metrics, preview)`: the metrics of the two stages are merged with
`merge_metrics`, which refuses a key both stages report (`rollout/...` covers every sampled row,
`train/...` the rows the loss saw).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from rljax.sampling import SampleControls
from rljax.sharding import Layout, sync_weights
from rljax.stages.rollout import rollout, rollout_from_samples
from rljax.update import TrainState, update


def merge_metrics(*parts: dict) -> dict:
    """One metrics dict from the stages' dicts; a key reported by two stages is a bug, not a merge."""
    merged: dict = {}
    for part in parts:
        clash = merged.keys() & part.keys()
        if clash:
            raise ValueError(f"metric names reported by two stages: {sorted(clash)}")
        merged.update(part)
    return merged


def _rollout_fn(controls, reward_callback, num_groups, dynamic_sampling):
    def fn(cfg, needs, params, prompt_tokens_pt, prompt_mask_pt, index_p, key, images=None):
        return rollout(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, key, controls=controls,
                       reward_callback=reward_callback, num_groups=num_groups, needs=needs,
                       dynamic_sampling=dynamic_sampling, images=images)
    return fn


def _score_fn(controls, reward_callback, num_groups, dynamic_sampling):
    """`rollout_from_samples` with the run's settings: the sampling program without its sampling."""
    def fn(cfg, needs, params, out, prompt_tokens_pt, prompt_mask_pt, index_p, key):
        k_sample, _ = jax.random.split(key)  # as `_stage_programs` splits it: same baseline key
        return rollout_from_samples(cfg, params, out, prompt_tokens_pt, prompt_mask_pt, index_p, k_sample,
                                    controls=controls, reward_callback=reward_callback, num_groups=num_groups,
                                    needs=needs, dynamic_sampling=dynamic_sampling)
    return fn


def make_iteration(controls: SampleControls, reward_callback: Callable, *, num_groups: int,
                   dynamic_sampling: bool = False, layout: Layout | None = None):
    """Builds `iteration(state, prompt_tokens_pt, prompt_mask_pt, index_p, key, images=None) ->
    (state, metrics, preview)`, ONE jitted program with the state donated. The rollout produces
    what the objective needs (`state.algo.needs`, static). `images`: the prompts'
    `rljax.data.prompt_images.PromptImages` (None, no leaves: text prompts). With a `layout` (the
    trainer's), the new state comes back in it and the metrics and preview come back replicated
    (readable on every process)."""
    roll = _rollout_fn(controls, reward_callback, num_groups, dynamic_sampling)
    return fuse(lambda state, *prompts_and_key: roll(state.model_cfg, state.algo.needs, state.sampler_params(),
                                                      *prompts_and_key), layout=layout)


def pinned_update(layout: Layout | None) -> Callable:
    """`update`, traced with each row's hidden states kept on the trainer layout's devices that
    hold the row (`Layout.pinned_rows`; `rljax.models.row_pinning` says why); plain `update` on
    one device."""
    if layout is None:
        return update

    def update_in_layout(state: TrainState, batch, key):
        with layout.pinned_rows():
            return update(state, batch, key)

    return update_in_layout


def fuse(rollout_of: Callable, *, layout: Layout | None = None):
    """`rollout_of(state, prompt_tokens_pt, prompt_mask_pt, index_p, key, images) -> (batch,
    metrics, preview)` followed by the update, as ONE jitted program with the state donated (the
    form `make_iteration` and the multi-turn episode iteration share)."""
    update_program = pinned_update(layout)

    def iteration(state: TrainState, prompt_tokens_pt, prompt_mask_pt, index_p, key, images=None):
        k_sample, k_update = jax.random.split(key)
        batch, rollout_metrics, preview = rollout_of(state, prompt_tokens_pt, prompt_mask_pt, index_p, k_sample,
                                                     images)
        state, train_metrics = update_program(state, batch, k_update)
        metrics = merge_metrics(rollout_metrics, train_metrics)
        if layout is not None:
            # Pin the outputs: the state leaves as it came (so the next call hits the compile
            # cache instead of recompiling for an equivalent inferred layout), metrics replicated.
            state = jax.lax.with_sharding_constraint(state, layout.tree(state))
            metrics, preview = jax.lax.with_sharding_constraint((metrics, preview), layout.replicated)
        return state, metrics, preview

    return jax.jit(iteration, donate_argnums=(0,))


def make_split_iteration(controls: SampleControls, reward_callback: Callable, state: TrainState, *,
                         num_prompts: int, num_groups: int, trainer: Layout, sampler: Layout,
                         dynamic_sampling: bool = False):
    """Builds `iteration(state, prompt_tokens_pt, prompt_mask_pt, index_p, key) -> (state, metrics,
    preview)` as weight sync -> sampling program (sampler layout) -> update program (trainer layout).

    `state` is a template (shapes and trainer shardings are taken from it). The prompts should
    arrive in the sampler layout (`sampler.batch`). Metrics add host timings: `time/weight_sync_s`
    (the on-device reshard of the params), `time/sample_s` (sampling, verifier callback included)
    and `time/update_s`.
    """
    p = _split_programs(controls, reward_callback, state, num_prompts=num_prompts, num_groups=num_groups,
                        trainer=trainer, sampler=sampler, dynamic_sampling=dynamic_sampling)
    to_sampler, sampler_params_sh, sample_jit, update_jit, batch_sh = (
        p.to_sampler, p.sampler_params_sh, p.sample_jit, p.update_jit, p.batch_sh)

    def iteration(state: TrainState, prompt_tokens_pt, prompt_mask_pt, index_p, key, images=None):
        no_images(images, "a sampler layout of its own")
        t_sync = time.perf_counter()
        params, _ = sync_weights(jax.block_until_ready(to_sampler(state)), sampler_params_sh)
        sync_s = time.perf_counter() - t_sync
        t0 = time.perf_counter()
        batch, rollout_metrics, preview = sample_jit(params, prompt_tokens_pt, prompt_mask_pt, index_p, key)
        batch = jax.block_until_ready(jax.device_put(batch, batch_sh))  # sampler -> trainer mesh
        del params  # the sampler's copy is rebuilt from the updated params next iteration
        t1 = time.perf_counter()
        state, train_metrics = update_jit(state, batch, key)
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        timings = {"time/weight_sync_s": sync_s, "time/sample_s": t1 - t0, "time/update_s": t2 - t1}
        return state, merge_metrics(rollout_metrics, train_metrics, timings), preview

    return iteration


def no_images(images, where: str) -> None:
    """Image prompts reach only the fused sync iteration (the drivers' table refuses the rest)."""
    if images is not None:
        raise ValueError(f"image prompts reached {where}, which does not take them")


def _stage_programs(roll, cfg, needs, trainer: Layout | None = None):
    """The sampling and update stages as functions of their inputs, splitting `key` as the fused
    iteration does (sample with the first half, update with the second); the update's rows
    pinned to the `trainer` layout (`pinned_update`)."""
    update_in_layout = pinned_update(trainer)

    def sample_program(params, prompt_tokens_pt, prompt_mask_pt, index_p, key):
        k_sample, _ = jax.random.split(key)
        return roll(cfg, needs, params, prompt_tokens_pt, prompt_mask_pt, index_p, k_sample)

    def update_program(state, batch, key):
        _, k_update = jax.random.split(key)
        return update_in_layout(state, batch, k_update)

    return sample_program, update_program


@dataclasses.dataclass(frozen=True)
class _SplitPrograms:
    to_sampler: Callable
    sampler_params_sh: Any
    sample_jit: Callable
    update_jit: Callable
    batch_sh: NamedSharding
    prompts_sh: NamedSharding
    # Interruptible rollouts (rl.partial_rollouts): the host drives the decode with these controls
    # and model, then `score_jit(params, SampleResult, prompts, mask, index, key)` scores it.
    controls: SampleControls
    model_cfg: Any
    score_jit: Callable


def _split_programs(controls, reward_callback, state, *, num_prompts, num_groups, trainer, sampler,
                    dynamic_sampling) -> _SplitPrograms:
    """The sampling program (sampler layout) and the update program (trainer layout)."""
    roll = _rollout_fn(controls, reward_callback, num_groups, dynamic_sampling)
    cfg, needs = state.model_cfg, state.algo.needs
    rows = num_groups * controls.num_samples

    sampler_params_sh = sampler.params(jax.eval_shape(TrainState.sampler_params, state))
    state_shardings = trainer.tree(state)
    # LoRA: the sampler's copy is the base with the adapters merged, built in the trainer layout
    to_sampler = jax.jit(TrainState.sampler_params) if state.lora is not None else TrainState.sampler_params

    sample_program, update_program = _stage_programs(roll, cfg, needs, trainer)

    prompts_in = sampler.rows(num_prompts)
    sample_jit = jax.jit(sample_program,
                         in_shardings=(sampler_params_sh, prompts_in, prompts_in, prompts_in, sampler.replicated),
                         out_shardings=(sampler.rows(rows), sampler.replicated, sampler.replicated))
    batch_sh = trainer.rows(rows)  # every RolloutBatch leaf is [rows, ...]
    update_jit = jax.jit(update_program, donate_argnums=(0,),
                         in_shardings=(state_shardings, batch_sh, trainer.replicated),
                         out_shardings=(state_shardings, trainer.replicated))
    score = _score_fn(controls, reward_callback, num_groups, dynamic_sampling)
    score_jit = jax.jit(lambda *args: score(cfg, needs, *args),  # inputs already on the sampler's mesh
                        out_shardings=(sampler.rows(rows), sampler.replicated, sampler.replicated))

    host_controls = controls.replace(record_routes=True) if needs.routes else controls  # routing replay's record
    return _SplitPrograms(to_sampler, sampler_params_sh, sample_jit, update_jit, batch_sh, prompts_in, host_controls,
                          cfg, score_jit)


def make_stages(controls: SampleControls, reward_callback: Callable, state: TrainState, *, num_prompts: int,
                trainer: Layout | None = None, sampler: Layout | None = None) -> "Stages":
    """The two stages as separate programs, for iterations the host steers between them
    (`rljax.drivers.host`): `Stages.sample(state, prompt_tokens_pt, prompt_mask_pt, index_p,
    key)` samples and scores `num_prompts` prompts (a `RolloutBatch` of num_prompts * n rows),
    `Stages.update(state, batch, key)` runs the update (state donated). `key` is split as
    `make_iteration` splits it, so one round of `num_groups` prompts reproduces the fused
    iteration. With a trainer layout they are `make_split_iteration`'s programs (the sampler
    layout defaults to the trainer's): params are synced into the sampler layout, prompts and
    batches placed on the right mesh."""
    if trainer is not None:
        programs = _split_programs(controls, reward_callback, state, num_prompts=num_prompts, num_groups=num_prompts,
                                   trainer=trainer, sampler=sampler or trainer, dynamic_sampling=False)
        return Stages(None, None, programs)
    roll = _rollout_fn(controls, reward_callback, num_prompts, False)
    cfg, needs = state.model_cfg, state.algo.needs

    sample_program, update_program = _stage_programs(roll, cfg, needs)

    return Stages(jax.jit(sample_program), jax.jit(update_program, donate_argnums=(0,)), None)


@dataclasses.dataclass(frozen=True)
class Stages:
    """`make_stages`'s programs: one device (`sample_jit`, `update_jit`) or split layouts."""

    sample_jit: Callable | None
    update_jit: Callable | None
    split: _SplitPrograms | None

    def sample(self, state: TrainState, prompt_tokens_pt, prompt_mask_pt, index_p, key):
        if self.split is None:
            return self.sample_jit(state.sampler_params(), prompt_tokens_pt, prompt_mask_pt, index_p, key)
        p = self.split
        params, _ = sync_weights(jax.block_until_ready(p.to_sampler(state)), p.sampler_params_sh)
        prompts = jax.device_put((prompt_tokens_pt, prompt_mask_pt, index_p), p.prompts_sh)
        return p.sample_jit(params, *prompts, key)

    def update(self, state: TrainState, batch, key):
        if self.split is None:
            return self.update_jit(state, batch, key)
        return self.split.update_jit(state, jax.device_put(batch, self.split.batch_sh), key)
