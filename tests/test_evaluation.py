"""Evaluation statistics against their textbook definitions."""

from math import comb

import numpy as np
import pytest
from scipy import stats

from rljax.evaluation.metrics import mean_pass_at_k, mean_with_ci, pass_at_k


@pytest.mark.parametrize("n,c,k", [(10, 0, 1), (10, 3, 1), (10, 3, 4), (20, 19, 5), (5, 5, 5), (7, 2, 6)])
def test_pass_at_k_equals_combinatorial_formula(n, c, k):
    """pass@k = 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), exactly."""
    expected = 1.0 - comb(n - c, k) / comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_monotone_in_k():
    """pass@1 is c/n; pass@k never decreases with k."""
    table = np.random.default_rng(0).random((50, 8)) < 0.3
    assert mean_pass_at_k(table, 1) == pytest.approx(table.mean())
    values = [mean_pass_at_k(table, k) for k in range(1, 9)]
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="exceeds"):
        pass_at_k(3, 1, 4)


def test_mean_with_ci_matches_student_t_interval():
    """The interval is scipy's t-interval around the mean over seeds."""
    x = np.array([0.41, 0.47, 0.52, 0.44])
    mean, lo, hi = mean_with_ci(x)
    ref_lo, ref_hi = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
    assert mean == pytest.approx(x.mean())
    assert (lo, hi) == pytest.approx((ref_lo, ref_hi))
    assert mean_with_ci(np.array([0.5])) == (0.5, 0.5, 0.5)
