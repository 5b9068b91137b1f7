"""Task sources: reasoning-gym generators, local JSONL/Parquet files and TFDS builders.

Every source returns a `TaskSource`: a tuple of `Example`s plus how many rows were skipped
(malformed rows are counted, never fatal) and, for generated tasks, the generator's own scorer.
A missing file or an unknown task is a `DataError` with one line. `load_task(kind, **kwargs)`
dispatches on the source name so a config can choose it. File paths may be object-store URIs
(``gs://bucket/train.jsonl``): files are read through `rljax.storage`, so every host of a pod
reads the same data without copying it first.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from etils import epath

from rljax.data.example import Example, as_messages
from rljax.errors import ConfigError, DataError
from rljax.storage import as_path

_MAX_REASONS = 5


@dataclasses.dataclass(frozen=True)
class FieldMap:
    """Which column of a row holds each part of an `Example`.

    `prompt` holds the question text or a list of chat messages. `metadata=None` gathers every
    column not mapped elsewhere. `answer_after` keeps only the text after the last occurrence
    of a marker (GSM8K's ``"#### 42"``). `id=None` numbers rows as ``"<stem>:<row>"``.
    """

    prompt: str = "question"
    answer: str = "answer"
    tests: str | None = None
    metadata: str | None = None
    id: str | None = None
    answer_after: str | None = None


@dataclasses.dataclass(frozen=True)
class TaskSource:
    """Examples from one source, with what was skipped and an optional source-specific scorer.

    `scorer(answer_text, example) -> float` grades an extracted answer the way the source
    itself does (reasoning-gym's ``dataset.score_answer``); None when the source has none.
    """

    name: str
    examples: tuple[Example, ...]
    num_skipped: int = 0
    skip_reasons: tuple[str, ...] = ()
    scorer: Callable[[str, Example], float] | None = dataclasses.field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.examples)


def from_reasoning_gym(name: str, size: int, seed: int, **task_kwargs: Any) -> TaskSource:
    """`size` problems from the reasoning-gym generator `name`, seeded by `seed`.

    ``reasoning_gym.create_dataset(name, size=size, seed=seed, **task_kwargs)``; each entry's
    question, answer and metadata become an `Example` with id ``"<name>/<seed>/<index>"``.
    """
    import reasoning_gym  # 3 s import: only when a generator is asked for

    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **task_kwargs)
    except (ValueError, TypeError, KeyError) as err:
        raise DataError(f"reasoning-gym task {name!r} with {task_kwargs}: {err}") from None
    examples = tuple(
        Example(id=f"{name}/{seed}/{i}", question=str(e["question"]), answer=str(e["answer"]),
                metadata=dict(e.get("metadata", {})), entry=e)
        for i, e in enumerate(dataset))

    def scorer(answer: str, example: Example) -> float:
        return float(dataset.score_answer(answer=answer, entry=example.entry))

    return TaskSource(name=f"reasoning_gym:{name}", examples=examples, scorer=scorer)


def reasoning_gym_generator(name: str, seed: int, **task_kwargs: Any) -> Callable[[int], Example]:
    """``index -> Example``: item `index` of the generator `name` seeded by `seed`, made on demand.

    reasoning-gym makes item i from ``Random(seed + i)``, so a generator as large as an int32 costs
    nothing until indexed, and item i is the same in every process and after a restart; ids are
    ``"<name>/<seed>/fresh<index>"``."""
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(name, size=2**31 - 1, seed=seed, **task_kwargs)
    except (ValueError, TypeError, KeyError) as err:
        raise DataError(f"reasoning-gym task {name!r} with {task_kwargs}: {err}") from None

    def generate(index: int) -> Example:
        e = dataset[index]
        return Example(id=f"{name}/{seed}/fresh{index}", question=str(e["question"]), answer=str(e["answer"]),
                       metadata=dict(e.get("metadata", {})), entry=e)

    return generate


def _row_to_example(row: Any, fields: FieldMap, default_id: str) -> Example:
    """One mapped row, or ValueError saying what is wrong with it."""
    if not isinstance(row, Mapping):
        raise ValueError(f"row is a {type(row).__name__}, not an object")
    for need in (fields.prompt, fields.answer):
        if row.get(need) is None:
            raise ValueError(f"missing field {need!r}")
    prompt = row[fields.prompt]
    question, messages = "", None
    if isinstance(prompt, str):
        question = prompt
    else:
        messages = as_messages(prompt, f"field {fields.prompt!r}")
    answer = str(row[fields.answer])
    if fields.answer_after is not None and fields.answer_after in answer:
        answer = answer.rsplit(fields.answer_after, 1)[1].strip()
    if fields.metadata is None:
        used = {fields.prompt, fields.answer, fields.tests, fields.id}
        metadata = {k: v for k, v in row.items() if k not in used}
    else:
        metadata = row.get(fields.metadata) or {}
        if not isinstance(metadata, Mapping):
            raise ValueError(f"field {fields.metadata!r} is not an object")
    row_id = str(row[fields.id]) if fields.id is not None and row.get(fields.id) is not None else default_id
    return Example(id=row_id, question=question, answer=answer, messages=messages,
                   tests=row.get(fields.tests) if fields.tests else None, metadata=dict(metadata))


def _collect(name: str, rows: Iterable[tuple[str, Any]], fields: FieldMap) -> TaskSource:
    """Map rows to examples; rows that fail (or arrive as a ValueError) are skipped and counted."""
    examples, reasons, skipped = [], [], 0
    for row_id, row in rows:
        try:
            if isinstance(row, ValueError):
                raise row
            examples.append(_row_to_example(row, fields, row_id))
        except (ValueError, DataError) as err:
            skipped += 1
            if len(reasons) < _MAX_REASONS:
                reasons.append(f"{row_id}: {err}")
    return TaskSource(name=name, examples=tuple(examples), num_skipped=skipped, skip_reasons=tuple(reasons))


def _existing(path: str | os.PathLike, kind: str) -> epath.Path:
    """`path` as a local or remote file path, or a DataError when no such file exists."""
    file = as_path(path)
    if not file.is_file():
        raise DataError(f"{kind} file {os.fspath(path)!r} does not exist; check the data path")
    return file


def from_jsonl(path: str | os.PathLike, fields: FieldMap = FieldMap()) -> TaskSource:
    """Examples from a JSON-lines file, one object per line; blank lines are ignored.

    A line that is not valid JSON, not an object, or lacks the prompt/answer field is skipped
    and counted in `num_skipped` (with the first few reasons in `skip_reasons`).
    """
    file = _existing(path, "JSONL")

    def rows():
        with file.open("rb") as raw, io.TextIOWrapper(raw, encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    row = ValueError(f"invalid JSON ({err.msg})")
                yield f"{file.stem}:{line_no}", row

    return _collect(f"jsonl:{file}", rows(), fields)


def from_parquet(path: str | os.PathLike, fields: FieldMap = FieldMap()) -> TaskSource:
    """Examples from a Parquet file (read with pyarrow); bad rows are skipped and counted."""
    import pyarrow.parquet as pq

    file = _existing(path, "Parquet")
    try:
        with file.open("rb") as f:
            table = pq.read_table(f)
    except Exception as err:  # pyarrow raises several types for a corrupt file
        raise DataError(f"Parquet file {os.fspath(file)!r} cannot be read: {type(err).__name__}") from None
    rows = ((f"{file.stem}:{i}", row) for i, row in enumerate(table.to_pylist()))
    return _collect(f"parquet:{file}", rows, fields)


def _decode(value: Any) -> Any:
    """TFDS Text features come back as bytes; nested dicts and arrays are decoded too."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, Mapping):
        return {k: _decode(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return _decode(value.tolist())
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def from_tfds(name: str, data_dir: str | os.PathLike | None = None, split: str = "train",
              fields: FieldMap = FieldMap()) -> TaskSource:
    """Examples from a prepared TFDS dataset, read through `tfds.data_source` (no TensorFlow).

    The builder must already be prepared in `data_dir` in the array_record format (a custom
    builder's ``download_and_prepare(file_format="array_record")`` does this offline).
    """
    import tensorflow_datasets as tfds

    try:
        source = tfds.data_source(name, data_dir=os.fspath(data_dir) if data_dir else None, split=split,
                                  try_gcs=False)
    except tfds.core.registered.DatasetNotFoundError:
        raise DataError(f"TFDS dataset {name!r} is not prepared in data_dir={data_dir!r}; "
                        "prepare it with file_format='array_record' or fix the name") from None
    except (ValueError, KeyError, FileNotFoundError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"TFDS dataset {name!r} split {split!r} in {data_dir!r}: {msg}") from None
    rows = ((f"{name}/{split}:{i}", _decode(source[i])) for i in range(len(source)))
    return _collect(f"tfds:{name}/{split}", rows, fields)


SOURCES: dict[str, Callable[..., TaskSource]] = {
    "reasoning_gym": from_reasoning_gym,
    "jsonl": from_jsonl,
    "parquet": from_parquet,
    "tfds": from_tfds,
}


def load_task(kind: str, **kwargs: Any) -> TaskSource:
    """Build a source by name: ``load_task("jsonl", path=..., fields=FieldMap(...))``.

    A `fields` dict is turned into a `FieldMap`; an unknown kind or field is a `ConfigError`.
    """
    if kind not in SOURCES:
        raise ConfigError(f"data source {kind!r} is unknown; choose one of {tuple(SOURCES)}")
    if isinstance(kwargs.get("fields"), Mapping):
        known = {f.name for f in dataclasses.fields(FieldMap)}
        bad = sorted(set(kwargs["fields"]) - known)
        if bad:
            raise ConfigError(f"data field mapping keys {bad} are unknown; choose from {sorted(known)}")
        kwargs["fields"] = FieldMap(**kwargs["fields"])
    try:
        inspect.signature(SOURCES[kind]).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"data source {kind!r}: {err}") from None
    return SOURCES[kind](**kwargs)
