"""Token controls through the update step: the selection's scope is the mini-batch whatever the
micro-batching or packing, the fast path equals the scoring pass, the adaptive entropy
coefficient lives in the train state, and every existing preset is bitwise unchanged with the
new options off."""

import functools

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


# the three selections, each acting on this batch: Clip-Cov's draw and KL-Cov's top-k, each with
# the entropy mask
SELECTIONS = {"clip_cov": dict(policy_loss="clip_cov", **WIDE, top_entropy_quantile=0.5),
              "kl_cov": dict(policy_loss="kl_cov", cov_ratio=0.2, top_entropy_quantile=0.3)}


@functools.cache
def _shared_state():
    """One grpo train state for the selection cases (none donates it): they differ in the static
    `algo` only, which `replace` swaps without building the params again."""
    return _state(AlgorithmConfig(algorithm="grpo"), update_cfg=UpdateConfig())


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_selection_from_the_loss_forward_equals_the_scoring_pass(name, monkeypatch):
    """One unpacked micro-batch: the loss selects from its own forward's detached log-probs and
    entropies (`controls_key`), with no scoring pass; the reference scores the mini-batch first
    (`token_controls`). Same tokens selected (exactly) by the cov loss and by the entropy mask
    (top_entropy_quantile), same metrics, same loss and gradient. The loss's forward is the same
    computation in both and the selection carries no gradient, so loss and gradients agree to f32
    rounding (rtol 1e-6 / 1e-5 on gradient entries); one token selected differently moves the loss
    by ~1e-3 of its value here (KL-Cov's |log r| term, a token zeroed by Clip-Cov or the mask).
    Fails if the loss's path selected with another key (Clip-Cov's draw; checked: fold_in(key, 1)
    changes 12 of the 96 entries), from other log-probs than its forward's (the batch's sampler
    log-probs, 0.5 nats of noise here), without the entropy mask (no entropies in that forward), or
    dropped the selection's metrics."""
    from rljax.update import loss as loss_mod
    from rljax.update.loss import aggregation_denominator, microbatch_loss
    algo = AlgorithmConfig(algorithm="grpo", **SELECTIONS[name])
    state = _shared_state().replace(algo=algo)
    batch = _batch(3, noise=0.5)
    prepared, _ = jax.jit(prepare_batch)(state, batch)
    den = aggregation_denominator(prepared, algo, batch.completion_len)
    loss = functools.partial(microbatch_loss, cfg=state.model_cfg, algo=algo, update_cfg=state.update_cfg,
                             norm_length=batch.completion_len, models=state.models)
    seen = []
    select_tokens = loss_mod.select_tokens
    monkeypatch.setattr(loss_mod, "select_tokens", lambda *a: seen.append(select_tokens(*a)) or seen[-1])

    @jax.jit  # one program for both paths: a compile per case
    def both(trainable, key):
        _, (pairs_fast, _) = loss(trainable, prepared, den, controls_key=key)
        fast_mb = seen[0][0]  # what the loss's forward selected
        ref_mb, ref_pairs = token_controls(state, trainable, prepared, key, chunks=1)
        def loss_grad(mb, **k):
            (value, _), g = jax.value_and_grad(loss, has_aux=True)(trainable, mb, den, **k)
            return value, g
        return fast_mb, pairs_fast, loss_grad(prepared, controls_key=key), ref_mb, ref_pairs, loss_grad(ref_mb)

    fast_mb, pairs_fast, (loss_got, g_got), ref_mb, ref_pairs, (loss_ref, g_ref) = both(state.trainable,
                                                                                          jax.random.key(5))
    for field in ("select_bt", "entropy_keep_bt"):
        ref, got = np.asarray(getattr(ref_mb, field)), np.asarray(getattr(fast_mb, field))
        np.testing.assert_array_equal(got, ref, err_msg=field)
        assert 0 < ref.sum() < np.asarray(prepared.loss_mask_bt).sum(), field  # it selects some, not all
    for k, (num, d) in ref_pairs.items():
        np.testing.assert_allclose(float(pairs_fast[k][0] / pairs_fast[k][1]), float(num / d), rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(float(loss_got), float(loss_ref), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-8)


def test_the_scoring_pass_runs_exactly_where_the_loss_cannot_select(monkeypatch):
    """The update scores the mini-batch (`score_rows`) only where the loss's forward does not see
    the whole mini-batch at its params: 2 micro-batches, packing, LoRA dropout; with one unpacked
    micro-batch it scores nothing and the loss selects. Traced, not compiled. Fails if the loss's
    path were taken with 2 micro-batches or packing (each micro-batch would select over its own
    rows: the mini-batch scope broken) or with LoRA dropout (selection at dropped-out params), or
    if the one-micro-batch update still paid for a scoring pass."""
    from rljax.lora import LoraConfig
    from rljax.update import controls, loss as loss_mod
    from rljax.update.step import update
    calls = {"score": 0, "loss": 0}

    def counted(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(controls, "score_rows", counted("score", controls.score_rows))
    monkeypatch.setattr(loss_mod, "select_tokens", counted("loss", loss_mod.select_tokens))
    algo = AlgorithmConfig(algorithm="grpo", policy_loss="clip_cov", top_entropy_quantile=0.5)
    cases = [(UpdateConfig(), None, (0, 1)), (UpdateConfig(num_microbatches=2), None, (1, 0)),
             (UpdateConfig(packing=True, max_tokens_per_microbatch=24), None, (1, 0)),
             (UpdateConfig(), LoraConfig(rank=4, dropout=0.1), (1, 0)), (UpdateConfig(), LoraConfig(rank=4), (0, 1))]
    for sched, lora, want in cases:
        calls.update(score=0, loss=0)
        state = jax.eval_shape(lambda: _state(algo, update_cfg=sched, lora=lora))  # abstract: nothing built
        jax.make_jaxpr(lambda s, b, k: update(s, b, k))(state, _batch(0), jax.random.key(0))  # a fresh trace
        assert (calls["score"], calls["loss"]) == want, (sched, lora, calls)


def test_correction_metrics_match_numpy():
    """`train/is_zeroed_frac` and `train/is_rejected_rows` from `prepare_batch` (recompute_old_logp),
    against NumPy written from the definitions on a fixed batch (k = pi_old / mu per token; row 2
    a filler with no loss token; 69% of the positions are padding):
    - icepop in [0.8, 1.4]: the share of the valid tokens with k outside the band (zeroed), which
      stay in the loss mask (IcePop keeps them in the denominator: nothing dropped);
    - seq_reject in [0.95, 1.05]: the share of rows with loss tokens whose mean ratio, arithmetic
      (1/n) sum k or geometric exp((1/n) sum log k), is outside the band: 2 of 7 and 3 of 7 rows.
    Fails with a share over all positions or all rows (padding, the filler row), zeroed tokens
    dropped from the mask (the numerator would be empty), a flipped bound, the two means swapped,
    or a filler row counted as rejected (its arithmetic mean is 0, outside the band). With bounds
    that exclude k = 1 ([1.02, 1.5]), padding (log k = 0 there) is weighted 0: a numerator not
    restricted to the mask fails that case."""
    from rljax.objectives.rollout_correction import icepop
    from rljax.update.advantages import correction_shares
    batch = _batch(4, noise=0.3)
    mask = np.asarray(batch.loss_mask_bt).copy()
    mask[2] = False
    batch = batch.replace(loss_mask_bt=jnp.asarray(mask))
    state = _shared_state()
    cases = [("icepop", {}, (0.8, 1.4)), ("seq_reject", dict(off_policy_mean="arithmetic"), (0.95, 1.05)),
             ("seq_reject", dict(off_policy_mean="geometric"), (0.95, 1.05))]
    rejected_rows = []
    for name, kw, (low, high) in cases:
        algo = AlgorithmConfig(algorithm="grpo", recompute_old_logp=True, off_policy=name, off_policy_low=low,
                               off_policy_high=high, **kw)
        prepared, m = jax.jit(prepare_batch)(state.replace(algo=algo), batch)
        log_k = np.where(mask, np.asarray(prepared.old_logp_bt) - np.asarray(batch.sampler_logp_bt), 0.0)
        k, n = np.exp(log_k), mask.sum(1)
        if name == "icepop":
            zeroed = mask & ((k < low) | (k > high))
            assert 0 < zeroed.sum() < mask.sum()
            np.testing.assert_allclose(float(m["train/is_zeroed_frac"]), zeroed.sum() / mask.sum(), rtol=1e-6)
            np.testing.assert_array_equal(np.asarray(prepared.loss_mask_bt), mask)  # kept in the denominator
            assert float(m["train/is_rejected_rows"]) == 0.0
        else:
            ratio = ((k * mask).sum(1) / np.maximum(n, 1) if kw["off_policy_mean"] == "arithmetic"
                     else np.exp(log_k.sum(1) / np.maximum(n, 1)))
            rejected = (n > 0) & ((ratio < low) | (ratio > high))
            rejected_rows.append(rejected.sum())
            np.testing.assert_allclose(float(m["train/is_rejected_rows"]), rejected.sum() / (n > 0).sum(), rtol=1e-6)
            assert float(m["train/is_zeroed_frac"]) == 0.0
    assert rejected_rows == [2, 3]  # the two means reject different rows here
    # padding's k = 1 outside the band: only valid tokens count as zeroed
    old, mu, on = prepared.old_logp_bt, batch.sampler_logp_bt, jnp.asarray(mask, jnp.float32)
    w, kept = icepop(old, mu, on, low=1.02, high=1.5)
    k = np.exp(np.where(mask, np.asarray(old) - np.asarray(mu), 0.0))
    assert np.sum(np.asarray(w)[~mask] == 0) > 0  # padding is weighted 0 here
    want = (mask & ((k < 1.02) | (k > 1.5))).sum() / mask.sum()
    np.testing.assert_allclose(float(correction_shares(w, on, kept)["train/is_zeroed_frac"]), want, rtol=1e-6)
