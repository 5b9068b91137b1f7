"""The warm start's stopping target relative to the constant-answer baseline (issue 24)."""

import math

import numpy as np
import pytest

from rljax.data import Example
from rljax.train.warm_start import constant_answer_baseline, relative_target, stop_reason


def test_constant_answer_baseline_matches_reference_on_gcd_pairs():
    """On gcd of uniform random pairs the best constant answer is "1", solving the fraction of coprime
    pairs (about 6/pi^2); the function equals a NumPy count of the most common answer.
    Catches: counting distinct answers instead of the most common one, or ignoring surrounding
    whitespace so " 1" and "1" count as different answers."""
    rng = np.random.default_rng(0)
    pairs = rng.integers(1, 200, (400, 2))
    answers = [str(math.gcd(int(a), int(b))) for a, b in pairs]
    examples = [Example(id=str(i), question=f"gcd {a},{b} =", answer=ans + (" " if i % 3 else ""))
                for i, ((a, b), ans) in enumerate(zip(pairs, answers))]
    values, counts = np.unique(np.array(answers), return_counts=True)
    answer, baseline = constant_answer_baseline(examples)
    assert answer == values[counts.argmax()] == "1"
    assert baseline == counts.max() / len(answers)
    assert abs(baseline - 6 / math.pi ** 2) < 0.06  # the coprime fraction, within sampling noise of 400 pairs


@pytest.mark.parametrize("target,baseline,want", [(0.3, 0.0, 0.3), (0.3, 0.6, 0.72), (0.0, 0.6, 0.0)])
def test_relative_target_is_a_normalised_gain(target, baseline, want):
    """b + t (1 - b): unchanged without a repeated answer, 72% for 30% above a 60% constant
    answer, and no target stays no target; a constant-answer policy's accuracy never stops it.
    Catches: an absolute target that a constant-answer policy meets (gcd stopped at step 50 on
    answering "1"), or a zero target turned into a positive one by the baseline."""
    assert relative_target(target, baseline) == pytest.approx(want)
    assert stop_reason([baseline], target=relative_target(target, baseline), patience=0, min_delta=0.01) is None


def test_empty_validation_has_no_baseline():
    """An empty validation set has baseline 0, so the target stays absolute.
    Catches: a ZeroDivisionError or IndexError on an empty set."""
    assert constant_answer_baseline([]) == ("", 0.0)
