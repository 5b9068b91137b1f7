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
from rljax.rewards.extract import extract_answer

ENTRY_KEY = "entry"  # metadata key holding the reasoning-gym entry ({"question", "answer", "metadata"})


@functools.lru_cache(maxsize=None)
def _scorer(task: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(task)
    except ValueError as e:
        raise DataError(f"unknown reasoning-gym task {task!r}; see reasoning_gym.factory.DATASETS"
                        ) from e


@dataclasses.dataclass(frozen=True)
class ReasoningGymAnswer:
    """Verifier: the task's ``score_answer(extracted, entry)`` in [0, 1].

    The task is ``metadata["task"]``, else the entry's ``metadata["source_dataset"]``.
    """

    methods: tuple[str, ...] = ("answer_tag", "final_line")
    time_limit_s: float | None = 5.0
    name: str = "reasoning_gym"

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        entry = metadata[ENTRY_KEY]
        task = metadata.get("task") or entry["metadata"]["source_dataset"]
        extracted, method = extract_answer(completion, self.methods)
        score = float(_scorer(task)(extracted, entry)) if extracted is not None else 0.0
        return score, {"task": task, "extracted": extracted, "method": method}
