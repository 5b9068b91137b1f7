"""Answer extraction from free-form completions.

Four conventions, tried in order by `extract_answer`: an ``<answer>…</answer>`` tag (R1-style
prompts), the last ``\\boxed{…}`` (MATH; braces may nest), a GSM8K ``#### value`` line, and the
last non-empty line. Each returns the answer text or None.
"""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH = re.compile(r"####\s*([^\n]*)")

METHODS = ("answer_tag", "boxed", "hash", "final_line")


def answer_tag(text: str) -> str | None:
    """Contents of the last ``<answer>…</answer>`` pair, stripped."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{…}`` (or ``\\fbox{…}``), matching nested braces."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{" and text[i - 1] != "\\":
                depth += 1
            elif c == "}" and text[i - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None  # no box, or every box is unclosed


def hash_answer(text: str) -> str | None:
    """Text after the last ``####`` on its line (GSM8K), without a trailing period."""
    found = _HASH.findall(text)
    if not found:
        return None
    value = found[-1].strip().rstrip(".").strip()
    return value or None


def final_line(text: str) -> str | None:
    """The last non-empty line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


_EXTRACTORS = {"answer_tag": answer_tag, "boxed": boxed, "hash": hash_answer,
               "final_line": final_line}


def extract_answer(text: str, methods: tuple[str, ...] = METHODS) -> tuple[str | None, str | None]:
    """First hit among ``methods`` (in order): ``(answer, method)``, or ``(None, None)``.

    A box inside an answer tag wins over the tag's other text (``<answer>so \\boxed{3}</answer>``).
    """
    for method in methods:
        found = _EXTRACTORS[method](text)
        if found:
            if method == "answer_tag" and (inner := boxed(found)):
                return inner, method
            return found, method
    return None, None
