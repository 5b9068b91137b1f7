"""Math answer checking: our extraction, then equivalence through the `math-verify` library.

math-verify guards each parse and comparison with ``signal.alarm``, which only works on the main
thread. We turn that off (``parsing_timeout=None``, ``timeout_seconds=None``) so it runs anywhere,
and `MathAnswer` enforces the time limit instead: it runs in a `VerifierPool` worker that is killed
past ``time_limit_s``. Calling `math_verify` directly has no time limit.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Mapping

from rljax.rewards.extract import METHODS, extract_answer

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once that timeouts are off


def _parse(text: str) -> list:
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def _as_latex(answer: str) -> str:
    """Gold answers and extracted spans are bare LaTeX/expressions; math-verify wants delimiters."""
    delimited = re.search(r"(?<!\\)\$", answer) or "\\boxed" in answer  # an unescaped $
    return answer if delimited else f"${answer}$"


def math_verify(completion: str, answer: str, *,
                methods: tuple[str, ...] = METHODS) -> float:
    """1.0 if the answer extracted from ``completion`` equals ``answer`` (math-verify), else 0.0.

    Extraction: `extract_answer` (answer tag, ``\\boxed{}``, ``####``, final line). Equivalence:
    ``math_verify.verify(parse(gold), parse(extracted))``, which handles fractions, LaTeX, sets,
    intervals, percent and units. Runs inline with no time limit: use `MathAnswer` in a pool to
    bound it.
    """
    from math_verify import verify

    extracted, _ = extract_answer(completion, methods)
    if not extracted or not answer.strip():
        return 0.0
    gold = _parse(_as_latex(answer.strip()))
    pred = _parse(_as_latex(extracted)) or _parse(extracted)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


@dataclasses.dataclass(frozen=True)
class MathAnswer:
    """Verifier: `math_verify` of the completion against ``metadata[answer_key]``.

    Runs in the pool; a comparison that exceeds ``time_limit_s`` scores 0 with a timeout flag.
    """

    answer_key: str = "answer"
    methods: tuple[str, ...] = METHODS
    time_limit_s: float | None = 5.0
    name: str = "math"

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        extracted, method = extract_answer(completion, self.methods)
        score = math_verify(completion, str(metadata[self.answer_key]), methods=self.methods)
        return score, {"extracted": extracted, "method": method}
