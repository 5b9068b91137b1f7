"""Where a run's programs live: the trainer's and the sampler's layouts from the `[mesh]` section,
and, in a multi-process async run, which processes train and which sample.

`build_layouts` is the one entry: a local run splits (or shares) this process's devices
(`mesh.sampler`, `mesh.sampler_devices`); with `mesh.sampler_processes` each side's mesh is its
own process's devices (`rljax.drivers.remote` moves weights and rollouts between them).
"""

from __future__ import annotations

import dataclasses

import jax

from rljax.errors import ConfigError
from rljax.sharding.layout import Layout, sampler_layout, trainer_layout
from rljax.sharding.mesh import MeshConfig, make_mesh, split_devices


def build_layouts(section: MeshConfig) -> tuple[Layout | None, Layout | None]:
    """(trainer layout, sampler layout) for the run's `[mesh]` section (see the module doc)."""
    return _remote_layouts(section) if section.sampler_processes else _local_layouts(section)


def _local_layouts(section: MeshConfig) -> tuple[Layout | None, Layout | None]:
    """(trainer layout, sampler layout) over this process's share of the configured devices.

    The trainer layout is None on one device (nothing to shard); the sampler layout is None when
    the sampler shares the trainer's (`mesh.sampler = "shared"`) or there is nothing to shard.
    A multi-process run must use every device of every process.

    With `mesh.sampler_devices` the two meshes are disjoint (`rljax.sharding.split_devices`): the
    trainer's axes over the first devices, the sampler's data=-1 x tensor over the last ones,
    each a layout even on one device (the overlapped modes place arrays on either side).
    """
    _clear_run_mesh()
    devices = jax.devices()[:section.devices] if section.devices else jax.devices()
    if jax.process_count() > 1 and len(devices) != jax.device_count():
        raise ConfigError(f"mesh.devices={section.devices}: a {jax.process_count()}-process run must use all "
                          f"{jax.device_count()} devices; set mesh.devices=0")
    if section.sampler_devices:
        if jax.process_count() > 1:
            raise ConfigError("mesh.sampler_devices runs in one process for now (no cross-host weight transport); "
                              "set mesh.sampler_devices=0")
        trainer_devices, sampler_devices = split_devices(devices, section.sampler_devices)
        mesh = make_mesh(section, trainer_devices)
        sampler_mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=section.sampler_tensor or 1), sampler_devices)
        return trainer_layout(mesh), sampler_layout(sampler_mesh)
    if len(devices) == 1:
        return None, None
    mesh = make_mesh(section, devices)
    if "expert" in mesh.shape or "context" in mesh.shape:
        # The MoE block reads JAX's mesh to dispatch tokens to their experts by all-to-all
        # (`rljax.models.expert_parallel`); MeshConfig allows an expert axis only with the shared sampler.
        # The forward reads it to split each row's tokens over `context` (`rljax.models.context_parallel`).
        jax.set_mesh(mesh)
    if section.sampler == "shared":
        return trainer_layout(mesh), None
    tensor = section.sampler_tensor or mesh.shape["tensor"]
    sampler_mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=tensor), devices)
    return trainer_layout(mesh), sampler_layout(sampler_mesh)


def _clear_run_mesh() -> None:
    """Unsets an expert or context mesh that an earlier `build_layouts` set as JAX's mesh: it is
    global, so without this a later layout in the same process (the plan's next candidate, a test)
    would trace its programs under the old mesh (other devices, a context axis it does not have)."""
    current = jax.sharding.get_abstract_mesh()
    if current is not None and not current.empty and {"expert", "context"} & set(current.axis_names):
        jax.set_mesh(None)


@dataclasses.dataclass(frozen=True)
class Roles:
    """Which processes train and which sample: the last `sampler_processes` sample."""

    trainers: tuple[int, ...]
    samplers: tuple[int, ...]
    process: int

    @classmethod
    def from_mesh(cls, section: MeshConfig) -> Roles:
        k, count = section.sampler_processes, jax.process_count()
        if count <= k:
            raise ConfigError(f"mesh.sampler_processes={k} needs a run of more than {k} processes (got {count}); "
                              "launch more processes (RLJAX_NUM_PROCESSES) or set mesh.sampler_processes=0")
        if count - k > 1:
            raise ConfigError(f"mesh.sampler_processes={k} of {count} processes leaves {count - k} trainer processes; "
                              f"one trainer process is supported for now: set mesh.sampler_processes={count - 1}")
        return cls(tuple(range(count - k)), tuple(range(count - k, count)), jax.process_index())

    @property
    def is_sampler(self) -> bool:
        return self.process in self.samplers


def is_sampler_process(section: MeshConfig) -> bool:
    """Whether this process is a sampler host of a multi-process async run."""
    return bool(section.sampler_processes) and Roles.from_mesh(section).is_sampler


def _remote_layouts(section: MeshConfig) -> tuple[Layout, Layout]:
    """(trainer layout, sampler layout), both over this process's own devices: on a trainer host
    the sampler layout is the one it publishes the weights in, on a sampler host the trainer
    layout only shapes the (abstract) train state. The two sides must have the same device count
    (the transfer moves shard for shard)."""
    Roles.from_mesh(section)
    devices = jax.local_devices()
    mesh = make_mesh(section, devices)
    sampler_mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=section.sampler_tensor or 1), devices)
    return trainer_layout(mesh), sampler_layout(sampler_mesh)


def data_processes(section: MeshConfig) -> dict:
    """The data pipeline's process split: every process reads the whole stream in a remote run
    (the samplers keep every k-th batch), else the pipeline's default split by process."""
    return {"process_index": 0, "process_count": 1} if section.sampler_processes else {}


def checkpoint_processes(section: MeshConfig) -> set[int] | None:
    """The processes that write checkpoints: the trainer hosts in a remote run (None: all)."""
    return set(Roles.from_mesh(section).trainers) if section.sampler_processes else None
