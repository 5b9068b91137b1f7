"""The `[checkpoint]` section: every `every` iterations, keeping the `keep_last` latest and the best
by `best_metric` (None: no best)."""

from __future__ import annotations

import dataclasses

from rljax.config_io import bounded


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = bounded(20, ge=1)
    keep_last: int = bounded(2, ge=1)
    best_metric: str | None = "eval/accuracy"
