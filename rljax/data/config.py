"""The `[data]` section: the task's source(s), its held-out split and how an example becomes a prompt."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from rljax.config_io import bounded
from rljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SourceSection:
    """One task source: an entry of `[[data.sources]]`, or a single-source run's keys
    (`DataSection.single`: a single source is a mixture of one).

    kind: `reasoning_gym` (task + task_kwargs at difficulty `level`), `jsonl` or `parquet` (path +
    fields), or (single source only) `tfds` (tfds_name + tfds_data_dir + tfds_split). `eval_path`
    (single source only) reads the held-out split from a JSONL file instead of splitting. `weight` weighs it for `uniform` and `band`; `verifier` grades it (default: the
    `[reward]` kind); `name` labels its metrics and routes its reward (default: the task, with
    `@L{level}` when the level is not 0, or the file's stem). `size` training problems and
    `eval_size` held-out ones; `prompt_template` defaults to `data.prompt_template`.

    `fresh = true` (reasoning-gym only) draws never-seen questions from the generator instead of
    a fixed pool: with a pool of repeats a small policy memorises training questions (training
    reward rises while held-out accuracy stays flat, issue 24); fresh questions cannot be
    memorised. The pool of `size` problems is still made, for the warm start. `fresh_draws`:
    `distinct` (never a pool question, never one twice) or `iid` (the generator's own
    distribution, the held-out split's, skipping only held-out questions); see
    `rljax.data.mixture.FreshStream`.
    """

    kind: Literal["reasoning_gym", "jsonl", "parquet", "tfds", "visual"] = "reasoning_gym"
    name: str | None = None
    task: str = "chain_sum"
    task_kwargs: dict = dataclasses.field(default_factory=dict)
    level: int = bounded(0, ge=0)
    weight: float = bounded(1.0, ge=0)
    verifier: Literal["reasoning_gym", "math", "code"] | None = None
    path: str | None = None
    fields: dict = dataclasses.field(default_factory=dict)
    size: int = bounded(2000, ge=1)
    eval_size: int = bounded(100, ge=0)
    fresh: bool = False
    fresh_draws: Literal["distinct", "iid"] = "distinct"
    prompt_template: str | None = None
    tfds_name: str | None = None
    tfds_data_dir: str | None = None
    tfds_split: str = "train"
    eval_path: str | None = None

    def __post_init__(self):
        if self.kind in ("jsonl", "parquet") and self.path is None:
            raise ConfigError(f"data.sources: a {self.kind} source needs path = '...'")
        if self.fresh and self.kind != "reasoning_gym":
            raise ConfigError(f"data.sources: fresh = true needs a reasoning_gym source, not {self.kind}; "
                              "set fresh = false")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.kind == "reasoning_gym":
            return self.task if self.level == 0 else f"{self.task}@L{self.level}"
        return Path(self.path).stem


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The task: a source, its held-out split and how an example becomes a prompt.

    source: `reasoning_gym` (task + task_kwargs), `jsonl` / `parquet` (path + fields), `tfds`
    (tfds_name + tfds_data_dir), or `visual` (a generated picture task, `rljax.data.visual_tasks`:
    task count / tallest / clock, task_kwargs image_size; a vision-language policy only). `eval_size` problems are held out by question text; training never
    sees them. `prompt_template` is a format string over {question} and metadata keys.

    A mixture lists its tasks as `[[data.sources]]` (`SourceSection`); then the single-source
    keys above other than the seed, prompt and token settings are unused. `selection` names the
    policy that picks each prompt's task (`rljax.data.selection`: uniform, band, bandit,
    schedule, auto_curriculum) with `selection_options` as its settings (levels and weights
    default to the sources'); `band_max_redraws` bounds how often `band` replaces a rejected
    prompt. A single-source run with a non-uniform selection is a mixture of one.
    """

    source: Literal["reasoning_gym", "jsonl", "parquet", "tfds", "visual"] = "reasoning_gym"
    task: str = "chain_sum"
    task_kwargs: dict = dataclasses.field(default_factory=dict)
    path: str | None = None
    fields: dict = dataclasses.field(default_factory=dict)
    tfds_name: str | None = None
    tfds_data_dir: str | None = None
    tfds_split: str = "train"
    size: int = bounded(20000, ge=1)
    eval_size: int = bounded(400, ge=0)
    eval_path: str | None = None
    seed: int = bounded(1, ge=0)
    prompt_template: str = "{question}"
    chat: bool = False
    system_prompt: str | None = None
    add_bos: bool = True
    max_prompt_tokens: int = bounded(64, ge=1)
    prompt_buckets: tuple[int, ...] = bounded((), ge=1)
    sources: tuple[SourceSection, ...] = ()
    selection: str = "uniform"
    selection_options: dict = dataclasses.field(default_factory=dict)
    band_max_redraws: int = bounded(4, ge=0)

    def __post_init__(self):
        from rljax.data.selection import POLICIES

        POLICIES.get(self.selection)  # an unknown name: one line listing the registered ones
        for s in self.sources:
            if s.kind in ("tfds", "visual") or s.eval_path:
                raise ConfigError("data.sources: a tfds source and eval_path are single-source settings; list "
                                  "reasoning_gym, jsonl or parquet sources, each split by its own eval_size")
        labels = [s.label for s in self.sources]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"data.sources names {labels} repeat; give each source a distinct name = '...'")

    @property
    def single(self) -> SourceSection:
        """The single-source keys as the one `SourceSection` they describe."""
        return SourceSection(kind=self.source, task=self.task, task_kwargs=self.task_kwargs, path=self.path,
                             fields=self.fields, size=self.size, eval_size=self.eval_size,
                             prompt_template=self.prompt_template, tfds_name=self.tfds_name,
                             tfds_data_dir=self.tfds_data_dir, tfds_split=self.tfds_split, eval_path=self.eval_path)

    @property
    def is_mixture(self) -> bool:
        return bool(self.sources) or self.selection != "uniform" or bool(self.selection_options)
