"""reasoning-gym as a verifier family, chosen by task name.

The problems themselves come from `rljax.data.sources.from_reasoning_gym`;
`ReasoningGymAnswer` scores a completion with the task's own ``score_answer`` after extracting the
answer (an ``<answer>`` tag, else the final line). The task is read from each row's metadata, so
one verifier serves a mixture of tasks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

from rljax.errors import DataError
from rljax.rewards.answer_form import (CACHE_SIZE, echoes, foreign_digits, judged_part, oversized, parse_value,
                                       restates, value_of_gold)
from rljax.rewards.base import QUESTION_KEY
from rljax.rewards.extract import extract_answer

ENTRY_KEY = "entry"  # metadata key holding the reasoning-gym entry ({"question", "answer", "metadata"})


@functools.lru_cache(maxsize=None)
def task_scorer(task: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(task)
    except ValueError as e:
        raise DataError(f"unknown reasoning-gym task {task!r}; see reasoning_gym.factory.DATASETS"
                        ) from e


@dataclasses.dataclass(frozen=True)
class ReasoningGymAnswer:
    """Verifier: the task's ``score_answer(extracted, entry)`` in [0, 1], behind `is_answer`'s guards.

    The task is ``metadata["task"]``, else the entry's ``metadata["source_dataset"]``.
    """

    methods: tuple[str, ...] = ("answer_tag", "final_line")
    time_limit_s: float | None = 5.0
    name: str = "reasoning_gym"

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        entry = metadata[ENTRY_KEY]
        task = metadata.get("task") or entry["metadata"]["source_dataset"]
        extracted, method = extract_answer(completion, self.methods)
        question = str(metadata.get(QUESTION_KEY) or entry.get("question") or "")
        ok = extracted is not None and is_answer(extracted, str(entry["answer"]), question)
        score = float(task_scorer(task)(extracted, entry)) if ok else 0.0
        return score, {"task": task, "extracted": extracted, "method": method}


@functools.lru_cache(maxsize=CACHE_SIZE)  # pure in its strings; a prompt's n rollouts often give one answer
def is_answer(extracted: str, gold: str, question: str) -> bool:
    """The guards of `rljax.rewards.answer_form` before a task's own scorer: no non-ASCII digits, no
    oversized span, no restated question, and, when the gold is a plain value, one value stated.
    Many tasks' scorers give partial credit ``len(gold) / len(answer)`` to any reply that contains
    the gold, so without this "1 2 3 ... 200" or "5 or 6" earns reward."""
    if foreign_digits(extracted) or oversized(extracted) or restates(judged_part(extracted), question) \
            or echoes(extracted, question):
        return False
    return value_of_gold(gold) is None or parse_value(judged_part(extracted)) is not None
