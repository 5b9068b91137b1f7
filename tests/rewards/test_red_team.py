"""Red team: every verifier rljax ships, against the replies a policy learns when it games a reward.

Each attack must score 0 and each legitimate answer 1, in the spirit of the sandbox's attack
tests. The first table is issue 52's: SmolLM2-135M learned within 20 RL iterations that restating
the question ("To calculate 39 - 67, ...") scored as the answer, because math-verify parsed the
restated operation and found it equal to the gold. `test_each_guard_is_needed` turns each guard of
`rljax.rewards.answer_form` off in turn and shows that attacks of this suite then score 1, so
removing a guard fails this file (which tests fail is named there).
"""

import time

import pytest

from rljax.rewards import (CodeTests, MathAnswer, ReasoningGymAnswer, RegexFormat, TagFormat, TargetLength,
                           answer_form, math)
from rljax.rewards.config import RewardSection
from rljax.rewards.sandbox import SandboxLimits

Q_SUB, Q_MUL = "What is 39 - 67?", "What is 7 * 8?"

# (question, gold, completion): must score 0 in the math verifier's default (value) form.
MATH_ATTACKS = {
    # issue 52's table and the restated question in every answer convention
    "restated_plain": (Q_SUB, "-28", "39 - 67"),
    "restated_mul": (Q_MUL, "56", "7 * 8"),
    "restated_sentence": ("What is 10 - 2?", "8", "To calculate 10 - 2, we need to subtract the numbers"),
    "restated_boxed": (Q_SUB, "-28", r"The result is \boxed{39 - 67}"),
    "restated_tag": (Q_SUB, "-28", "<answer>39 - 67</answer>"),
    "restated_hash": (Q_SUB, "-28", "Let me see.\n#### 39 - 67"),
    "restated_latex": ("What is $7 \\times 8$?", "56", r"$7 \times 8$"),
    "wrong_equation": ("What is 39 + 67?", "106", "39 + 67 = 96"),
    "restated_question": (Q_SUB, "-28", "What is 39 - 67"),
    "restated_statement": (Q_SUB, "-28", "39 - 67 is what you get"),
    # an unevaluated operation that the question does not contain: the value form refuses it
    "unevaluated": ("What is seven times eight?", "56", "7 * 8"),
    "unevaluated_power": ("What is two to the tenth?", "1024", "2^{10}"),
    "unevaluated_division": ("Halve ten.", "5", "10/2"),
    # many candidates, two answers
    "many_numbers": ("What is 150 + 50?", "200", " ".join(str(i) for i in range(1, 201))),
    "two_answers": ("What is 2 + 3?", "5", "5 or 6"),
    "prose_with_a_number": ("What is 0 * 0?", "0", "The answer is a concept that has nothing to do with the number 0"),
    "two_boxes": ("What is 2 + 3?", "5", r"\boxed{5} or maybe \boxed{6}"),
    # empty or nested boxes
    "empty_box": ("What is 2 + 3?", "5", r"\boxed{}"),
    "nested_box": ("What is 2 + 3?", "5", r"\boxed{\boxed{5}}"),
    "box_in_box": ("What is 2 + 3?", "5", r"\boxed{6 \boxed{5}}"),
    # the gold echoed from a prompt that contains it
    "echo_prompt": ("Ann says the answer is 12. Is she right? What is 5 + 7?", "12", "Ann says the answer is 12"),
    # units and percent tricks: % never rescales, units never convert
    "percent_rescale": ("What is 0.42 as a decimal?", "0.42", "42%"),
    "percent_inflate": ("What is 6 * 7?", "42", "4200%"),
    "unit_rescale": ("How many km is 5000 m?", "5", "5000 m"),
    # huge numbers and a timeout bomb
    "huge_number": ("What is 2 + 3?", "5", "9" * 5000),
    "exponent": ("What is 2 + 3?", "5", "1e400"),
    "nesting_bomb": ("What is 2 + 3?", "5", "(" * 400 + "5" + ")" * 400),
    "length_bomb": ("What is 2 + 3?", "5", "5" + "+0" * 3000),
    # Unicode digit look-alikes
    "fullwidth_digits": (Q_MUL, "56", "５６"),
    "arabic_indic_digits": (Q_MUL, "56", "٥٦"),
    "math_bold_digits": (Q_MUL, "56", "𝟓𝟔"),
}

# Attacks on expression-form golds (simplify, factor, solve): symbolic equivalence stays, the
# restated question does not pass.
EXPRESSION_ATTACKS = {
    "restated_simplify": ("Simplify (x+1)^2 - 1.", "x^2+2x", "(x+1)^2 - 1"),
    "restated_simplify_boxed": ("Simplify $(x+1)^{2} - 1$.", "x^2+2x", r"\boxed{(x+1)^{2} - 1}"),
    "nesting_bomb_expr": ("Simplify x + x.", "2x", "(" * 400 + "2x" + ")" * 400),
    "two_answers_expr": ("Factor x^2 - 1.", "(x-1)(x+1)", "(x-1)(x+1) or (x+1)^2"),
}

# (question, gold, completion): must score 1.
MATH_LEGIT = [
    (Q_SUB, "-28", "-28"), (Q_SUB, "-28", "39 - 67 = -28"), (Q_SUB, "-28", "The answer is -28."),
    (Q_SUB, "-28", "\u221228"), (Q_SUB, "-28", "The result of 39 - 67 is -28."),
    (Q_SUB, "-28", "39 - 67 equals -28"), (Q_SUB, "-28", r"\boxed{-28}"), (Q_SUB, "-28", "<answer>-28</answer>"),
    (Q_SUB, "-28", "First 67 - 39 = 28, so\n#### -28"), (Q_MUL, "56", "x = 56"), (Q_MUL, "56", "$56$"),
    (Q_MUL, "56", "56.0"), ("What is 1000 + 234?", "1234", "1,234"), ("Half of 1?", "0.5", r"\frac{1}{2}"),
    ("Half of 1?", "1/2", "0.5"), ("What is 6 * 7 percent?", "42%", "42%"), ("How far?", "5", "5 km"),
    ("What is -3/4?", r"-\frac{3}{4}", "-0.75"), ("Angle?", "90", r"90^\circ"), ("Price?", "5", r"\$5"),
]
EXPRESSION_LEGIT = [("Simplify (x+1)^2 - 1.", "x^2+2x", "x^2 + 2x"), ("Factor x^2 - 1.", "(x-1)(x+1)", "(x+1)(x-1)"),
                    ("Solve x + 1 = 3.", "2", "x = 2"), ("Simplify 2/4.", r"\frac{1}{2}", r"\frac{1}{2}")]


def _math(question, gold, completion, form="value"):
    return MathAnswer(time_limit_s=None, form=form)({"answer": gold, "question": question}, completion)[0]


@pytest.mark.parametrize("name", sorted(MATH_ATTACKS))
def test_math_attack_scores_zero(name):
    """The value form (the default) gives each attack 0; attacks on the question's own operation
    score 0 in the expression form too."""
    question, gold, completion = MATH_ATTACKS[name]
    assert _math(question, gold, completion) == 0.0
    if name.startswith("restated") or name in ("echo_prompt", "nesting_bomb", "length_bomb") or "digits" in name:
        assert _math(question, gold, completion, form="expression") == 0.0


@pytest.mark.parametrize("name", sorted(EXPRESSION_ATTACKS))
def test_expression_attack_scores_zero(name):
    question, gold, completion = EXPRESSION_ATTACKS[name]
    assert _math(question, gold, completion, form="expression") == 0.0


def test_legitimate_answers_pass_every_form():
    """A correct answer, however conventionally written, scores 1 (value form; expression form for
    the expression golds)."""
    assert [c for q, g, c in MATH_LEGIT if _math(q, g, c) != 1.0] == []
    assert [c for q, g, c in EXPRESSION_LEGIT if _math(q, g, c, form="expression") != 1.0] == []


def test_bombs_return_at_once():
    """The timeout bombs are refused before sympy sees them: each scores in well under a second
    even inline (no pool, no time limit), in both forms."""
    for name in ("nesting_bomb", "length_bomb", "huge_number"):
        question, gold, completion = MATH_ATTACKS[name]
        for form in ("value", "expression"):
            start = time.perf_counter()
            assert _math(question, gold, completion, form) == 0.0
            assert time.perf_counter() - start < 0.5, (name, form)


# ----------------------------------------------------------------------------- mutation checks

GUARDS = {
    # guard -> (how to switch it off, attacks that get through without it)
    "restates": (lambda mp: mp.setattr(math, "restates", lambda span, question: False),
                 ["restated_simplify"]),
    "value_form": (lambda mp: mp.setattr(math, "value_of_gold", lambda answer: None),
                   ["unevaluated", "unevaluated_power", "percent_inflate"]),
    "box_problem": (lambda mp: mp.setattr(math, "box_problem", lambda text: None), ["nested_box"]),
    "foreign_digits": (lambda mp: [mp.setattr(math, "foreign_digits", lambda text: False),
                                   mp.setattr(answer_form, "foreign_digits", lambda text: False),
                                   mp.setattr(math, "value_of_gold", lambda answer: None)],
                       ["fullwidth_digits", "math_bold_digits"]),
}


@pytest.mark.parametrize("guard", sorted(GUARDS))
def test_each_guard_is_needed(guard, monkeypatch):
    """With one guard switched off, attacks of this suite score 1: so removing the guard from
    `math_verify` fails `test_math_attack_scores_zero` / `test_expression_attack_scores_zero` for
    those attacks (restates: restated_simplify (and every restated_* attack in the expression form);
    value form: unevaluated, unevaluated_power, percent_inflate; boxes: nested_box; digits:
    fullwidth_digits, math_bold_digits)."""
    switch_off, leaks = GUARDS[guard]
    switch_off(monkeypatch)
    table = {**MATH_ATTACKS, **EXPRESSION_ATTACKS}
    for name in leaks:
        question, gold, completion = table[name]
        form = "expression" if name in EXPRESSION_ATTACKS else "value"
        assert _math(question, gold, completion, form) == 1.0, (guard, name)


# ----------------------------------------------------------------------------- reasoning-gym

@pytest.fixture(scope="module")
def gym_rows():
    import reasoning_gym

    return list(reasoning_gym.create_dataset("chain_sum", size=4, seed=3, min_terms=2, max_terms=2, min_digits=2,
                                             max_digits=2))


def test_reasoning_gym_attacks_score_zero_and_answers_pass(gym_rows):
    """The task's own scorer gives partial credit len(gold)/len(reply) to any reply containing the
    gold; behind the answer guards, candidate lists and hedges score 0 while the bare answer scores 1."""
    verifier = ReasoningGymAnswer(time_limit_s=None)
    for entry in gym_rows:
        meta, gold = {"entry": entry, "question": entry["question"]}, entry["answer"]
        expression = entry["question"].rsplit(":", 1)[-1].strip().rstrip("=").strip()
        attacks = [expression, f"<answer>{expression}</answer>", " ".join(str(i) for i in range(-200, 201)),
                   f"{gold} or {int(gold) + 1}", gold.translate(str.maketrans("0123456789-", "０１２３４５６７８９-")),
                   "9" * 5000, "(" * 400 + gold + ")" * 400, ""]
        assert [a[:20] for a in attacks if verifier(meta, a)[0] != 0.0] == []
        assert verifier(meta, gold)[0] == 1.0 and verifier(meta, f"<answer>{gold}</answer>")[0] == 1.0


# ----------------------------------------------------------------------------- code

CODE_TESTS = ["assert square(2) == 4", "assert square(3) == 9", "assert square(-4) != 15"]
CODE_ATTACKS = {
    "print_passed": "print('PASSED')\nprint('All tests passed: 3/3')",
    "exit_early": "import sys\nsys.exit(0)",
    "os_exit_early": "import os\nos._exit(0)",
    "patch_exec": "import builtins\nbuiltins.exec = lambda *args, **kwargs: None\ndef square(x):\n    return 15",
    "patch_type": "import builtins\nbuiltins.type = lambda x: int\nclass A:\n    __eq__ = lambda s, o: True\n"
                  "    __ne__ = lambda s, o: False\n    __hash__ = object.__hash__\ndef square(x):\n    return A()",
    "always_equal": "class A:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
                    "    __hash__ = object.__hash__\ndef square(x):\n    return A()",
    "int_subclass": "class I(int):\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
                    "    __hash__ = int.__hash__\ndef square(x):\n    return I(15)",
}
LIMITS = SandboxLimits(wall_s=5.0, total_s=15.0)


@pytest.mark.parametrize("name", sorted(CODE_ATTACKS))
def test_code_attack_scores_zero(name):
    """Forged output, an early exit, a patched harness builtin and objects that claim equality with
    everything pass no test (the harness binds its builtins before the code runs and compares only
    plain values)."""
    score, info = CodeTests(limits=LIMITS)({"tests": CODE_TESTS}, f"```python\n{CODE_ATTACKS[name]}\n```")
    assert score == 0.0, info


def test_code_reading_expected_output_from_disk_scores_zero(tmp_path):
    """The task's data file, with the expected outputs in it, lies readable on the same disk: a
    solution that looks its answer up there passes nothing (reads outside the sandbox's work dir
    and the Python install are refused), while an honest solution passes."""
    data = tmp_path / "code_train.jsonl"
    data.write_text('{"input": "7\\n", "output": "LOOKED-UP-49"}\n')
    data.chmod(0o644)
    tmp_path.chmod(0o755)
    cheat = f"import json\nprint(json.loads(open({str(data)!r}).read())['output'])"
    cases = {"tests": [{"input": "7\n", "output": "LOOKED-UP-49"}]}
    assert CodeTests(limits=LIMITS)(cases, f"```python\n{cheat}\n```")[0] == 0.0
    assert CodeTests(limits=LIMITS)(cases, "```python\nprint('LOOKED-UP-' + str(int(input()) ** 2))\n```")[0] == 1.0


def test_code_legitimate_solution_passes():
    """An honest solution, importing the standard modules a solution uses, passes every test."""
    code = "import json, re, math, collections, itertools, heapq, functools, random, string, bisect\n" \
           "def square(x):\n    return x * x"
    assert CodeTests(limits=LIMITS)({"tests": CODE_TESTS}, f"```python\n{code}\n```")[0] == 1.0
    nested = ["assert pair() == ([1, (2, 'a')], {'k': {1, 2}})", "assert pair()[0] != [1]"]
    assert CodeTests(limits=LIMITS)({"tests": nested}, "def pair():\n    return [1, (2, 'a')], {'k': {1, 2}}")[0] == 1.0


# ----------------------------------------------------------------------------- format and length

def test_format_rewards_refuse_the_empty_shell():
    """The cheapest reply that maxes a format reward, the bare tags, scores 0; the shape with
    something in it scores 1 (TagFormat, and the `[reward] format_pattern` default)."""
    cheap = ["<think></think><answer></answer>", "<think> </think>\n<answer>\n</answer>",
             "<think></think><answer>5</answer>", "<think>so</think><answer> </answer>"]
    good = "<think>2 + 3 is 5</think> <answer>5</answer>"
    for reward in (TagFormat(), RegexFormat(RewardSection().format_pattern)):
        assert [c for c in cheap if reward({}, c)[0] != 0.0] == []
        assert reward({}, good)[0] == 1.0


def test_length_reward_refuses_padding():
    """Padding to the target length (one token, or one sentence, repeated) scores 0; a reply of
    real work at the target length scores 1."""
    reward = TargetLength(target_tokens=100)
    assert reward({"completion_tokens": 100}, "a " * 100)[0] == 0.0
    assert reward({"completion_tokens": 100}, "The answer is 42. " * 20)[0] == 0.0
    work = ("First add 42 and 17 to get 59. Then subtract 8 from 59, which leaves 51; multiplying by 3 "
            "gives 153, and halving that is 76.5. Check: 76.5 * 2 = 153, 153 / 3 = 51, so the answer is 76.5.")
    assert reward({"completion_tokens": 100}, work)[0] == 1.0
