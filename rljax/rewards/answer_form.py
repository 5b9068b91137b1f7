"""What counts as a final answer: one value, written out, that does not restate the question.

math-verify answers "are these two expressions equal?"; it never asks whether the prediction is an
answer at all. A policy finds that gap within tens of iterations: on a subtraction task
SmolLM2-135M learned to reply "To calculate 39 - 67, we need to subtract the two", which
math-verify parses as the expression 39 - 67 and finds equal to the gold -28 (issue 52). These
checks run before any equivalence is asked:

- `judged_part`: an equation is judged by its right-hand side only ("39 - 67 = -28" by "-28"), and
  so is a statement ("the difference of 39 and 67 is -28").
- `parse_value`: the one value a span holds: a sign, ASCII digits (thousands commas, decimals), a
  fraction ``a/b`` or ``\\frac{a}{b}``, an optional ``%`` (never a rescaling: ``25%`` equals 25, not
  0.25, so a policy cannot hedge between the two) and at most `MAX_WORDS` unit words around it
  ("a concept that has nothing to do with the number 0" is prose, not the answer 0), compared
  exactly as a `Fraction`. It returns None when the span holds no value, several ("5 or 6", "1 2 3 ... 200"),
  or an unevaluated operation ("39 - 67", "7 \\times 8", "2^{10}"; "10/2" when the gold is a whole
  number). Digits outside ASCII ("５６", "٥٦", "𝟓𝟔") are not digits of an answer.
- `restates`, `echoes`: the prediction repeats an operation (operands joined by an operator) or is
  a worded phrase that the question itself contains: zero in every answer form, since "Simplify
  (x+1)^2 - 1" answered "(x+1)^2 - 1" is symbolically equal to any correct answer.
- `oversized`: a span longer than `MAX_ANSWER_CHARS` or nested deeper than `MAX_NESTING` is never
  handed to sympy (a deeply nested expression is a timeout bomb; inline verifiers have no limit).
- `box_problem`: an empty or nested ``\\boxed{}``, or boxes holding different answers.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from fractions import Fraction

MAX_ANSWER_CHARS = 500
MAX_NESTING = 12
MAX_DIGITS = 64  # longer numbers are not answers a verifier should spend time on
MAX_WORDS = 3  # words beside a value ("42 apples", "about 42 km"); more is prose that mentions a number

_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_TEX_FRACTION = re.compile(r"\\[dt]?frac\s*\{\s*([-+]?)\s*(" + _NUMBER + r")\s*\}\s*\{\s*(" + _NUMBER + r")\s*\}",
                           re.ASCII)
_SLASH_FRACTION = re.compile(r"(?<![\w.)\]}])(" + _NUMBER + r")\s*/\s*(" + _NUMBER + r")(?![\w.(\[{])", re.ASCII)
_NUMBER_RE = re.compile(r"(?<![\w.])(" + _NUMBER + r")(?![\d])", re.ASCII)
_OPERATOR = re.compile(r"[-+*/^=<>×÷·]|\\(?:times|cdot|div|pm|mp|sqrt|frac|dfrac|tfrac|le|ge|neq)\b")
_LATEX_NOISE = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|~")
_TEXT_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|mbox|operatorname)\s*\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_MARK = "\ue000"  # stands for a parsed number (a private-use character: no text holds it)
_LEAD_SIGN = re.compile(r"(?:^|(?<=[\s(:,]))([-+])\s*(?=" + _MARK + ")")
# The parses below are pure functions of their strings, memoised: a run scores every rollout of a
# prompt against the same gold and question (n samples, and again each epoch over the data), and
# short answers repeat ("17"), so regex work per row would otherwise be most of the verifier's host
# time. `fn.__wrapped__` is the plain function, the reference the cache is tested against.
CACHE_SIZE = 1 << 12  # entries per memoised parse: a few iterations' distinct strings


def foreign_digits(text: str) -> bool:
    """Whether ``text`` holds a decimal digit outside ASCII (fullwidth, Arabic-Indic, mathematical
    bold...): a look-alike that a lenient parser reads as the number it resembles."""
    return any(not ch.isascii() and unicodedata.category(ch) == "Nd" for ch in text)


def oversized(text: str) -> bool:
    """Longer than `MAX_ANSWER_CHARS`, or brackets nested deeper than `MAX_NESTING`."""
    if len(text) > MAX_ANSWER_CHARS:
        return True
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    return deepest > MAX_NESTING


_STATES = re.compile(r"=|≈|\\approx|\b(?:is|equals|gives|yields|makes)\b", re.IGNORECASE)


def judged_part(span: str) -> str:
    """What follows the last ``=`` (``≈``, ``\\approx``, or a stating verb: "is", "equals", "gives",
    "yields", "makes"), or the span itself: "39 - 67 = -28" and "39 - 67 is -28" are judged by
    "-28", and "What is 39 - 67" by "39 - 67", which restates the question."""
    return _STATES.split(span)[-1].strip()


def _clean(text: str) -> str:
    text = text.replace("\u2212", "-").replace("\u2013", "-").replace("\\%", "%").replace("\\$", " ")
    text = _LATEX_NOISE.sub(" ", text)
    text = _TEXT_WRAPPER.sub(r" \1 ", text)
    text = _DEGREES.sub(" ", text)
    text = re.sub(r"\\[\[\]()]", " ", text).replace("$", " ")
    text = re.sub(r"\\([dt]?frac)\s*(\d)\s*(\d)", r"\\\1{\2}{\3}", text)  # \frac12 is \frac{1}{2}
    return text.strip().rstrip(".").strip()


def _number(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


@functools.lru_cache(maxsize=CACHE_SIZE)
def parse_value(span: str, *, allow_fraction: bool = True) -> Fraction | None:
    """The one value ``span`` states, as an exact `Fraction`, or None (see the module docstring).

    ``allow_fraction=False`` refuses ``a/b`` and ``\\frac{a}{b}`` (for a whole-number gold, "10/2"
    is an unevaluated division, not an answer)."""
    if not span or foreign_digits(span) or oversized(span):
        return None
    text = _clean(span)
    atoms: list[Fraction] = []

    def keep(value: Fraction) -> str:
        atoms.append(value)
        return f" {_MARK} "  # no digit in it: the number pass below must not read it

    def fraction(sign: str, num: str, den: str) -> str:
        if not allow_fraction or _number(den) == 0:
            return " / "  # an unevaluated division: the operator check below refuses the span
        value = _number(num) / _number(den)
        return keep(-value if sign == "-" else value)

    text = _TEX_FRACTION.sub(lambda m: fraction(*m.groups()), text)
    text = _SLASH_FRACTION.sub(lambda m: fraction("", *m.groups()), text)
    if any(len(d) > MAX_DIGITS for d in re.findall(r"\d+", text)):
        return None
    text = _NUMBER_RE.sub(lambda m: keep(_number(m.group(1))), text)
    if len(atoms) != 1:
        return None
    negative = False
    sign = _LEAD_SIGN.search(text)
    if sign:
        negative = sign.group(1) == "-"
        text = text[:sign.start(1)] + text[sign.end(1):]
    rest = text.replace(_MARK, " ").replace("%", " ")
    if _OPERATOR.search(rest) or re.search(r"\d", rest) or len(re.findall(r"[^\W\d_]+", rest)) > MAX_WORDS:
        return None
    return -atoms[0] if negative else atoms[0]


@functools.lru_cache(maxsize=CACHE_SIZE)
def value_of_gold(answer: str) -> Fraction | None:
    """The gold answer as a value (fractions allowed), or None when it is an expression, a set, an
    interval... and so is judged by symbolic equivalence."""
    return parse_value(judged_part(answer))


def values_equal(gold: Fraction, span: str) -> bool:
    """Whether ``span`` states exactly the value ``gold`` (a fraction only for a fractional gold)."""
    value = parse_value(judged_part(span), allow_fraction=gold.denominator != 1)
    return value is not None and value == gold


_SQUASH_OPS = (("×", "*"), ("\\times", "*"), ("·", "*"), ("\\cdot", "*"), ("÷", "/"), ("\\div", "/"),
               ("**", "^"), ("{", "("), ("}", ")"), ("[", "("), ("]", ")"))
_OPERAND = r"(?:\d+(?:\.\d+)?[a-z]?|[a-z]|\([^()]*\))"
_OPERATION = re.compile(rf"(?<![a-z0-9.]){_OPERAND}(?:[-+*/^]{_OPERAND})+")


@functools.lru_cache(maxsize=CACHE_SIZE)
def _squash(text: str) -> str:
    """Lower case, one spelling per operator, no space around operators, single spaces elsewhere."""
    text = _clean(unicodedata.normalize("NFKC", text).casefold())
    for old, new in _SQUASH_OPS:
        text = text.replace(old, new)
    text = re.sub(r"\s*([-+*/^=(),])\s*", r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def restates(span: str, question: str) -> bool:
    """Whether the judged ``span`` repeats an operation of the question: two or more operands joined
    by operators that the question contains ("39 - 67", "(x+1)^2 - 1"). A bare value never counts:
    the question may well hold the answer's digits."""
    if not question:
        return False
    asked = _squash(question)
    return any(op.group(0) in asked for op in _OPERATION.finditer(_squash(span)))


def echoes(text: str, question: str) -> bool:
    """Whether the whole answer ``text`` is a worded phrase of 8+ characters copied from the
    question (echoing "the answer is 12" from a prompt that says so)."""
    said = _squash(text)
    return bool(question) and len(said) >= 8 and re.search(r"[a-z]{2}", said) is not None and said in _squash(question)


def top_level_boxes(text: str) -> list[str]:
    """The contents of every outermost ``\\boxed{...}`` / ``\\fbox{...}`` (an unclosed one is left out)."""
    out, i = [], 0
    starts = re.compile(r"\\(?:boxed|fbox)\s*\{")
    while (m := starts.search(text, i)) is not None:
        depth, j = 1, m.end()
        while j < len(text) and depth:
            if text[j] == "{" and text[j - 1] != "\\":
                depth += 1
            elif text[j] == "}" and text[j - 1] != "\\":
                depth -= 1
            j += 1
        if depth:
            break
        out.append(text[m.end():j - 1].strip())
        i = j
    return out


def box_problem(text: str) -> str | None:
    """Why the completion's boxes are not one answer: "empty", "nested", "several" (different
    contents), or None."""
    boxes = top_level_boxes(text)
    if any(not b for b in boxes):
        return "empty"
    if any(re.search(r"\\(?:boxed|fbox)\s*\{", b) for b in boxes):
        return "nested"
    if len(set(boxes)) > 1:
        return "several"
    return None
