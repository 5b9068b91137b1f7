"""Token controls through the update step: the selection's scope is the mini-batch whatever the
micro-batching or packing, the fast path equals the scoring pass, the adaptive entropy
coefficient lives in the train state, and every existing preset is bitwise unchanged with the
new options off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_step import _batch, _state

from rljax.objectives import PRESETS, AlgorithmConfig
from rljax.update import UpdateConfig, prepare_batch, update_step
from rljax.update.controls import token_controls

# bounds wide enough that Clip-Cov's candidates are most tokens: the draw is what is compared
WIDE = dict(clip_cov_lb=-100.0, clip_cov_ub=100.0, cov_ratio=0.3)


def _run(algo, sched, seed=0):
    state = _state(algo, update_cfg=sched)
    return update_step(state, _batch(seed), jax.random.key(7))


def test_selection_scope_is_the_minibatch_whatever_the_microbatching():
    """1 and 4 micro-batches and packing select the same tokens and give the same update: every
    mean, random draw (Clip-Cov) and quantile (the entropy mask) runs over the mini-batch
    (`rljax.update.controls`). Fails with the selection inside `microbatch_loss` (per
    micro-batch, verl's scope): 4 micro-batches of 2 rows would each take max(int(ratio n), 1) of
    their own tokens, with their own means, draws and quantiles."""
    algo = AlgorithmConfig(algorithm="grpo", policy_loss="clip_cov", top_entropy_quantile=0.5, **WIDE)
    s1, m1 = _run(algo, UpdateConfig(num_microbatches=1))
    for sched in (UpdateConfig(num_microbatches=4), UpdateConfig(packing=True, max_tokens_per_microbatch=24)):
        s2, m2 = _run(algo, sched)
        assert float(m2["policy/cov_clipped_share"]) == float(m1["policy/cov_clipped_share"]) > 0
        for k in ("loss/policy", "grad_norm"):
            np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5, err_msg=k)
        # Adam turns near-zero gradients' summation-order noise into ~1e-6 steps; a different
        # selection moves many parameters by ~lr = 1e-3
        for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_fast_path_logp_equals_the_scoring_pass():
    """With one mini-batch, one epoch and recompute_old_logp, the selection reads `old_logp_bt`
    instead of scoring the mini-batch again; both give the same selection. Fails if the fast path
    read the sampler's log-probs (they carry noise here)."""
    algo = AlgorithmConfig(algorithm="grpo", policy_loss="kl_cov", cov_ratio=0.2, recompute_old_logp=True)
    state = _state(algo, update_cfg=UpdateConfig())
    batch = _batch(3, noise=0.5)
    prepared, _ = prepare_batch(state, batch)
    key = jax.random.key(0)
    slow, _ = token_controls(state, state.trainable, prepared, key, chunks=1)
    fast, _ = token_controls(state, state.trainable, prepared, key, chunks=1, logp_bt=prepared.old_logp_bt)
    np.testing.assert_array_equal(np.asarray(fast.select_bt), np.asarray(slow.select_bt))
    sampler = prepared.replace(old_logp_bt=batch.sampler_logp_bt)
    wrong, _ = token_controls(state, state.trainable, sampler, key, chunks=1, logp_bt=batch.sampler_logp_bt)
    assert not np.array_equal(np.asarray(wrong.select_bt), np.asarray(slow.select_bt))


def test_control_metrics_match_numpy():
    """policy/cov_mean is the mean of (A - mean A)(log pi - mean log pi) over the valid tokens,
    policy/cov_clipped_share the selected share of them (KL-Cov: max(int(0.2 n), 1) / n), and
    policy/entropy_masked_share the valid tokens the rho = 0.25 entropy mask takes the policy loss
    off (about three quarters). Fails with a mean or share over padded tokens (a quarter of this batch is
    padding) or a masked share counted the wrong way round (kept instead of masked)."""
    algo = AlgorithmConfig(algorithm="grpo", policy_loss="kl_cov", cov_ratio=0.2, top_entropy_quantile=0.25)
    state = _state(algo, update_cfg=UpdateConfig())
    prepared, _ = prepare_batch(state, _batch(3, noise=0.5))
    mb, pairs = token_controls(state, state.trainable, prepared, jax.random.key(0), chunks=1)
    got = {k: float(num / den) for k, (num, den) in pairs.items()}
    on = np.asarray(prepared.loss_mask_bt) > 0
    n = on.sum()
    assert 0.1 < 1 - n / on.size
    from rljax.models import token_logprobs
    logp = np.asarray(token_logprobs(state.model_cfg, state.params, prepared.tokens_bt, prepared.attn_mask_bt)[0])
    adv = np.asarray(prepared.advantages_bt)
    cov = (adv[on] - adv[on].mean()) * (logp[on] - logp[on].mean())
    assert abs(cov.mean()) > 1e-3
    np.testing.assert_allclose(got["policy/cov_mean"], cov.mean(), rtol=1e-4)
    assert got["policy/cov_clipped_share"] == np.float32(max(int(0.2 * n), 1) / n)
    kept = np.asarray(mb.entropy_keep_bt)[on].sum()
    assert abs(kept - n / 4) <= 1
    np.testing.assert_allclose(got["policy/entropy_masked_share"], (n - kept) / n, rtol=1e-6)


def test_adaptive_entropy_coefficient_is_carried_and_logged():
    """The coefficient starts at entropy_coef, is logged as entropy/coef, and after each update
    moves by entropy_coef_step toward the target (up: the tiny model's entropy ~4.8 nats is under
    a target of 10; the downward step and the sign are checked against NumPy in
    tests/objectives/test_entropy_control.py). Fails if the state did not carry the new value."""
    for target, sign in ((10.0, 1),):
        algo = AlgorithmConfig(algorithm="grpo", entropy_coef=0.01, entropy_target=target, entropy_coef_step=0.002)
        state = _state(algo)
        assert float(state.entropy_coef) == np.float32(0.01)
        state, m = update_step(state, _batch(0), jax.random.key(0))
        assert float(m["entropy/coef"]) == np.float32(0.01) and float(m["policy/entropy"]) > 0
        np.testing.assert_allclose(float(state.entropy_coef), 0.01 + sign * 0.002, rtol=1e-6)
        state, m = update_step(state, _batch(1), jax.random.key(1))
        np.testing.assert_allclose(float(m["entropy/coef"]), 0.01 + sign * 0.002, rtol=1e-6)


NEW_KEYS = ("policy/", "entropy/coef", "loss/off_policy_kl", "train/is_zeroed_frac", "train/is_rejected_rows")


def test_presets_run_no_new_code_path_with_the_new_options_off():
    """With the new options at their defaults no new code path runs: every preset's config equals
    the one with the off values spelled out and turns no control on; one update (grpo with a KL
    term) has no policy/..., entropy/coef or correction metric and no entropy_coef in the state.
    (Bitwise equality of every preset's update with the code before issue 51 was checked once
    against that tree; see BENCHMARKS.md.) Fails if a default turned a control on (e.g.
    top_entropy_quantile < 1 or a cov loss)."""
    off = dict(top_entropy_quantile=1.0, entropy_target=None, cov_ratio=0.01, off_policy_low=None,
               off_policy_high=None, off_policy_mean="geometric", off_policy_kl_coef=0.1)
    for preset in PRESETS:
        algo = AlgorithmConfig(algorithm=preset)
        assert algo == AlgorithmConfig(algorithm=preset, **off), preset
        assert not algo.token_controls and not algo.adaptive_entropy and not algo.off_policy_kl, preset
    state, m = _run(AlgorithmConfig(algorithm="grpo", kl_coef=0.01), UpdateConfig(num_microbatches=2))
    assert state.entropy_coef is None
    assert not [k for k in m if k.startswith(NEW_KEYS)]


# bounds inside the batch's 0.05-nat sampler noise, so that each correction acts on some tokens or rows
NARROW = {"icepop": (0.97, 1.03), "seq_reject": (0.99, 1.01), "mask_kl": (0.97, 1.03)}


@pytest.mark.parametrize("off_policy", list(NARROW))
def test_each_correction_under_lora_packed_equals_padded(off_policy):
    """Each rollout correction, in a LoRA update, acts here (zeroes tokens, or rejects rows) and
    gives the padded update's loss and gradient norm through the packed update (its weights,
    masks and, for mask_kl, the KL term's sampler log-probs are read on the padded rows before
    packing). (one_step_off and async: tests/drivers/test_stability_controls.py.) Fails if packing
    dropped a correction or read its weights, masks or KL term off the packed buffers (the packed
    loss would differ), or if a correction broke under LoRA (NaN, no metric)."""
    from rljax.lora import LoraConfig
    low, high = NARROW[off_policy]
    algo = AlgorithmConfig(algorithm="grpo", recompute_old_logp=True, off_policy=off_policy, off_policy_low=low,
                           off_policy_high=high)
    acted = "train/is_rejected_rows" if off_policy == "seq_reject" else "train/is_zeroed_frac"
    runs = []
    for sched in (UpdateConfig(), UpdateConfig(packing=True, max_tokens_per_microbatch=24)):
        state = _state(algo, update_cfg=sched, lora=LoraConfig(rank=4))
        runs.append(update_step(state, _batch(0), jax.random.key(7))[1])
    m1, m2 = runs
    assert all(np.isfinite(float(v)) for v in m1.values()) and 0 < float(m1[acted]) < 1
    for k in ("loss/policy", "grad_norm", acted) + (("loss/off_policy_kl",) if off_policy == "mask_kl" else ()):
        np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5, atol=1e-8, err_msg=k)
