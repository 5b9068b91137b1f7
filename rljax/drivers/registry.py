"""`DRIVERS`: every way of running iterations, with the features each supports, and the one
table check that replaces a hand-written `raise` per combination.

`driver_name(cfg)` picks the driver from `rl.mode` and the data's shape; `check_features(cfg)`
refuses, in one line naming the conflicting keys, any feature the picked driver does not declare
(and any setting it needs that is missing). The loop runs `DRIVERS[driver_name(cfg)].build(run,
template)` and never branches on the mode, the environment or the host layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rljax.drivers.base import Driver, pipeline_callback, prompt_arrays
from rljax.drivers.host import build_host
from rljax.drivers.overlap import AsyncDriver, OneStepOff, OverlapPrograms
from rljax.drivers.remote import RemoteDriver
from rljax.drivers.sync import build_episodes, build_sync
from rljax.errors import ConfigError
from rljax.models.vl_setup import is_image_run
from rljax.stages.iteration import make_stages

# feature -> (the keys that turn it on, as a refusal names them; whether `cfg` has it on)
FEATURES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "env": ("[env]", lambda c: c.env.enabled),
    "mixture": ("[[data.sources]]/data.selection", lambda c: c.data.is_mixture),
    "resampling": ("rl.resample_round_size", lambda c: bool(c.rl.resample_round_size)),
    "replay": ("rl.replay", lambda c: bool(c.rl.replay.capacity)),
    "dynamic_sampling": ("rl.dynamic_sampling", lambda c: c.rl.dynamic_sampling),
    "tensor_sampler": ('mesh.sampler="tensor"', lambda c: c.mesh.sampler != "shared"),
    "sampler_devices": ("mesh.sampler_devices", lambda c: bool(c.mesh.sampler_devices)),
    "sampler_processes": ("mesh.sampler_processes", lambda c: bool(c.mesh.sampler_processes)),
    "prompt_buckets": ("data.prompt_buckets", lambda c: bool(c.data.prompt_buckets)),
    "partial_rollouts": ("rl.partial_rollouts", lambda c: c.rl.partial_rollouts),
    "images": ("image prompts ([model.vision], a qwen2_5_vl checkpoint or data.source='visual')", is_image_run),
}


@dataclasses.dataclass(frozen=True)
class DriverSpec:
    """A driver: `build(run, template) -> Driver`, what it is called in a refusal (`label`) and how
    to leave it (`leave`), the features it supports, and those it cannot run without (`needs`,
    each with its one-line reason)."""

    build: Callable[[Any, Any], Driver]
    label: str
    leave: str
    supports: frozenset[str]
    needs: tuple[tuple[str, str], ...] = ()


# ----------------------------------------------------------------------------- the overlapped builders


def _overlap_programs(run, template) -> tuple[OverlapPrograms, Callable]:
    """(the two meshes' programs, the verifier callback) on `run`'s single-source pipeline."""
    callback = pipeline_callback(run)
    stages = make_stages(run.controls, callback, template, num_prompts=run.cfg.rl.num_prompts,
                         trainer=run.trainer_layout, sampler=run.sampler_layout)
    return OverlapPrograms.from_stages(stages), callback


def _pipeline(run):
    """(the pipeline's iterator, a source of its next batch on the sampler's mesh)."""
    data = iter(run.data.dataset)
    return data, lambda: prompt_arrays(next(data), run.sampler_layout or run.trainer_layout)


def build_one_step_off(run, template) -> OneStepOff:
    programs, callback = _overlap_programs(run, template)
    data, prompts = _pipeline(run)
    return OneStepOff(programs, prompts, run.keys["loop"], data=data, callback=callback,
                      num_prompts=run.cfg.rl.num_prompts, prompt_len=run.cfg.data.max_prompt_tokens)


def build_async(run, template) -> AsyncDriver:
    cfg = run.cfg
    programs, callback = _overlap_programs(run, template)
    data, prompts = _pipeline(run)
    return AsyncDriver(programs, prompts, run.keys["loop"], max_staleness=cfg.rl.max_staleness,
                       queue_batches=cfg.rl.queue_batches, wait_for_fresh=cfg.rl.stale_rows == "wait",
                       rows=cfg.rl.prompts_per_iteration * cfg.sampling.num_samples,
                       segment_steps=cfg.rl.segment_steps if cfg.rl.partial_rollouts else 0,
                       data=data, callback=callback)


def build_remote(run, template) -> RemoteDriver:
    """The trainer host of a multi-process async run; the producers are other processes."""
    programs, callback = _overlap_programs(run, template)
    return RemoteDriver(programs, run.keys["loop"], run.cfg, template, num_prompts=run.cfg.rl.num_prompts,
                        data=iter(run.data.dataset), callback=callback)


# ----------------------------------------------------------------------------- the table

_SEPARATE_DEVICES = ("sampler_devices", "overlaps sampling and training on separate devices; set "
                                        "mesh.sampler_devices (e.g. 1)")
_SINGLE_SOURCE = frozenset({"tensor_sampler", "sampler_devices"})
DRIVERS: dict[str, DriverSpec] = {
    "sync": DriverSpec(build_sync, "rl.mode=sync", "",
                       frozenset({"dynamic_sampling", "tensor_sampler", "sampler_devices", "prompt_buckets", "images"})),
    "episodes": DriverSpec(build_episodes, "[env]", "remove [env]",
                           frozenset({"env", "sampler_devices", "prompt_buckets"})),
    "host": DriverSpec(build_host, "host-steered batching",
                       "remove [[data.sources]]/data.selection, rl.resample_round_size and rl.replay",
                       frozenset({"mixture", "resampling", "replay", "dynamic_sampling", "tensor_sampler",
                                  "sampler_devices", "prompt_buckets"})),
    "one_step_off": DriverSpec(build_one_step_off, "rl.mode=one_step_off", "set rl.mode=sync",
                               _SINGLE_SOURCE, needs=(_SEPARATE_DEVICES,)),
    "async": DriverSpec(build_async, "rl.mode=async", "set rl.mode=sync",
                        _SINGLE_SOURCE | {"prompt_buckets", "partial_rollouts"}, needs=(_SEPARATE_DEVICES,)),
    "remote": DriverSpec(build_remote, "rl.mode=async with mesh.sampler_processes",
                         "set mesh.sampler_processes=0", frozenset({"tensor_sampler", "sampler_processes"})),
}


def driver_name(cfg) -> str:
    """The driver that runs `cfg`: the overlapped modes by `rl.mode` (across processes with
    `mesh.sampler_processes`); a synchronous run host-steered for a mixture, resampling or
    replay, else episodes with an `[env]`, else the fused pipeline iteration."""
    if cfg.rl.mode != "sync":
        return "remote" if cfg.rl.mode == "async" and cfg.mesh.sampler_processes else cfg.rl.mode
    return "host" if cfg.host_batching else "episodes" if cfg.env.enabled else "sync"


def check_features(cfg) -> None:
    """One line per refusal: a feature the driver does not support, or a setting it needs."""
    name = driver_name(cfg)
    spec = DRIVERS[name]
    for feature, (keys, on) in FEATURES.items():
        if on(cfg) and feature not in spec.supports:
            fix = f"drop {keys}" + (f" or {spec.leave}" if spec.leave else "")
            where = [d.label for d in DRIVERS.values() if feature in d.supports and d.label != keys]
            runs = f" (only {where[0]} runs it)" if len(where) == 1 else ""
            raise ConfigError(f"{keys} does not combine with {spec.label}{runs}; {fix}")
    for feature, reason in spec.needs:
        if not FEATURES[feature][1](cfg):
            raise ConfigError(f"{spec.label} {reason} or {spec.leave}")
