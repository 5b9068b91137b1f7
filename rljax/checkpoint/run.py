"""A training run's directory as `rljax eval`, `export` and `sample` read it: which checkpoint
"best", "latest" or a step number names, and the run config saved with it.

"best" is ranked by the run's own metric (`checkpoint.best_metric`, written into every step's
meta by `Checkpointer.save`), so the reader needs no flag to agree with the run on what "best"
meant; a run that tracked no metric falls back to its latest step, and says so.
"""

from __future__ import annotations

import dataclasses
import os

from rljax.checkpoint.manager import Checkpointer
from rljax.errors import CheckpointError, ConfigError
from rljax.storage import as_path


@dataclasses.dataclass(frozen=True)
class RunStep:
    """One checkpoint of a run: its step, why it was picked ("best", "latest", or "given" as a
    number), its tracked metric's value and the run's config as saved (a dict; None for a
    checkpoint saved outside `rljax train`)."""

    checkpoints: str
    step: int
    picked: str
    metric: str | None
    value: float | None
    config: dict | None

    def describe(self) -> str:
        """`step 300 (best eval/accuracy = 0.6000)`: the line the CLI prints before it acts."""
        if self.metric is None:
            why = "latest; the run tracked no metric to rank by" if self.picked == "best" else self.picked
            return f"step {self.step} ({why})"
        value = "not recorded" if self.value is None else f"{self.value:.4f}"
        why = "" if self.picked == "given" else f"{self.picked} "
        return f"step {self.step} ({why}{self.metric} = {value})"


def is_run_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a training run's output directory (it holds `checkpoints/`)."""
    return (as_path(path) / "checkpoints").is_dir()


def open_run(run_dir: str | os.PathLike, step: str = "best") -> RunStep:
    """The checkpoint of `run_dir` that `step` ('best', 'latest' or a number) names. `run_dir` may
    be a URI (gs://bucket/run): a pod's run is read from its bucket."""
    if step not in ("best", "latest") and not str(step).isdigit():
        raise ConfigError(f"--step {step!r}: pass 'best', 'latest' or a step number")
    ckpt_dir = as_path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{run_dir} has no checkpoints/ directory; pass a run directory made by rljax train")
    with Checkpointer(ckpt_dir, read_only=True) as ckpt:
        restored = ckpt.restore(step if step in ("best", "latest") else int(step), params=None)
        tracked = ckpt.tracked_metric()
        value = ckpt.metric(restored.step)
    picked = step if step in ("best", "latest") else "given"
    return RunStep(checkpoints=str(ckpt_dir), step=restored.step, picked=picked,
                   metric=tracked[0] if tracked else None, value=value, config=restored.config)


def tokenizer_spec(config: dict | None) -> str | None:
    """What the run loaded its tokenizer from (`model.tokenizer`, else `model.checkpoint`), as
    `rljax.tokenizers.load` takes it; None when the config does not say."""
    model = (config or {}).get("model", {})
    return model.get("tokenizer") or model.get("checkpoint")
