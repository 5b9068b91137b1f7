"""A device mesh from config: axes (data, fsdp, [expert,] tensor), sizes filled in from the device count.

Axis order goes from least to most communication: `data` (pure replicas, only gradients are
all-reduced; put it across hosts/DCN), `fsdp` (params and optimiser state sharded, all-gathered
per layer: ZeRO-3, Rajbhandari et al., 2020), `expert` (a mixture of experts' expert weights
split on E, tokens sent to their experts by all-to-all: GShard, Lepikhin et al., 2020; a batch
axis for everything else; `rljax.models.expert_parallel`), `tensor` (heads and the MLP split
inside each matmul: Megatron-LM, Shoeybi et al., 2019; innermost, so it lands on the fastest
links). The `expert` axis exists only when `mesh.expert` > 1, so every other mesh is unchanged.

Axis types are `Auto`, chosen deliberately. JAX 0.10's `jax.make_mesh` defaults to `Explicit`
axes, where shardings are part of every array's type and any op whose operands disagree (an FSDP
matmul contracting over a sharded dim, an embedding gather from a sharded table) must say how to
reshard with `out_sharding=`. That would put layout annotations inside `rljax.models`. With `Auto`
axes the model code stays layout-free: compiled functions take explicit in/out shardings (pjit
semantics) and the compiler propagates them through the body, inserting the collectives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import jax
from jax.sharding import AxisType, Mesh

from rljax.config_io import bounded
from rljax.errors import ConfigError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # batches and activations shard their leading dim over both


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh (the `[mesh]` section): the trainer's (data, fsdp, tensor) axis sizes, at
    most one -1 ("the rest of the devices"), over the first `devices` devices (0: all; a
    multi-process run needs all). The default, data=1, fsdp=-1, tensor=1, is plain FSDP over every
    device; one device means no sharding. Each sampler mesh is one of these too (data=-1, fsdp=1).

    `context` > 1 adds a `context` axis of that size (before tensor): every row's tokens split
    over it in zig-zag order, attention over all-gathered keys (`rljax.models.context_parallel`).

    `expert` > 1 adds an `expert` axis of that size (between fsdp and tensor) for a mixture of
    experts: expert weights split on E over it, tokens split over data x fsdp x expert.

    `sampler` picks where sampling runs:
    - `shared`: in the trainer's layout (FSDP params); the whole iteration is ONE program.
    - `tensor`: in its own layout, a mesh of data=-1 x tensor=`sampler_tensor` (0: the trainer's
      tensor size) over the same devices, params replicated over data and split over heads and
      the MLP on tensor, so decoding needs no per-token all-gathers. Each iteration then reshards
      the params on device (`time/weight_sync_s`), runs a sampling program and an update program.

    `sampler_devices` > 0 gives the sampler devices of its own (ReaLHF, Mei et al., 2024): the last
    that many devices (a float in (0, 1): that fraction of them) form the sampler's mesh (data=-1 x
    tensor=`sampler_tensor`), the rest the trainer's, so `rl.mode` can overlap the two.

    `sampler_processes` = k > 0 (a multi-process `rl.mode = "async"` run) makes the last k
    processes sampler hosts and the others trainer hosts (`rljax.drivers.remote`): each side's mesh
    is its own process's devices, weights and rollouts move over `rljax.sharding.transport`, and a
    peer silent for `transport_timeout_s` seconds stops the run.
    """

    data: int = bounded(1, ge=1, also=(-1,))
    fsdp: int = bounded(-1, ge=1, also=(-1,))
    tensor: int = bounded(1, ge=1, also=(-1,))
    expert: int = bounded(1, ge=1)
    context: int = bounded(1, ge=1)
    devices: int = bounded(0, ge=0)
    sampler: Literal["shared", "tensor"] = "shared"
    sampler_tensor: int = bounded(0, ge=0)
    sampler_devices: int | float = bounded(0, ge=0)
    sampler_processes: int = bounded(0, ge=0)
    transport_timeout_s: float = bounded(120.0, gt=0)

    def __post_init__(self):
        sizes = self.sizes()
        if any(s == 0 or s < -1 for s in sizes):
            raise ConfigError(f"mesh sizes {dict(zip(AXES, sizes))} must be positive or -1 (the rest)")
        if sizes.count(-1) > 1:
            raise ConfigError(f"mesh sizes {dict(zip(AXES, sizes))}: at most one axis may be -1")
        if self.sampler_processes and self.sampler_devices:
            raise ConfigError("mesh.sampler_processes gives the sampler whole processes; drop mesh.sampler_devices "
                              "(set it to 0)")
        if not (self.sampler_devices == 0 or (isinstance(self.sampler_devices, int) and self.sampler_devices > 0)
                or 0 < self.sampler_devices < 1):
            raise ConfigError(f"mesh.sampler_devices={self.sampler_devices} must be a device count >= 1, a fraction "
                              "in (0, 1), or 0 (the sampler shares the trainer's devices)")
        if self.expert > 1 and (self.sampler != "shared" or self.sampler_devices or self.sampler_processes):
            raise ConfigError(f"mesh.expert={self.expert} runs with the sampler in the trainer's layout for now; set "
                              "mesh.sampler='shared', mesh.sampler_devices=0 and mesh.sampler_processes=0")
        if self.sampler_tensor and self.sampler == "shared" and not self.sampler_devices:
            raise ConfigError("mesh.sampler_tensor only applies to a separate sampler layout; "
                              "set mesh.sampler='tensor' (or mesh.sampler_devices) or drop mesh.sampler_tensor")

    def sizes(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """(data, fsdp, tensor) sizes with -1 filled in so that their product times `expert` is `num_devices`."""
        sizes = list(self.sizes())
        known = math.prod(s for s in sizes if s != -1) * self.expert * self.context
        if -1 in sizes:
            if num_devices % known:
                raise ConfigError(
                    f"mesh {self._named(sizes)}: {num_devices} devices are not divisible by "
                    f"{known}; pick axis sizes whose product divides the device count")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) * self.expert * self.context != num_devices:
            raise ConfigError(
                f"mesh {self._named(sizes)} needs {math.prod(sizes) * self.expert * self.context} devices but {num_devices} "
                f"are present; set one axis to -1 or make the product {num_devices}")
        return tuple(sizes)

    def _named(self, sizes) -> dict[str, int]:
        named = dict(zip(AXES, sizes))
        named = named if self.expert == 1 else {**named, "expert": self.expert}
        return named if self.context == 1 else {**named, "context": self.context}

    def axes(self, num_devices: int) -> dict[str, int]:
        """{axis: size} of the mesh over `num_devices`, in mesh order (`expert` only when > 1)."""
        data, fsdp, tensor = self.resolve(num_devices)
        extra = {name: size for name, size in (("expert", self.expert), ("context", self.context)) if size > 1}
        return {"data": data, "fsdp": fsdp, **extra, "tensor": tensor}


def make_mesh(config: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes (data, fsdp, tensor), or (data, fsdp, expert, tensor) when
    `config.expert` > 1, over `devices` (default: all global devices).

    All axes are `AxisType.Auto` (see the module docstring for why). Devices are ordered by
    `jax.make_mesh`, which follows the physical topology on TPU.
    """
    config = config or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    axes = config.axes(len(devices))
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes),
                         devices=devices)


def axis_size(mesh: Mesh, axes: str | Sequence[str] | None) -> int:
    """Number of devices along one mesh axis or a tuple of axes (1 for None or absent axes)."""
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape.get(a, 1) for a in names)


def split_devices(devices: Sequence[jax.Device], sampler: int | float) -> tuple[list[jax.Device], list[jax.Device]]:
    """(trainer devices, sampler devices): the last `sampler` devices (an int count, or a float
    fraction in (0, 1) of them, rounded) go to the sampler, the rest to the trainer.

    Disjoint device groups let sampling and training run at once (ReaLHF, Mei et al., 2024; AReaL,
    Fu et al., 2025). The sampler takes the last devices so that the trainer keeps device 0, where
    host callbacks and the evaluator run.
    """
    devices = list(devices)
    count = round(sampler * len(devices)) if isinstance(sampler, float) else sampler
    if not 1 <= count < len(devices):
        raise ConfigError(f"mesh.sampler_devices={sampler} gives the sampler {count} of {len(devices)} devices; "
                          f"leave at least one to each side (1 to {len(devices) - 1}, or a fraction between)")
    return devices[:-count], devices[-count:]
