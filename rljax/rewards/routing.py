"""A reward that routes each row to its task's verifier: one run, many tasks, each graded its way.

A mixture (`[[data.sources]]`) can hold reasoning-gym tasks, a math file and a code file at once;
each source names its verifier, and every example carries its task name in its metadata under
`TASK_KEY` (`rljax.data.verifier_metadata` puts it there). `RoutedVerifier` looks that name up
and calls the task's verifier, so the composite reward stays one `Verifier` that the pool,
`compose` and `as_callback` already understand:

    r(x, y) = V_{task(x)}(x, y)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rljax.errors import ConfigError, DataError

TASK_KEY = "mixture_task"  # metadata key naming the example's task (its source's name)


@dataclasses.dataclass(frozen=True)
class RoutedVerifier:
    """Verifier: ``routes[metadata[TASK_KEY]](metadata, completion)``.

    `time_limit_s` is the largest of the routes' limits (None when every route is inline), so a
    slow route runs in the pool with room to finish. A row whose task has no route is a
    `DataError` (an internal mismatch between the data and the reward, never a silent 0).
    """

    routes: Mapping[str, Any]
    name: str = "routed"

    def __post_init__(self):
        if not self.routes:
            raise ConfigError("a routed reward needs at least one task -> verifier route")

    @property
    def time_limit_s(self) -> float | None:
        limits = [v.time_limit_s for v in self.routes.values() if v.time_limit_s is not None]
        return max(limits) if limits else None

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        task = metadata.get(TASK_KEY)
        if task not in self.routes:
            raise DataError(f"no verifier for task {task!r}; routes: {sorted(self.routes)}")
        score, info = self.routes[task](metadata, completion)
        return float(score), {**dict(info), "route": task}
