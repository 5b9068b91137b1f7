"""A stricter second opinion beside the training reward: reward hacking watched during training.

A policy optimises the verifier it is given, holes included: SmolLM2-135M learned within 20
iterations that restating "39 - 67" scored as the answer -28 (issue 52), and the held-out
evaluation, using the same verifier, reported the hack as skill. An audit scores every rollout
with a different, stricter check and is never weighted into the reward (`[reward] audit`, a
weight-0 part named `AUDIT_PART`):

- `LastNumber`: the last number (ASCII digits, a sign that follows no operand, thousands commas,
  decimals) of the answer span, extracted as the reward extracts it (`methods`), equals the gold
  value exactly: the same span as the reward, judged by a blunter rule, so a disagreement is the
  reward being lenient ("To calculate 39 - 67, ..." ends in 67). A gold that is not a plain value
  (an expression, a set) must equal the span's right-hand side as text, spaces aside.
- `ExactValue`: the answer span's final statement (what follows its last ``=`` or "is", as the
  reward judges it, up to where that sentence ends, quotes and brackets aside) holds exactly one
  number, in ASCII digits, equal to the gold value, with no operation and at most three words
  beside it ("still 7", "8 remains the answer"), and no digit follows it: a plain regex, stricter
  than the value form in how a value may be written (no fractions, percentages, LaTeX or spelled
  numbers). It refuses prose whose last number happens to be the answer ("To calculate 0 * 6, you
  multiply 0 by itself,": three numbers), which `LastNumber` counts. Reading one statement to its
  sentence's end, words allowed, matters on short budgets: a real run's first version of this
  audit wanted a bare number and disputed 8 of the rows the reward called correct in 9
  iterations, every one an answer with words or a cut sentence after it ("(93 + 35) = 128. So it",
  "4 + 3 is still 7.").
- `GymExact`: the reasoning-gym task's own scorer gives full marks (its partial credit for
  containing the answer does not count).

`audit_metrics`: ``reward/audit_agreement`` = #(reward correct and audit correct) / #(reward
correct), the share of rows the training reward calls correct that the audit also does, in
[0, 1], and 1 (vacuously: nothing to disagree with) in an iteration where no row is called
correct; ``reward/audit_rows`` counts the rows it was taken over. A falling agreement is the early
warning; `rljax.evaluation` reports ``eval/accuracy_strict`` beside ``eval/accuracy`` from the
same part.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from fractions import Fraction
from typing import Any, Mapping

from rljax.rewards.answer_form import CACHE_SIZE, judged_part, value_of_gold
from rljax.rewards.extract import METHODS, extract_answer
from rljax.rewards.reasoning import ENTRY_KEY, task_scorer

AUDIT_PART = "audit"
_LAST_NUMBER = re.compile(r"(?:(?<![\w.)\]}])-)?(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", re.ASCII)


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` ("39-67" ends in 67; "x = -28" in -28), or None."""
    found = _LAST_NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


@dataclasses.dataclass(frozen=True)
class _ValueAudit:
    """An audit of the answer span the reward extracts (`methods`) against ``metadata[answer_key]``:
    a gold that is not a plain value must equal the span's final statement as text, spaces aside;
    a plain-value gold goes to `judge(span, value)`."""

    answer_key: str = "answer"
    methods: tuple[str, ...] = METHODS
    time_limit_s: float | None = None

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        gold = str(metadata[self.answer_key]).strip()
        span = extract_answer(completion, self.methods)[0] or ""
        value = value_of_gold(gold)
        if value is None:
            said = "".join(judged_part(span).split())
            return float(bool(said) and said == "".join(gold.split())), {}
        return float(self.judge(span, value)), {}


@dataclasses.dataclass(frozen=True)
class LastNumber(_ValueAudit):
    """Audit: 1.0 when the answer span's last number is exactly the gold value (see module doc)."""

    name: str = "last_number"

    @staticmethod
    def judge(span: str, value: Fraction) -> bool:
        return last_number(span) == value


_NUMBER = re.compile(r"(?<![\w.,])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w])", re.ASCII)
_OPERATION = re.compile(r"[+*/^=<>×÷]|\\|(?<=\d)\s*-\s*(?=\d)")
_WORD = re.compile(r"[^\W\d_]+")
# where a statement ends: a sentence mark or semicolon followed by a space, or a line break
_SENTENCE_END = re.compile(r"[.;!?](?:\s|$)|\n")
_WRAPPING = "\"'`*()[] "
MAX_WORDS = 3


def statement(span: str) -> str:
    """The answer as the audit reads it: the final statement (`judged_part`), up to where its
    sentence ends, without wrapping quotes, brackets or emphasis: "(93 + 35) = 128. So it" states
    "128", 'Using a calculator, "4 + 6 = 10"' states "10", "4 + 3 is still 7." states "still 7"."""
    said = judged_part(span).replace("\u2212", "-")
    return _SENTENCE_END.split(said, maxsplit=1)[0].strip(_WRAPPING).rstrip(".").strip(_WRAPPING)


@dataclasses.dataclass(frozen=True)
class ExactValue(_ValueAudit):
    """Audit: 1.0 when the answer span's final statement (`statement`) holds exactly one number,
    written in ASCII digits and equal to the gold value, with no operation (+ - * / ^ = or LaTeX)
    and at most `MAX_WORDS` words beside it, and no digit follows it in the span (a second number
    after the sentence, as in "12. 13 14", is not one answer).

    A plain regex, independent of the value form's parser (fractions, percentages, LaTeX, spelled
    units), so a hole in one is unlikely to be a hole in the other; stricter in what a value may be
    written as, equal in how many words may stand beside it."""

    name: str = "exact_value"

    @staticmethod
    @functools.lru_cache(maxsize=CACHE_SIZE)  # pure in (span, value): a prompt's rollouts repeat answers
    def judge(span: str, value: Fraction) -> bool:
        said = statement(span)
        rest = judged_part(span).replace("\u2212", "-").split(said, 1)[-1] if said else ""
        numbers = _NUMBER.findall(said)
        return (len(numbers) == 1 and not _OPERATION.search(said) and len(_WORD.findall(said)) <= MAX_WORDS
                and not re.search(r"\d", rest, re.ASCII) and Fraction(numbers[0].replace(",", "")) == value)


@dataclasses.dataclass(frozen=True)
class GymExact:
    """Audit: 1.0 when the reasoning-gym task's scorer gives the extracted answer full marks."""

    methods: tuple[str, ...] = ("answer_tag", "final_line")
    name: str = "reasoning_gym_exact"
    time_limit_s: float | None = None

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        entry = metadata[ENTRY_KEY]
        task = metadata.get("task") or entry["metadata"]["source_dataset"]
        extracted, _ = extract_answer(completion, self.methods)
        return float(extracted is not None and task_scorer(task)(extracted, entry) >= 1.0), {}


AUDITS = {"exact": ExactValue, "last_number": LastNumber, "reasoning_gym": GymExact}


def audit_verifier(kind: str, methods: tuple[str, ...] = METHODS):
    """The audit checker named by `[reward] audit`, extracting the answer with the reward's `methods`."""
    return AUDITS[kind](methods=methods)


def audit_disputed(parts: Mapping[str, Any], rows: int, correct: str = "correct"):
    """bool [rows]: the rows the training reward calls correct and the audit does not (all False
    without an audit part). The rollout's preview shows these first and the loop logs them to
    ``samples.jsonl`` in any iteration that has one, so a falling agreement comes with the replies
    behind it. Traceable."""
    import jax.numpy as jnp

    if AUDIT_PART not in parts or correct not in parts:
        return jnp.zeros((rows,), bool)
    return (parts[correct] >= 1.0) & (parts[AUDIT_PART] < 1.0)


def audit_metrics(parts: Mapping[str, Any], correct: str = "correct") -> dict[str, Any]:
    """``reward/audit_agreement`` and ``reward/audit_rows`` (rows the reward calls correct) from a
    reward's parts; {} without an audit part. Traceable: the parts may be jax arrays."""
    import jax.numpy as jnp

    if AUDIT_PART not in parts or correct not in parts:
        return {}
    called = parts[correct] >= 1.0
    agreed = jnp.sum((called & (parts[AUDIT_PART] >= 1.0)).astype(jnp.float32))
    rows = jnp.sum(called.astype(jnp.float32))
    return {"reward/audit_agreement": jnp.where(rows > 0, agreed / jnp.maximum(rows, 1.0), 1.0),
            "reward/audit_rows": rows}
