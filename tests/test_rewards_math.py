"""rewards.extract and rewards.math_verify: our extraction plus math-verify gives math-verify's verdict."""

import pytest
from math_verify import parse, verify

from rljax.rewards import extract
from rljax.rewards.math import MathAnswer, math_verify

# (answer as the model writes it, gold answer, hand label). 50+ pairs.
PAIRS = [
    (r"\frac{1}{2}", "0.5", True), (r"\dfrac{3}{4}", r"\frac{3}{4}", True),
    ("1/2", r"\frac{1}{2}", True), (r"\frac{2}{4}", r"\frac{1}{2}", True),
    (r"\frac{1}{3}", "0.3333", False), (r"\frac{5}{2}", "2.5", True), (r"2\frac{1}{2}", "2.5", True),
    (r"-\frac{1}{2}", "-0.5", True), (r"\frac{1}{2}", "-0.5", False), ("-7", "-7", True),
    ("-7", "7", False), ("- 3", "-3", True), ("0", "0", True), ("1,234", "1234", True),
    ("1000", "1,000", True), ("3.0", "3", True), ("3.14", r"\pi", False), (r"\pi", r"\pi", True),
    (r"\sqrt{2}", r"\sqrt2", True), (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", True),
    (r"2\sqrt{2}", r"\sqrt{8}", True), (r"\sqrt{3}", r"\sqrt{2}", False),
    ("x^2+2x+1", "(x+1)^2", True), ("x+1", "x-1", False), ("2x", "3x", False),
    (r"\{1,2,3\}", r"\{3,2,1\}", True), (r"\{1,2\}", r"\{1,2,3\}", False),
    ("[1, 2)", "[1,2)", True), ("(1,2]", "[1,2)", False), (r"(-\infty, 3]", r"(-\infty,3]", True),
    (r"(0,\infty)", r"(0, \infty)", True), (r"[0,1] \cup [2,3]", r"[0,1]\cup[2,3]", True),
    (r"50\%", "50", True), (r"50\%", r"50\%", True), (r"25\%", "50", False),
    (r"10 \text{ cm}", "10", True), (r"5\text{ meters}", "5", True),
    (r"12 \text{ dollars}", "13", False), (r"\$5", "5", True), (r"90^\circ", "90", True),
    (r"\frac{\pi}{2}", r"\frac{\pi}{2}", True), (r"\frac{\pi}{3}", r"\frac{\pi}{2}", False),
    ("2^{10}", "1024", True), ("10^{-2}", "0.01", True), ("1000", "10^3", True),
    (r"\left(1, 2\right)", "(1,2)", True), ("(1,2)", "(2,1)", False),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    ("x=3", "3", True), ("y = -2", "-2", True), (r"\infty", r"\infty", True),
    ("i", "i", True), ("3+4i", "3+4i", True), ("7", "8", False),
]

WRAPPERS = {
    "boxed": lambda a: f"Let me think. We get {{so}} \\boxed{{{a}}}.",
    "answer_tag": lambda a: f"<think>work</think><answer>{a}</answer>",
    "hash": lambda a: f"Step 1... step 2.\n#### {a}",
    "final_line": lambda a: f"Some reasoning with 17 and 42.\n${a}$",
}


def reference(span, gold):
    return verify(parse(f"${gold}$", parsing_timeout=None), parse(f"${span}$", parsing_timeout=None),
                  timeout_seconds=None)


def test_table_is_big_enough_and_references_agree_with_labels():
    """The table holds >= 50 pairs and math-verify's own verdict matches each hand label."""
    assert len(PAIRS) >= 50
    bad = [(s, g, e) for s, g, e in PAIRS if reference(s, g) != e]
    assert not bad


@pytest.mark.parametrize("style", sorted(WRAPPERS))
def test_extract_then_check_gives_math_verify_verdict(style):
    """For every pair and every answer convention, math_verify(completion) == math-verify(span, gold)."""
    wrong = []
    for span, gold, _ in PAIRS:
        if style == "hash" and "\n" in span:
            continue
        ours = math_verify(WRAPPERS[style](span), gold)
        if ours != float(reference(span, gold)):
            wrong.append((span, gold, ours))
    assert not wrong


@pytest.mark.parametrize("completion", ["", "   \n  ", "I don't know.", "\\boxed{}",
                                        "<answer></answer>", "####", "\\boxed{\\frac{1}{", "🙂" * 50])
def test_garbage_and_empty_completions_score_zero(completion):
    """Empty, unparseable or truncated completions score 0 and do not raise."""
    assert math_verify(completion, "3") == 0.0


def test_extractors_handle_nesting_and_precedence():
    """boxed() matches nested braces; the last box wins; answer tags win over boxes outside them."""
    assert extract.boxed(r"\boxed{\frac{1}{\sqrt{2}}} and \boxed{x^{2}}") == "x^{2}"
    assert extract.boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert extract.boxed(r"\boxed{unclosed") is None
    assert extract.hash_answer("#### 72.") == "72"
    assert extract.final_line("a\n\n b \n") == "b"
    assert extract.extract_answer(r"\boxed{1} <answer>\boxed{2}</answer>") == ("2", "answer_tag")
    assert extract.extract_answer("") == (None, None)


def test_math_answer_verifier_reports_extraction():
    """MathAnswer scores against metadata['answer'] and reports what it extracted and how."""
    score, info = MathAnswer()({"answer": "0.5"}, r"so \boxed{\frac12}")
    assert score == 1.0 and info == {"extracted": r"\frac12", "method": "boxed"}
