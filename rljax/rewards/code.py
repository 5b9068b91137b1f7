"""Code-completion verifier: the last fenced Python block, run by `run_code` against the row's tests."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from rljax.rewards.sandbox import SandboxLimits, run_code

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced code block (```python … ```), or the whole completion when there is none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


@dataclasses.dataclass(frozen=True)
class CodeTests:
    """Verifier: fraction of ``metadata[tests_key]`` passed by the completion's code (sandboxed).

    The pool limit is the sandbox's whole-call budget plus a margin for process start-up.
    """

    tests_key: str = "tests"
    limits: SandboxLimits = SandboxLimits()
    name: str = "code"

    @property
    def time_limit_s(self) -> float:
        return self.limits.total_s + 5.0

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        return run_code(extract_code(completion), metadata[self.tests_key], self.limits)
