"""The rollout corrections and entropy controls of issue 51 in the overlapped drivers (one_step_off,
async), reusing tests/drivers/test_overlap.py's model, prompts and layouts: the sampler's recorded
log-probs reach the correction, which then weighs or masks real stale tokens."""

import numpy as np
import pytest
from test_overlap import _overlapped, drive, layouts, params  # noqa: F401  (fixtures)

from rljax.objectives import AlgorithmConfig


@pytest.mark.parametrize("mode, kw", [
    ("one_step_off", dict(off_policy="icepop", off_policy_low=0.9, off_policy_high=1.1, policy_loss="kl_cov",
                          cov_ratio=0.2)),
    ("async", dict(off_policy="seq_reject", off_policy_mean="arithmetic")),
    ("async", dict(off_policy="mask_kl", off_policy_low=0.9, off_policy_high=1.1)),
    # the grid's other cells: icepop, seq_reject (geometric) and mask_kl in the other mode, and MIS
    # (TIS, which shares its log-weights, runs one_step_off in test_overlap.py). Packing, LoRA:
    # tests/update/test_controls.py
    ("async", dict(off_policy="icepop", off_policy_low=0.9, off_policy_high=1.1)),
    ("one_step_off", dict(off_policy="seq_reject", off_policy_low=0.99, off_policy_high=1.01)),
    ("one_step_off", dict(off_policy="mask_kl", off_policy_low=0.9, off_policy_high=1.1)),
    ("async", dict(off_policy="mis", off_policy_cap=1.1)),
])
def test_corrections_and_controls_run_in_the_overlapped_modes(layouts, params, mode, kw):  # noqa: F811
    """Finite losses every step; from the second step (a batch sampled one version back) the
    mean importance weight moves off 1 for icepop, mask_kl's KL term is positive, seq_reject
    (narrow band) rejects rows, MIS drops tokens, and the correction's metrics are reported.
    Fails if an overlapped mode fed the trainer's own log-probs to the correction (weights all 1,
    no token or row out of band) or a correction broke there (NaN, a missing metric)."""
    algo = AlgorithmConfig(recompute_old_logp=True, **kw)
    driver, state = _overlapped(mode, params, layouts, algo=algo)
    history = drive(driver, state, 3)
    assert all(np.isfinite(m["loss/policy"]) for m in history)
    assert all("train/is_zeroed_frac" in m and "train/is_rejected_rows" in m for m in history)
    if kw["off_policy"] == "icepop":
        weights = np.array([float(m["train/is_weight_mean"]) for m in history[1:]])
        assert np.all(np.abs(weights - 1.0) > 1e-6), weights
    if (kw["off_policy"], kw.get("off_policy_high")) == ("seq_reject", 1.01):  # stale rows rejected
        assert all(float(m["train/is_rejected_rows"]) > 0 for m in history[1:])
    if kw["off_policy"] == "mis":  # stale tokens out of [1/1.1, 1.1] dropped
        assert all(float(m["train/is_dropped_frac"]) > 0 for m in history[1:])
    if kw["off_policy"] == "mask_kl":  # stale tokens outside the band are zeroed and pulled back to the sampler
        assert all(float(m["loss/off_policy_kl"]) > 0 for m in history[1:])
    if "policy_loss" in kw:
        assert all(float(m["policy/cov_clipped_share"]) > 0 for m in history)
