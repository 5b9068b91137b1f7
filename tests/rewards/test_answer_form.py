"""The answer guards' memoised parses: the same verdicts as the plain functions, and the regex work
done once per distinct string, not once per rollout (issue 48's CPU check: the guards and the audit,
re-parsing every row's gold, question and answer, made the default job's verify step ~10x slower)."""

import random
from fractions import Fraction

import pytest

from rljax.rewards import answer_form
from rljax.rewards.audit import ExactValue
from rljax.rewards.reasoning import is_answer
from rljax.train.config import load_config

CACHED = (answer_form.parse_value, answer_form.value_of_gold, answer_form._squash, is_answer, ExactValue.judge)

# spans and golds the guards see: plain values, signs, fractions in both spellings, percentages,
# restated operations, prose, look-alike digits, bombs
SPANS = ["17", "-28", "+5", " 17 ", "17.", "1/2", "10/2", "\\frac{3}{4}", "\\frac12", "25%", "1,234", "0.5",
         ".5", "39 - 67", "7 * 8", "39 - 67 = -28", "x = 12", "The answer is 56.", "5 or 6", "1 2 3", "about 42 km",
         "To calculate 39 - 67, we need to subtract", "５６", "𝟓𝟔", "(" * 20 + "1" + ")" * 20, "9" * 80, "", "zero",
         "(93 + 35) = 128. So it", "4 + 3 is still 7.", "12. 13 14", "-0", "x^2+1", "2^{10}"]
QUESTION = "State the final answer to the following arithmetic problem: 39 - 67 ="


@pytest.fixture(autouse=True)
def _fresh_caches():
    for fn in CACHED:
        fn.cache_clear()
    yield
    for fn in CACHED:
        fn.cache_clear()


def test_cached_parses_equal_the_plain_functions():
    """Every memoised function gives the plain function's result (`__wrapped__`), on a cold and a
    warm cache, and keys on every argument: a cache keyed on the span alone returns "1/2"'s value
    for allow_fraction=False (the plain function says None), and one keyed on the span alone in
    `is_answer` or `judge` returns the first gold's verdict for the second."""
    for _ in range(2):  # cold, then warm
        for span in SPANS:
            for allow in (True, False):
                assert answer_form.parse_value(span, allow_fraction=allow) == \
                    answer_form.parse_value.__wrapped__(span, allow_fraction=allow), (span, allow)
            assert answer_form.value_of_gold(span) == answer_form.value_of_gold.__wrapped__(span), span
            assert answer_form._squash(span) == answer_form._squash.__wrapped__(span), span
            for gold in ("-28", "17", "1/2"):
                assert is_answer(span, gold, QUESTION) == is_answer.__wrapped__(span, gold, QUESTION), (span, gold)
                assert is_answer(span, gold, "") == is_answer.__wrapped__(span, gold, ""), (span, gold)
            for value in (Fraction(-28), Fraction(17), Fraction(56)):
                assert ExactValue.judge(span, value) == ExactValue.judge.__wrapped__(span, value), (span, value)
    assert answer_form.parse_value("1/2") == Fraction(1, 2)
    assert answer_form.parse_value("1/2", allow_fraction=False) is None
    assert is_answer("39 - 67", "-28", QUESTION) is False and is_answer("39 - 67", "-28", "") is False
    assert ExactValue.judge("17", Fraction(17)) and not ExactValue.judge("17", Fraction(18))


def _default_job_batch(prompts=64, samples=8):
    """A default-job iteration's verifier inputs: chain_sum prompts, each sampled `samples` times,
    with 1-3 distinct replies per prompt (right, off by one, a restated operation)."""
    import reasoning_gym

    rng = random.Random(0)
    entries = list(reasoning_gym.create_dataset("chain_sum", size=prompts, seed=5, min_terms=2, max_terms=2,
                                                min_digits=2, max_digits=2))
    metas, replies = [], []
    for entry in entries:
        gold = entry["answer"]
        options = [gold, str(int(gold) + 1), entry["question"].rsplit(":", 1)[-1].strip().rstrip("=").strip()]
        for _ in range(samples):
            metas.append({"entry": entry, "question": entry["question"], "answer": gold})
            replies.append(rng.choice(options[:rng.randint(1, 3)]))
    return metas, replies


def test_default_job_reward_parses_each_distinct_string_once(monkeypatch):
    """Scoring one default-job batch (its reward: the reasoning-gym answer behind the guards, plus
    the exact audit) runs the guards' text cleaning (`answer_form._clean`, the bulk of their regex
    work) at most twice per distinct question, gold and reply, and scoring the same batch again
    runs no cleaning, no `is_answer` guard (`foreign_digits`) and no audit judging (`statement`),
    with the same rewards. The uncached functions (the code before the fix) clean ~6 times per
    row (over 2,500 calls for these 512 rows, against a bound of at most ~640)."""
    from rljax.rewards import audit, reasoning
    from rljax.rewards.config import build_reward

    metas, replies = _default_job_batch()
    reward = build_reward(load_config("default", []).reward)
    assert [p.name for p in reward.parts] == ["correct", "audit"]  # what the default job scores
    calls = {"clean": 0, "guard": 0, "judge": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(answer_form, "_clean", counted("clean", answer_form._clean))
    monkeypatch.setattr(reasoning, "foreign_digits", counted("guard", reasoning.foreign_digits))
    monkeypatch.setattr(audit, "statement", counted("judge", audit.statement))
    lengths = [len(r) for r in replies]
    first, _ = reward.batch(metas, replies, num_tokens=lengths)
    distinct = len({m["question"] for m in metas}) + len({m["answer"] for m in metas}) + len(set(replies))
    assert 0 < calls["clean"] <= 2 * distinct, (calls, distinct)
    assert calls["guard"] > 0 and calls["judge"] > 0
    calls.update(clean=0, guard=0, judge=0)
    again, _ = reward.batch(metas, replies, num_tokens=lengths)
    assert calls == {"clean": 0, "guard": 0, "judge": 0}
    assert (again.total_b == first.total_b).all() and all((again.parts[k] == first.parts[k]).all() for k in first.parts)
    assert 0 < first.parts["correct"].mean() < 1 and 0 < first.parts["audit"].mean() < 1  # both verdicts occur
