"""Where training metrics go: JSONL always, TensorBoard, wandb when asked, and a PNG of the curves.

Only process 0 writes (multi-host runs call this on every process; the others are no-ops).

A wandb run's id is kept in the output directory (`wandb_run_id.txt`), so a resumed training run
(`resume=True`) continues the same wandb run instead of starting a new one.

The output directory may be an object-store URI (`gs://bucket/run`). An object cannot be appended
to and tensorboardX writes local files only, so then the files are written in a local staging
directory and each changed file is uploaded whole after every write (`rljax.storage.Mirror`): a
run killed at any point leaves its JSONL rows in the bucket, and re-sending a file that grows by
one row per step is small beside an RL iteration. TensorBoard events arrive as tensorboardX's
writer thread writes them, all of them at `close`. A resumed run first pulls the JSONL files
back and appends to them. A local directory is written in place, as before.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from etils import epath

from rljax.config_io import bounded
from rljax.errors import ConfigError
from rljax.storage import Mirror, as_path, is_remote

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id.txt"
SAMPLES_FILE = "samples.jsonl"


@dataclasses.dataclass(frozen=True)
class MetricsSection:
    """Where metrics go. Every `samples_every` iterations (0: never) a few sampled completions
    with their rewards are logged (samples.jsonl, TensorBoard text, a wandb table)."""

    tensorboard: bool = True
    wandb_project: str | None = None
    progress_bar: bool = True
    samples_every: int = bounded(50, ge=0)



@dataclasses.dataclass(frozen=True)
class SampleRecord:
    """One sampled completion for the sample log.

    reward: the total reward the update saw for this completion.
    reward_parts: the named terms of a composed reward (e.g. {"correct": 1.0, "format": 0.5}),
      empty when the reward is a single verifier.
    example_id: the task example it answers, when known.
    """

    prompt: str
    completion: str
    reward: float
    reward_parts: Mapping[str, float] = dataclasses.field(default_factory=dict)
    example_id: str | None = None


def _plain(v: Any):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _as_record(sample: SampleRecord | Mapping[str, Any]) -> SampleRecord:
    return sample if isinstance(sample, SampleRecord) else SampleRecord(**sample)


def _indented(text: str) -> str:
    """Text as a markdown code block by indentation, which no content can close early."""
    return "\n".join("    " + line for line in (text.splitlines() or [""]))


def samples_markdown(records: Sequence[SampleRecord]) -> str:
    """The sample log of one step as markdown (TensorBoard renders text summaries as markdown)."""
    blocks = []
    for i, r in enumerate(records):
        parts = ", ".join(f"{k} {v:g}" for k, v in r.reward_parts.items())
        head = f"**sample {i}** reward {r.reward:g}" + (f" ({parts})" if parts else "")
        if r.example_id is not None:
            head += f", example {r.example_id}"
        blocks.append(f"{head}\n\nprompt:\n\n{_indented(r.prompt)}\n\ncompletion:\n\n{_indented(r.completion)}")
    return "\n\n---\n\n".join(blocks)


class MetricsWriter:
    """Appends one JSON object per step to `metrics.jsonl`; mirrors scalars to TensorBoard/wandb.

    `write_samples` logs sampled completions with their rewards to `samples.jsonl`, TensorBoard
    text and a wandb table. With `wandb_project`, the wandb run id is stored in
    `out_dir/wandb_run_id.txt`; `resume=True` continues that run.

    `out_dir` is where the files end up (local or a URI); `path` and `samples_path` are the files
    written on this machine: in `out_dir` itself, or the staging copies of a remote `out_dir`. A
    disabled writer (processes other than 0) writes nothing and reads `out_dir`.
    """

    def __init__(self, out_dir: str | Path | epath.Path, *, tensorboard: bool = True,
                 wandb_project: str | None = None, config: dict | None = None, enabled: bool = True,
                 resume: bool = False):
        self.enabled = enabled
        remote = is_remote(out_dir)
        self.out_dir = as_path(out_dir) if remote else Path(out_dir)
        self._mirror = Mirror(self.out_dir) if enabled and remote else None
        self._dir = self._mirror.local if self._mirror is not None else self.out_dir  # where files are written
        self.path = self._dir / METRICS_FILE
        self.samples_path = self._dir / SAMPLES_FILE
        self.wandb_run_id: str | None = None
        self._tb = self._wandb = None
        if not enabled:
            return
        if self._mirror is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume and self._mirror is not None:
            self._mirror.pull(METRICS_FILE, SAMPLES_FILE, WANDB_ID_FILE)
        if not resume:  # a fresh run's logs start empty, here and (when remote) in the bucket
            for name in (METRICS_FILE, SAMPLES_FILE):
                (self._dir / name).unlink(missing_ok=True)
                if self._mirror is not None and (self.out_dir / name).exists():
                    (self.out_dir / name).unlink()
        if tensorboard:
            from tensorboardX import SummaryWriter

            # tensorboardX names its file by the second and host: a suffix keeps a run resumed
            # within the same second from overwriting the earlier file (in a bucket: replacing it).
            self._tb = SummaryWriter(str(self._dir / "tensorboard"), filename_suffix=f".{uuid.uuid4().hex[:8]}")
        if wandb_project:
            self._wandb = self._init_wandb(wandb_project, config, resume)
            self.wandb_run_id = self._wandb.id

    def _init_wandb(self, project: str, config: dict | None, resume: bool):
        try:
            import wandb
        except ImportError:
            raise ConfigError("metrics.wandb_project is set but wandb is not installed; pip install wandb") from None
        id_file = self._dir / WANDB_ID_FILE
        if resume and id_file.is_file():  # continue the run this directory started
            run = wandb.init(project=project, config=config, id=id_file.read_text().strip(), resume="allow")
        else:
            run = wandb.init(project=project, config=config)
        id_file.write_text(run.id + "\n")
        self._sync()
        return run

    def _sync(self) -> None:
        """Uploads what changed to a remote `out_dir` (after flushing what TensorBoard has written)."""
        if self._mirror is None:
            return
        if self._tb is not None:
            self._tb.flush()
        self._mirror.push()

    def truncate_after(self, step: int) -> None:
        """On resume, drops rows past the restored step so the logs match an uninterrupted run."""
        if not self.enabled:
            return
        for path in (self.path, self.samples_path):
            if path.exists():
                rows = [r for r in _read_jsonl(path) if r.get("step", -1) <= step]
                path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self._sync()

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items() if k != "step"})  # the step stays an int
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if k not in ("step", "time") and v is not None and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        self._sync()

    def write_samples(self, step: int, samples: Sequence[SampleRecord | Mapping[str, Any]]) -> None:
        """Logs sampled completions of `step`: one JSON row each in `samples.jsonl`, one markdown
        text summary (tag "samples") in TensorBoard, and a wandb table "samples" when enabled.

        `samples` are `SampleRecord`s, or mappings with the same fields."""
        if not self.enabled or not samples:
            return
        records = [_as_record(s) for s in samples]
        with self.samples_path.open("a") as f:
            for r in records:
                f.write(json.dumps({"step": int(step), "example_id": r.example_id, "prompt": r.prompt,
                                    "completion": r.completion, "reward": float(r.reward),
                                    "reward_parts": {k: float(v) for k, v in r.reward_parts.items()}}) + "\n")
        if self._tb is not None:
            self._tb.add_text("samples", samples_markdown(records), step)
        if self._wandb is not None:
            import wandb

            parts = sorted({k for r in records for k in r.reward_parts})
            columns = ["step", "example_id", "prompt", "completion", "reward", *(f"reward/{k}" for k in parts)]
            data = [[int(step), r.example_id, r.prompt, r.completion, float(r.reward),
                     *(r.reward_parts.get(k) for k in parts)] for r in records]
            self._wandb.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)
        self._sync()

    def read(self) -> list[dict[str, Any]]:
        return _read_jsonl(self.path)

    def read_samples(self) -> list[dict[str, Any]]:
        return _read_jsonl(self.samples_path)

    def close(self) -> None:
        """Closes the writers and copies their last output up; `read` still works afterwards."""
        self._sync()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _read_jsonl(path: Path | epath.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(rows: list[dict[str, Any]], path: str | Path | epath.Path,
                keys: tuple[str, ...] = ("rollout/reward_mean", "eval/accuracy")) -> epath.Path | None:
    """Plots the named metrics against step into one PNG (one panel per metric present) at
    `path`, a local path or a URI (the PNG is rendered in memory and written in one piece)."""
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
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    path = as_path(path)
    path.write_bytes(png.getvalue())
    return path
