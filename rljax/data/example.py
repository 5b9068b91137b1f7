"""One task record, and the question normalisation that keeps held-out splits honest.

An `Example` is what every task source yields: the question text (or chat messages), the
reference answer, optional unit tests, a metadata dict and an id that does not change between
runs. Verifiers read `answer`/`tests`; reasoning-gym tasks also keep their raw `entry` so the
generator's own `score_answer(answer, entry)` can grade a completion. `verifier_metadata` is the
contract between the two: the one dict a verifier reads for an example.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from rljax.errors import DataError
from rljax.rewards.base import QUESTION_KEY
from rljax.rewards.reasoning import ENTRY_KEY
from rljax.rewards.routing import TASK_KEY


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt of a task.

    Attributes:
      id: stable identifier, unique within its source (e.g. ``"chain_sum/0/17"``, ``"gsm8k:12"``).
      question: the problem text; prompt templates format it as ``{question}``.
      answer: the reference answer, as text.
      messages: chat messages ``({"role": ..., "content": ...}, ...)`` when the source gives a
        conversation instead of a bare question; chat templates then use them as they are.
      tests: unit tests for code tasks, in whatever form the code verifier takes.
      metadata: free-form JSON-like facts about the example (difficulty, source, ...).
      entry: the raw source record (the reasoning-gym entry), kept for ``score_answer``.
      task: the task (mixture source) it came from; None for a single-source run. The reward
        routes on it (`rljax.rewards.RoutedVerifier`) and metrics are split by it.
    """

    id: str
    question: str
    answer: str
    messages: tuple[Mapping[str, str], ...] | None = None
    tests: Any = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    entry: Any = dataclasses.field(default=None, compare=False, repr=False)
    task: str | None = None


def verifier_metadata(example: Example) -> dict[str, Any]:
    """What verifiers read: the answer, tests, the raw task entry, the question (the text of every
    message for a chat example: verifiers refuse a reply that restates it) and the example's metadata."""
    question = example.question or "\n".join(str(m.get("content", "")) for m in example.messages or ())
    meta = {**example.metadata, "answer": example.answer, "tests": example.tests, ENTRY_KEY: example.entry,
            "id": example.id, QUESTION_KEY: question}
    if example.task is not None:
        meta[TASK_KEY] = example.task
    return meta


_SPACE = re.compile(r"\s+")


def normalize_question(text: str) -> str:
    """The key on which questions are compared: NFKC, case-folded, whitespace collapsed.

    Two questions that differ only in case, spacing or Unicode form are the same question, so
    a held-out split built on this key cannot leak a re-spaced copy of an eval problem.
    """
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def question_key(example: Example) -> str:
    """Normalised question text of an example; chat examples use the text of every message."""
    if example.messages is not None and not example.question:
        return normalize_question("\n".join(str(m.get("content", "")) for m in example.messages))
    return normalize_question(example.question)


def as_messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    """Validate a chat conversation: a list of ``{"role", "content"}`` dicts."""
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(
            isinstance(m, Mapping) and "role" in m and "content" in m for m in value):
        raise DataError(f"{where}: chat messages must be a list of {{'role', 'content'}} dicts")
    return tuple({"role": str(m["role"]), "content": str(m["content"])} for m in value)
