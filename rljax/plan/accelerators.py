"""The accelerators a plan is checked against: per-device memory and the named slices.

Capacities are the vendors' published per-device memory, read as GiB (`rljax plan` compares
the plan's per-device peak with them): TPU v5e 16 GiB, v5p 95 GiB, v6e 32 GiB per chip, NVIDIA
H100 80 GiB and H200 141 GiB per GPU. One JAX device is one chip on TPU (v5p's two TensorCores
form one megacore device) and one GPU on NVIDIA.

What a program can use is less: on GPU, JAX preallocates 75% of the memory unless
`XLA_PYTHON_CLIENT_MEM_FRACTION` says otherwise, and every runtime keeps some for itself. A
live run reports its real limit (`memory_stats()["bytes_limit"]`), which `rljax train` checks
instead when the recipe names no accelerator.

Slice names follow each vendor: a TPU v5e or v6e slice counts chips (`v5e-8`: 8 chips), a v5p
slice counts TensorCores, two per chip (`v5p-16`: 2x2x2, 8 chips on 2 hosts); `8xh100` is one
8-GPU host.
"""

from __future__ import annotations

import dataclasses

from rljax.errors import ConfigError

GIB = 1 << 30


def format_gib(n: int) -> str:
    """Bytes as GiB with three significant digits (`21.3 GiB`, `0.000531 GiB`)."""
    return f"{n / GIB:.3g} GiB"


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


@dataclasses.dataclass(frozen=True)
class Slice:
    """A named group of devices: `devices` JAX devices of one accelerator."""

    name: str
    accelerator: Accelerator
    devices: int


ACCELERATORS = {a.name: a for a in (
    Accelerator("v5e", 16.0), Accelerator("v5p", 95.0), Accelerator("v6e", 32.0),
    Accelerator("h100", 80.0), Accelerator("h200", 141.0))}

SLICES = {s.name: s for s in (
    Slice("v5e-8", ACCELERATORS["v5e"], 8),
    Slice("v5p-16", ACCELERATORS["v5p"], 8),  # 16 TensorCores = 8 chips (2 per chip)
    Slice("v6e-8", ACCELERATORS["v6e"], 8),
    Slice("8xh100", ACCELERATORS["h100"], 8),
    Slice("8xh200", ACCELERATORS["h200"], 8))}


def find(name: str) -> Accelerator | Slice:
    """An accelerator (`v5e`, `h100`) or a slice (`v5e-8`, `v5p-16`, `8xh100`) by name, any case."""
    key = name.strip().lower()
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    if key in SLICES:
        return SLICES[key]
    raise ConfigError(f"unknown accelerator {name!r}; choose one of {', '.join([*ACCELERATORS, *SLICES])}")


def accelerator(name: str) -> Accelerator:
    """The accelerator that `name` (an accelerator or a slice) names."""
    found = find(name)
    return found.accelerator if isinstance(found, Slice) else found


def device_memory(accelerator_name: str | None = None, memory_gib: float = 0.0) -> tuple[int, str] | None:
    """(bytes per device, a name for messages) to check a plan against: `memory_gib` when > 0,
    else the named accelerator's, else what this process's first device reports (`bytes_limit`, on GPU and
    TPU); None when none is known (CPU)."""
    if memory_gib > 0:
        return int(memory_gib * GIB), f"the configured device ({memory_gib:g} GiB)"
    if accelerator_name:
        acc = accelerator(accelerator_name)
        return acc.memory_bytes, acc.name
    import jax

    device = jax.local_devices()[0]  # in a multi-process run, jax.devices()[0] may be another process's
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return (int(limit), device.device_kind) if limit else None
