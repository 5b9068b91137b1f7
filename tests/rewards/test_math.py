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


# Unevaluated operations on a plain-value gold: math-verify computes them, the value form refuses them.
VALUE_FORM_REFUSES = {(r"2\frac{1}{2}", "2.5"), ("2^{10}", "1024"), ("10^{-2}", "0.01")}


@pytest.mark.parametrize("form", ["expression", "value"])
@pytest.mark.parametrize("style", sorted(WRAPPERS))
def test_extract_then_check_gives_math_verify_verdict(style, form):
    """For every pair and every answer convention, math_verify(completion) == math-verify(span, gold),
    in the expression form exactly, and in the value form except the unevaluated operations on a
    plain-value gold, which score 0. Fails if the value form compared numbers as strings ("3.0" vs
    "3", "1,234"), dropped the sign, or let "2^{10}" through as 1024."""
    wrong = []
    for span, gold, _ in PAIRS:
        if style == "hash" and "\n" in span:
            continue
        ours = math_verify(WRAPPERS[style](span), gold, form=form)
        want = 0.0 if form == "value" and (span, gold) in VALUE_FORM_REFUSES else float(reference(span, gold))
        if ours != want:
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


def test_plain_number_fast_path_gives_math_verifys_verdict():
    """`plain_numbers_equal` (no math-verify) must agree with math-verify on every pair of plain
    numbers it answers, and defer (None) on the ones where math-verify rounds or reads notation.
    Fails if it compared strings ("0.30" vs "0.3", "007" vs "7"), ignored the sign, or answered the
    7-decimal and exponent pairs where math-verify's rounding differs from exact equality."""
    import numpy as np

    from rljax.rewards.math import plain_numbers_equal

    rng = np.random.default_rng(0)
    pairs = [("0.3", "0.30"), ("007", "7"), ("-0", "0"), ("2", "-2"), ("10", "1"), ("3.50", "3.5"),
             ("-4", "-41"), ("12.25", "12.250000"), ("0.1", "0.01"), ("999999999999999", "999999999999999")]
    for _ in range(300):  # near misses: the same value re-written, and off by one in the last place
        decimals = int(rng.integers(0, 7))
        value = round(float(rng.normal(0, 10 ** rng.integers(0, 5))), decimals)
        text = f"{value:.{decimals}f}"
        pairs += [(text, text + "0" * int(rng.integers(0, 7 - decimals)) if decimals else text),
                  (text, f"{value + 10 ** -decimals:.{decimals}f}")]
    answered = 0
    for gold, pred in pairs:
        fast = plain_numbers_equal(gold, pred)
        if fast is not None:
            answered += 1
            assert fast == verify(parse(f"${gold}$"), parse(f"${pred}$")), (gold, pred)
            assert math_verify(f"x\n{pred}", gold, form="expression") == float(fast), (gold, pred)
    assert answered >= len(pairs) - 5  # the fast path is actually taken
    for gold, pred in [("3", "3.0000001"), ("0.1234567", "0.1234568"), ("1e3", "1000"), ("1.5", "3/2"),
                       (".5", "0.5"), ("1234567890123456", "1234567890123456")]:
        assert plain_numbers_equal(gold, pred) is None, (gold, pred)
        assert math_verify(f"x\n{pred}", gold, form="expression") == float(verify(parse(f"${gold}$"),
                                                                                 parse(f"${pred}$")))
