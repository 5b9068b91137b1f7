"""Evaluation statistics: unbiased pass@k, mean@k over seeds with a confidence interval.

pass@k (Chen et al., 2021, "Evaluating Large Language Models Trained on Code"): with n samples
of which c are correct, the unbiased estimate of P(at least one of k draws is correct) is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i).

mean@k is the accuracy averaged over k independent sampling seeds; we report its mean and a
Student-t confidence interval over seeds, as *Deep RL at the Edge of the Statistical Precipice*
(2021) and ReasonBENCH (2025) recommend reporting variance rather than a single number.
"""

from __future__ import annotations

import math

import numpy as np


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k for one problem (Chen et al., 2021), computed as a stable product."""
    if k > num_samples:
        raise ValueError(f"k={k} exceeds the number of samples n={num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    i = np.arange(num_samples - num_correct + 1, num_samples + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def mean_pass_at_k(correct_pn: np.ndarray, k: int) -> float:
    """pass@k averaged over problems, from a [problems, samples] boolean correctness table."""
    correct_pn = np.asarray(correct_pn, bool)
    n = correct_pn.shape[1]
    return float(np.mean([pass_at_k(n, int(c), k) for c in correct_pn.sum(axis=1)]))


def _t_quantile(p: float, dof: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(p, dof))


def mean_with_ci(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and a two-sided Student-t confidence interval (lo, hi) over independent runs."""
    values = np.asarray(values, np.float64)
    mean = float(values.mean())
    if values.size < 2:
        return mean, mean, mean
    half = _t_quantile(0.5 + confidence / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size)
    return mean, mean - half, mean + half
