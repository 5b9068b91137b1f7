"""The `[warm_start]` section: the optional supervised warm start before RL."""

from __future__ import annotations

import dataclasses

from rljax.config_io import bounded


@dataclasses.dataclass(frozen=True)
class WarmStartSection:
    """Optional supervised warm start on reference answers before RL (steps=0: none).

    `target_accuracy` > 0 stops it early once greedy accuracy on `validation_size` training
    problems (not the held-out split) reaches the target, checked every `check_every` steps.
    `max_seconds` > 0 stops it after that wall time (used by the supervised-only control run).
    `patience` > 0 stops it once, in `patience` checks, that validation accuracy has not risen by
    `min_delta` and the validation NLL has not fallen by `nll_rel_delta` (relative): a task that
    cannot reach the target within the budget stops on the plateau, and one still learning below
    1-digit accuracies does not (`rljax.warmstart.sft.stop_reason`). Validation problems are
    held out of the warm start's SFT set (`rljax.data.splits.warm_start_split`).
    """

    steps: int = bounded(0, ge=0)
    batch_size: int = bounded(64, ge=1)
    learning_rate: float = bounded(1e-3, gt=0)
    warmup_steps: int = bounded(0, ge=0)
    target_accuracy: float = bounded(0.0, ge=0, le=1)
    validation_size: int = bounded(200, ge=1)
    check_every: int = bounded(25, ge=1)
    max_seconds: float = bounded(0.0, ge=0)  # > 0: also stop after this wall time (for equal-time SFT controls)
    patience: int = bounded(0, ge=0)
    min_delta: float = bounded(0.01, ge=0)
    nll_rel_delta: float = bounded(0.01, ge=0)
