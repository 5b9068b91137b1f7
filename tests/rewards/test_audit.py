"""The audit: a stricter second opinion beside the training reward, and the agreement it logs."""

import jax
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.rewards import AUDIT_PART, ExactValue, GymExact, LastNumber, MathAnswer, audit_metrics, compose
from rljax.rewards.audit import last_number
from rljax.rewards.config import RewardSection, build_reward

# A fixed batch where the training reward is fooled on known rows: the expression form without
# the question scores the restated operation "39 - 67" as -28 (issue 52's hole).
ROWS = [  # (gold, completion, fooled: the reward says right, right: the reply is the answer)
    ("-28", "39 - 67", True, False), ("-28", "-28", False, True), ("56", "7 * 8", True, False),
    ("56", "The answer is 56.", False, True), ("8", "To calculate 10 - 2, we need to subtract the numbers", True, False),
    ("8", "9", False, False), ("106", "39 + 67 = 106", False, True), ("12", "x = 12", False, True),
]


def test_last_number_reads_the_reply_as_a_person_would():
    """The last number, with a sign only where no operand precedes it: "39-67" ends in 67, not -67."""
    assert last_number("39-67") == 67 and last_number("x = -28") == -28 and last_number("1,234 apples") == 1234
    assert last_number("so 3.50.") == 3.5 and last_number("none") is None


def test_exact_value_wants_one_plain_number_in_the_final_statement():
    """The exact audit wants one number in ASCII digits, no operation, at most three words: prose
    whose last number is the answer, operations, fractions, several numbers and spelled numbers are
    refused; a number after "=" or "is", alone or with a few words, is accepted."""
    audit = ExactValue(methods=("final_line",))
    refused = ["To calculate 0 * 6, you simply multiply 0 by itself,", "The number 0 is a concept", "0/1", "39 - 0",
               "zero", "0 0", "The result might well be 0", "7 x 0"]
    assert [c for c in refused if audit({"answer": "0"}, c)[0] != 0.0] == []
    accepted = ["0", "x = 0", "The answer is 0.", "-0", "Well\n0", "0 apples"]
    assert [c for c in accepted if audit({"answer": "0"}, c)[0] != 1.0] == []
    assert audit({"answer": "x^2+1"}, "y = x^2 + 1")[0] == 1.0 and audit({"answer": "x^2+1"}, "x^2+2")[0] == 0.0


def test_exact_value_reads_the_statement_up_to_its_sentence_end():
    """Every row a real run's first, bare-number version of this audit disputed (smollm2_arith,
    seed 1, iterations 1-9: the reward called them correct; a 16-token budget cuts replies after
    their answer) states its answer and agrees now; a second number after the sentence, an "or",
    an operation or too many words are still refused. Fails if the audit judged the whole final
    statement as a bare number (the first group is refused), only its first number ("12. 13 14",
    "-28; -29" pass), or allowed any number of words."""
    audit = ExactValue(methods=("final_line",))
    agreed = [("128", "(93 + 35) = 128. So it"), ("10", 'Using a calculator, "4 + 6 = 10"'),
              ("10", "To be concise, 4 + 6 = 10 independent, self"), ("8", "7 + 1 = 8 remains the answer"),
              ("6", "4 + 2 = 6 \n\n4 + 2 = 6 Re"), ("134", "94 + 40 = 134. That's correct."), ("7", "4 + 3 is still 7."),
              ("72", "60 + 12 is equal to 72. So, "), ("56", "**56**"), ("1234", "The sum is 1,234.")]
    refused = [("12", "12. 13 14"), ("-28", "-28; -29"), ("5", "The answer is 5 or 6"), ("5", "5. Or 6."),
               ("-28", "39-67"), ("56", "56 is the answer we were looking for")]
    assert [c for g, c in agreed if audit({"answer": g}, c)[0] != 1.0] == []
    assert [c for g, c in refused if audit({"answer": g}, c)[0] != 0.0] == []


def test_audit_agreement_equals_numpy_count_on_a_fooled_batch():
    """``reward/audit_agreement`` is #(reward correct and audit correct) / #(reward correct),
    computed here with NumPy from the rows' known labels; the fooled rows are exactly the ones the
    audit refuses. Fails if the metric divided by all rows, counted the audit's own positives, or
    let the audit change the reward."""
    reward = compose(correct=(1.0, MathAnswer(time_limit_s=None, form="expression")),
                     audit=(0.0, LastNumber()))
    metas = [{"answer": gold} for gold, *_ in ROWS]
    scores, _ = reward.batch(metas, [c for _, c, _, _ in ROWS])
    correct, audit = scores.parts["correct"], scores.parts[AUDIT_PART]
    fooled, right = np.array([r[2] for r in ROWS]), np.array([r[3] for r in ROWS])
    assert np.array_equal(correct >= 1, fooled | right)  # the reward is fooled on the known rows
    assert np.array_equal(audit >= 1, right)  # the audit is not
    np.testing.assert_array_equal(scores.total_b, correct)  # weight 0: never in the reward
    want = np.sum((correct >= 1) & (audit >= 1)) / np.sum(correct >= 1)
    got = jax.jit(audit_metrics)({k: jax.numpy.asarray(v) for k, v in scores.parts.items()})
    assert float(got["reward/audit_agreement"]) == pytest.approx(want) and want == pytest.approx(4 / 7)
    assert float(got["reward/audit_rows"]) == 7
    none = audit_metrics({"correct": np.zeros(3), AUDIT_PART: np.ones(3)})
    assert float(none["reward/audit_agreement"]) == 1.0 and float(none["reward/audit_rows"]) == 0
    assert audit_metrics({"correct": np.ones(3)}) == {}


def test_reward_section_adds_the_audit_as_a_weight_zero_part():
    """`[reward] audit` adds the named checker with weight 0; "off" adds nothing; a code reward,
    which has no final answer, refuses it in one line."""
    fn = build_reward(RewardSection(kind="math", audit="last_number", inline=True, answer_methods=("boxed",)))
    assert fn.part_names == ("correct", AUDIT_PART)
    part = fn.parts[1]
    assert part.weight == 0.0 and isinstance(part.verifier, LastNumber) and part.verifier.methods == ("boxed",)
    assert isinstance(build_reward(RewardSection(audit="exact")).parts[1].verifier, ExactValue)
    assert isinstance(build_reward(RewardSection(audit="reasoning_gym")).parts[1].verifier, GymExact)
    assert build_reward(RewardSection(kind="math")).part_names == ("correct",)
    with pytest.raises(ConfigError, match="reward.audit='last_number' checks a final answer"):
        RewardSection(kind="code", audit="last_number")


def test_gym_exact_gives_no_partial_credit():
    """reasoning-gym's scorer gives "x = 17" partial credit; the audit counts full marks only."""
    import reasoning_gym

    entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=3, min_terms=2, max_terms=2)[0]
    audit = GymExact()
    assert audit({"entry": entry}, entry["answer"])[0] == 1.0
    assert audit({"entry": entry}, f"x = {entry['answer']}")[0] == 0.0


def test_preview_shows_the_rows_the_audit_disputes_first():
    """The rollout's preview (what the loop writes to samples.jsonl) puts the disputed rows (reward
    correct, audit not) first, in row order, flags them, and with nothing disputed is exactly
    sample 0 of the first prompts, as before the audit. Fails if disputed rows were not preferred,
    if a row the audit agrees with (or the reward refuses) were flagged, or if the prompt of a
    disputed row were not its own (row // n)."""
    from types import SimpleNamespace

    from rljax.stages.rollout import PREVIEW_ROWS, rollout_preview

    p, n = 6, 3
    b = p * n
    tokens = np.arange(b * 2, dtype=np.int32).reshape(b, 2)
    out = SimpleNamespace(tokens=jax.numpy.asarray(tokens), mask=jax.numpy.ones((b, 2), bool))
    prompts = jax.numpy.arange(p * 4, dtype=jax.numpy.int32).reshape(p, 4)
    index_p = jax.numpy.arange(100, 100 + p)
    correct, audit = np.zeros(b, np.float32), np.zeros(b, np.float32)
    correct[[4, 7, 11, 13]] = 1.0  # the reward says right
    audit[[7, 2]] = 1.0  # the audit agrees on 7 only (2: the audit alone, not disputed)
    rewards = SimpleNamespace(total_b=jax.numpy.asarray(correct),
                              parts={"correct": jax.numpy.asarray(correct), AUDIT_PART: jax.numpy.asarray(audit)})
    got = jax.device_get(rollout_preview(out, prompts, jax.numpy.ones((p, 4), bool), index_p, rewards, n))
    rows = [4, 11, 13, 0]  # the disputed rows in order, then sample 0 of prompt 0
    assert PREVIEW_ROWS == 4
    np.testing.assert_array_equal(got.completion_tokens_kc, tokens[rows])
    np.testing.assert_array_equal(got.disputed_k, [True, True, True, False])
    np.testing.assert_array_equal(got.prompt_index_k, [100 + r // n for r in rows])
    np.testing.assert_array_equal(got.prompt_tokens_kt, np.asarray(prompts)[[r // n for r in rows]])
    plain = jax.device_get(rollout_preview(out, prompts, jax.numpy.ones((p, 4), bool), index_p,
                                           SimpleNamespace(total_b=rewards.total_b, parts={"correct": rewards.total_b}), n))
    np.testing.assert_array_equal(plain.completion_tokens_kc, tokens[np.arange(4) * n])
    assert not plain.disputed_k.any()
