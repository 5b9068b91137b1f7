"""Math answer checking: our extraction, the answer-form guards of `rljax.rewards.answer_form`,
then exact values or equivalence through the `math-verify` library.

math-verify guards each parse and comparison with ``signal.alarm``, which only works on the main
thread. We turn that off (``parsing_timeout=None``, ``timeout_seconds=None``) so it runs anywhere,
and `MathAnswer` enforces the time limit instead: it runs in a `VerifierPool` worker that is killed
past ``time_limit_s``. Calling `math_verify` directly has no time limit.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from decimal import Decimal
from typing import Any, Mapping

from rljax.rewards.answer_form import (box_problem, echoes, foreign_digits, judged_part, oversized, restates,
                                       value_of_gold, values_equal)
from rljax.rewards.base import QUESTION_KEY
from rljax.rewards.extract import METHODS, extract_answer

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once that timeouts are off


def _parse(text: str) -> list:
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def _as_latex(answer: str) -> str:
    """Gold answers and extracted spans are bare LaTeX/expressions; math-verify wants delimiters."""
    delimited = re.search(r"(?<!\\)\$", answer) or "\\boxed" in answer  # an unescaped $
    return answer if delimited else f"${answer}$"


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def plain_numbers_equal(gold: str, pred: str) -> bool | None:
    """math-verify's verdict on two plain decimal numbers, without math-verify; None when either is not one.

    Plain: `-?digits[.digits]` with at most 6 decimals and 15 significant digits. On such
    numbers math-verify's comparison (sympy numbers at 15 digits, floats rounded to 6 decimals) is
    exact equality of the values, so `Decimal(gold) == Decimal(pred)` is its answer ("0.30" = "0.3",
    "007" = "7", "-0" = "0"). The design reason is speed: math-verify takes ~0.7-7 ms a pair, which
    was a third of an RL iteration on a numeric task; this takes microseconds. Anything else (more
    decimals, exponents, fractions, LaTeX) returns None and goes to math-verify.
    """
    numbers = []
    for text in (gold, pred):
        if not _PLAIN_NUMBER.fullmatch(text):
            return None
        whole, _, decimals = text.lstrip("-").partition(".")
        if len(decimals) > 6 or len(whole.lstrip("0")) + len(decimals) > 15:
            return None
        numbers.append(Decimal(text))
    return numbers[0] == numbers[1]


ANSWER_FORMS = ("value", "expression")


def math_verify(completion: str, answer: str, *, methods: tuple[str, ...] = METHODS, question: str = "",
                form: str = "value") -> float:
    """1.0 if the answer extracted from ``completion`` is ``answer``, else 0.0.

    Extraction: `extract_answer` (answer tag, ``\\boxed{}``, ``####``, final line). Then the guards
    of `rljax.rewards.answer_form`, in either ``form``: an equation is judged by its right-hand
    side; a span that restates the ``question``'s operation scores 0; empty, nested or
    disagreeing boxes, non-ASCII digits and oversized spans (timeout bombs) score 0.

    ``form="value"`` (the default): when the gold is a plain value (a number, a fraction, a simple
    LaTeX number, a percentage), the prediction must state one value too, compared exactly; an
    unevaluated expression ("39 - 67", "7 * 8"), several numbers, or a rescaling percent is not an
    answer. A gold that is no plain value (an expression, a set, an interval) goes to math-verify.
    ``form="expression"`` (simplify, factor, solve for x): symbolic equivalence through
    ``math_verify.verify(parse(gold), parse(extracted))``, which handles fractions, LaTeX, sets,
    intervals, percent and units; two plain decimal numbers are compared exactly without it
    (`plain_numbers_equal`, the same verdict). Runs inline with no time limit: use `MathAnswer` in a
    pool to bound it.
    """
    if form not in ANSWER_FORMS:
        raise ValueError(f"form must be one of {ANSWER_FORMS}, got {form!r}")
    extracted, _ = extract_answer(completion, methods)
    if not extracted or not answer.strip() or box_problem(completion) or foreign_digits(extracted):
        return 0.0
    span = judged_part(extracted)
    if not span or oversized(span) or restates(span, question) or echoes(extracted, question):
        return 0.0
    gold_value = value_of_gold(answer.strip()) if form == "value" else None
    if gold_value is not None:
        return 1.0 if values_equal(gold_value, span) else 0.0
    return _equivalent(answer.strip(), span)


def _equivalent(answer: str, span: str) -> float:
    """math-verify's symbolic verdict (two plain decimals exactly, without it)."""
    from math_verify import verify

    plain = plain_numbers_equal(answer, span)
    if plain is not None:
        return 1.0 if plain else 0.0
    gold = _parse(_as_latex(answer))
    pred = _parse(_as_latex(span)) or _parse(span)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


@dataclasses.dataclass(frozen=True)
class MathAnswer:
    """Verifier: `math_verify` of the completion against ``metadata[answer_key]``, in answer ``form``,
    guarded against restating ``metadata["question"]`` (when the row carries it).

    Runs in the pool; a comparison that exceeds ``time_limit_s`` scores 0 with a timeout flag.
    """

    answer_key: str = "answer"
    methods: tuple[str, ...] = METHODS
    time_limit_s: float | None = 5.0
    form: str = "value"
    name: str = "math"

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        extracted, method = extract_answer(completion, self.methods)
        score = math_verify(completion, str(metadata[self.answer_key]), methods=self.methods,
                            question=str(metadata.get(QUESTION_KEY) or ""), form=self.form)
        return score, {"extracted": extracted, "method": method}
