"""DAPO resampling in fixed-size rounds (rljax/data/resampling.py) against a NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest

from rljax.data.filtering import dynamic_sample
from rljax.data.resampling import ResampleSpend, RoundResampler, resample
from rljax.errors import ConfigError

R, N = 4, 3  # prompts per round, samples per prompt


def _rounds(seed, num_rounds, p_informative):
    """Fixed reward arrays: each group all-equal (0 or 1) or mixed with probability p_informative."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_rounds):
        rewards = np.repeat(rng.integers(0, 2, size=(R, 1)), N, axis=1).astype(np.float32)
        mixed = rng.uniform(size=R) < p_informative
        rewards[mixed] = [1.0, 0.0, 1.0]
        out.append(rewards)
    return out


def _reference(rounds, num_groups, max_rounds):
    """Plain-NumPy DAPO resampling: rounds until num_groups groups with std > 0, or the cap."""
    keep = []
    used = 0
    for rewards in rounds[:max_rounds]:
        keep.extend(rewards.std(axis=1) > 0)
        used += 1
        if sum(keep) >= num_groups:
            break
    keep = np.array(keep)
    kept_idx = [i for i in range(len(keep)) if keep[i]][:num_groups]
    filler = [i for i in range(len(keep)) if not keep[i]][:num_groups - len(kept_idx)]
    spend = ResampleSpend(rounds=used, sampled=len(keep), kept=int(keep.sum()), dropped=int((~keep).sum()),
                          unused=max(int(keep.sum()) - num_groups, 0), padded=len(filler))
    return np.array(kept_idx + filler), np.array([True] * len(kept_idx) + [False] * len(filler)), spend


@pytest.mark.parametrize("seed,p_informative,num_groups,max_rounds,filled", [
    (0, 0.5, 5, 4, True),    # fills in the last round the cap allows, one kept group unused
    (1, 0.25, 6, 3, False),  # hits the cap: 3 filler groups marked invalid
    (2, 1.0, 3, 2, True),    # fills in the first round with a group to spare
])
def test_matches_numpy_reference_and_reports_spend(seed, p_informative, num_groups, max_rounds, filled):
    """Indices, validity and spend equal the reference; rounds stop as soon as the batch is full.
    Catches: drawing past a full batch, filler marked valid, kept groups out of sampled order,
    or spend counted over the rounds the cap forbade."""
    rounds = _rounds(seed, 8, p_informative)
    calls = []
    out = resample(lambda k: calls.append(k) or rounds[k], num_groups=num_groups, round_size=R,
                   max_rounds=max_rounds)
    idx, valid, spend = _reference(rounds, num_groups, max_rounds)
    np.testing.assert_array_equal(out.indices_g, idx)
    np.testing.assert_array_equal(out.valid_g, valid)
    assert out.spend == spend and calls == list(range(spend.rounds)) and out.filled == filled
    assert out.spend.metrics()["rollout/resample_rounds"] == spend.rounds


def test_fills_whenever_enough_valid_groups_exist_within_the_cap():
    """Over 40 random reward streams: filled iff the cap's rounds hold >= num_groups informative
    groups, and every index points at an informative group when filled.
    Catches: stopping early on a partly full batch, padding when valid groups were left, or
    drawing one more round when a round fills the batch exactly."""
    outcomes = set()
    for seed in range(40):
        rounds = _rounds(100 + seed, 3, 0.3)
        out = resample(lambda k: rounds[k], num_groups=4, round_size=R, max_rounds=3)
        available = sum(int((r.std(axis=1) > 0).sum()) for r in rounds)
        assert out.filled == (available >= 4)
        flat = np.concatenate(rounds)
        assert (flat[out.indices_g].std(axis=1) > 0).tolist() == out.valid_g.tolist()
        assert out.spend == _reference(rounds, 4, 3)[2]
        outcomes.add((out.filled, out.spend.unused == 0))
    assert outcomes == {(True, True), (True, False), (False, True)}  # exact fills, spares, the cap


def test_one_round_is_the_fixed_pool_refill():
    """max_rounds = 1 over a pool of R prompts selects exactly what `dynamic_sample` (refill) does.
    Catches: the two modes disagreeing on order or filler."""
    pool = _rounds(7, 1, 0.5)[0]
    rs = RoundResampler(num_groups=3, round_size=R, max_rounds=1)
    rs.add_round(pool)
    out = rs.result()
    ref = dynamic_sample(pool, 3)
    np.testing.assert_array_equal(out.indices_g, np.asarray(ref.indices_g))
    np.testing.assert_array_equal(out.valid_g, np.asarray(ref.valid_g))
    assert out.spend.padded == int(ref.num_padded) and out.spend.dropped == int(ref.num_dropped)


def test_impossible_batch_is_a_config_error():
    """A batch larger than the cap's rounds can hold fails up front with a fix.
    Catches: a controller that would loop until the cap and then fail to build a batch."""
    with pytest.raises(ConfigError, match="raise round_size or max_rounds"):
        RoundResampler(num_groups=9, round_size=4, max_rounds=2)


def test_a_baseline_of_its_own_keeps_agreeing_groups_that_differ_from_it():
    """ReMax's baseline is the greedy reward b_g, so a group is informative when max_j |r_gj - b_g|
    > 0: against a NumPy reference of that rule on fixed rounds. Both kinds of group the variance
    test gets wrong are present (all samples 0 under a greedy 1: kept; samples equal to a greedy 1:
    dropped, as are those equal to a greedy 0). Catches: resampling that ignores the baseline (it
    keeps only the mixed groups and pads the batch) or compares it with the group mean."""
    rewards = [np.array([[0, 0, 0], [1, 1, 1], [1, 0, 1], [0, 0, 0]], np.float32),
               np.array([[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1]], np.float32)]
    baselines = [np.array([1, 1, 0, 0], np.float32), np.array([0, 0, 1, 1], np.float32)]
    out = resample(lambda k: rewards[k], num_groups=4, round_size=R, max_rounds=2, baseline_round=lambda k: baselines[k])
    keep = np.concatenate([np.abs(r - b[:, None]).max(axis=1) > 0 for r, b in zip(rewards, baselines)])
    np.testing.assert_array_equal(keep, [True, False, True, False, True, False, True, False])
    np.testing.assert_array_equal(out.indices_g, np.flatnonzero(keep))
    assert out.filled and out.spend == ResampleSpend(rounds=2, sampled=8, kept=4, dropped=4, unused=0, padded=0)
    plain = resample(lambda k: rewards[k], num_groups=4, round_size=R, max_rounds=2)
    assert not plain.filled  # the variance test keeps only [1, 0, 1]
    with pytest.raises(ValueError, match="baselines must be"):
        RoundResampler(num_groups=1, round_size=R, max_rounds=1).add_round(rewards[0], np.zeros(3))
