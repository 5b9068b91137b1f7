"""The `[plan]` section: the memory check `rljax train` runs before it allocates anything."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rljax.config_io import bounded


@dataclasses.dataclass(frozen=True)
class PlanSection:
    """The memory check `rljax train` runs before it allocates anything (`rljax.plan`): the
    plan's per-device peak against the device memory, which is `device_memory_gib` when > 0,
    else the named `accelerator`'s (v5e 16, v5p 95, v6e 32, h100 80, h200 141 GiB), else what
    the devices report (`memory_stats()["bytes_limit"]` on GPU and TPU; CPU reports none, so
    there is no check). A plan that does not fit stops the run with one line naming the setting
    to change. `check = false` skips it (the plan compiles the run's programs once more)."""

    accelerator: Literal["v5e", "v5p", "v6e", "h100", "h200"] | None = None
    device_memory_gib: float = bounded(0.0, ge=0)
    check: bool = True
