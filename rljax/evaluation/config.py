"""The `[eval]` section: how often and on how many held-out problems the run is evaluated.

`every` iterations, greedy accuracy on `size` held-out problems; `rljax eval` adds sampled
pass@k over `pass_k` with `num_samples` samples at `temperature`, over `seeds` seeds."""

from __future__ import annotations

import dataclasses

from rljax.config_io import bounded


@dataclasses.dataclass(frozen=True)
class EvalSection:
    every: int = bounded(10, ge=1)
    size: int = bounded(400, ge=1)
    pass_k: tuple[int, ...] = bounded((1, 4), ge=1)
    num_samples: int = bounded(4, ge=1)
    seeds: int = bounded(3, ge=1)
    temperature: float = bounded(1.0, ge=0)
