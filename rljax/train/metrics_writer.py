"""Where training metrics go: JSONL always, TensorBoard, wandb when asked, and a PNG of the curves.

Only process 0 writes (multi-host runs call this on every process; the others are no-ops).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rljax.errors import ConfigError


def _plain(v: Any):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class MetricsWriter:
    """Appends one JSON object per step to `metrics.jsonl`; mirrors scalars to TensorBoard/wandb."""

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict | None = None, enabled: bool = True, resume: bool = False):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._tb = self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ConfigError("metrics.wandb_project is set but wandb is not installed; pip install wandb") from None
            self._wandb = wandb.init(project=wandb_project, config=config, resume="allow")

    def truncate_after(self, step: int) -> None:
        """On resume, drops rows past the restored step so the log matches an uninterrupted run."""
        if not self.enabled or not self.path.exists():
            return
        rows = [r for r in self.read() if r.get("step", -1) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if k not in ("step", "time") and v is not None and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def plot_curves(rows: list[dict[str, Any]], path: str | Path,
                keys: tuple[str, ...] = ("reward/mean", "eval/accuracy")) -> Path | None:
    """Plots the named metrics against step into one PNG (one panel per metric present)."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's (e.g. a notebook's) backend alone

    present = [k for k in keys if any(r.get(k) is not None for r in rows)]
    if not present:
        return None
    fig = Figure(figsize=(5 * len(present), 3.5))
    axes = fig.subplots(1, len(present), squeeze=False)
    for ax, key in zip(axes[0], present):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 40 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path
