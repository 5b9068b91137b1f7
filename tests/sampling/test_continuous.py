"""Continuous batching (`rljax.sampling.continuous`): equal to static batching, refills isolated,
no recompiles within a bucket, log-probs equal to the trainer's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.models as M
from rljax.errors import ConfigError
from rljax.sampling import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, SampleControls, generate
from rljax.sampling import continuous as C
from rljax.sampling import sampler as S

FIELDS = ("tokens", "logprobs", "sampling_logprobs", "mask", "lengths", "finish_reason")
NEW = 40  # new-token bucket 64: the static loop runs phases 16, 32, 64 unless batch-invariant


@pytest.fixture(scope="module")
def tiny():
    cfg = M.preset("qwen2-test")
    return cfg, M.init_params(cfg, jax.random.key(0), std=0.2)


def _ragged(seed, lengths, width, vocab):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (len(lengths), width)).astype(np.int32)
    mask = np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]
    return np.where(mask, tokens, 0), mask


PROMPTS = _ragged(0, [6, 9, 3, 1, 7], 9, 128)  # 5 prompts: generate pads the count to 8
# Two EOS ids and two stop sequences end rows at scattered lengths (all three finish reasons).
CONTROLS = SampleControls(max_new_tokens=NEW, num_samples=3, temperature=1.0, top_k=50, eos_ids=(3, 7),
                          stop_sequences=((11,), (20, 30)), pad_id=0)


@pytest.fixture(scope="module")
def invariant_static(tiny):
    cfg, params = tiny
    out = {}
    for greedy in (False, True):
        controls = CONTROLS.replace(batch_invariant=True, greedy=greedy)
        out[greedy] = generate(cfg, params, *PROMPTS, key=jax.random.key(5), controls=controls)
    return out


def _assert_same(got, want):
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), err_msg=field)


@pytest.mark.parametrize("greedy,slots,prefill_batch", [(False, 1, 0), (False, 4, 2), (True, 3, 1)])
def test_continuous_equals_static_bitwise(tiny, invariant_static, greedy, slots, prefill_batch):
    """With `batch_invariant`, continuous batching at any slot count (1: every row reuses one slot;
    4 with prompts prefilled two at a time inside the loop; 3, greedy) gives bitwise the tokens,
    log-probs, masks, lengths and finish reasons of static batching, sampled and greedy, on ragged
    prompts whose rows end at different steps by EOS, stop sequence and length. The counters say
    every row-step of a running row was decoded once: live_row_steps = sum(lengths - 1).
    Catches: a row drawing with a slot's or the batch's key instead of its own, a KV copy from the
    wrong pool entry or ring slot, a row written to the wrong output row or column, a finished row
    decoded on, admission out of input order, a stop window not reset on refill."""
    cfg, params = tiny
    want = invariant_static[greedy]
    got = generate(cfg, params, *PROMPTS, key=jax.random.key(5), controls=CONTROLS.replace(
        batch_invariant=True, greedy=greedy, scheduler="continuous", slots=slots, prefill_batch=prefill_batch))
    _assert_same(got, want)
    finish = set(np.asarray(want.finish_reason).tolist())
    lengths = np.asarray(want.lengths)
    assert finish == ({FINISH_EOS, FINISH_LENGTH} if greedy else {FINISH_EOS, FINISH_STOP, FINISH_LENGTH})
    assert len(set(lengths.tolist())) >= (2 if greedy else 4)  # greedy: a prompt's samples are one row
    assert got.slots == slots and int(got.live_row_steps) == int((lengths - 1).sum())
    assert int(got.decode_steps) >= -(-int((lengths - 1).sum()) // slots)


@pytest.fixture(scope="module")
def forced(tiny):
    """The default (not batch-invariant) mode with imposed lengths: a logits processor forces EOS
    at each row's length, as the long-tail benchmark does."""
    cfg, params = tiny
    rows = 5 * CONTROLS.num_samples
    lengths = np.random.default_rng(2).integers(1, NEW + 1, rows).astype(np.int32)
    lengths[[0, 7]] = NEW
    imposed = jnp.asarray(lengths)

    def force_lengths(logits_bv, row_b, step_b):
        ends = step_b >= imposed[jnp.clip(row_b, 0, rows - 1)] - 1
        eos = jnp.arange(logits_bv.shape[-1]) == 3
        return jnp.where(ends[:, None], jnp.where(eos, 0.0, -jnp.inf), jnp.where(eos, -jnp.inf, logits_bv))

    controls = CONTROLS.replace(eos_ids=(3,), stop_sequences=(), logits_processor=force_lengths)
    static = generate(cfg, params, *PROMPTS, key=jax.random.key(6), controls=controls)
    continuous = controls.replace(scheduler="continuous", slots=4)
    return lengths, static, continuous, generate(cfg, params, *PROMPTS, key=jax.random.key(6), controls=continuous)


def test_default_mode_matches_static_and_honours_imposed_lengths(forced):
    """Without batch invariance continuous and static agree on every token, mask and finish reason,
    and on log-probs to f32 rounding (XLA:CPU's matmul kernels depend on the row count: measured
    <= 2e-6 here); the logits processor imposes each row's length in both (EOS at length - 1).
    Catches: a processor given slot indices instead of row indices or the wrong token index, a
    refill that drops or repeats a row, results returned in slot order instead of input order."""
    lengths, static, _, got = forced
    np.testing.assert_array_equal(np.asarray(static.lengths), lengths)
    for field in ("tokens", "mask", "lengths", "finish_reason"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(static, field)))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(static.logprobs), atol=1e-5, rtol=0)
    assert (np.asarray(got.finish_reason) == FINISH_EOS).all()  # forced at NEW - 1 too


def test_continuous_logprobs_equal_trainer_scoring(tiny, forced):
    """The continuous sampler's policy log-probs equal the trainer's `token_logprobs` on prompt +
    completion within 1e-5 (f32), though the logits processor shaped the sampling distribution.
    Catches: a slot attending over the wrong positions (rope or mask off by one after a refill),
    log-probs taken from the processed logits."""
    cfg, params = tiny
    _, _, _, res = forced
    tokens, mask = PROMPTS
    n = CONTROLS.num_samples
    full = np.concatenate([np.repeat(tokens, n, 0), np.asarray(res.tokens)], 1)
    full_mask = np.concatenate([np.repeat(mask, n, 0), np.asarray(res.mask)], 1)
    logp, _ = M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))
    sel = np.asarray(res.mask)
    assert sel.sum() > 200
    np.testing.assert_allclose(np.asarray(res.logprobs)[sel], np.asarray(logp)[:, tokens.shape[1]:][sel],
                               atol=1e-5, rtol=0)


def test_no_recompile_when_pending_rows_change(tiny, forced):
    """Another call with 7 prompts instead of 5 (same prompt-count bucket, 8) and another prompt
    width in the same length bucket compiles nothing.
    Catches: the row count or prompt count reaching the compiled program as a static shape."""
    cfg, params = tiny
    _, _, controls, _ = forced
    compiles = []

    def listen(event, *_args, **_kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        generate(cfg, params, *_ragged(3, [4, 12, 2, 8, 5, 1, 9], 12, cfg.vocab_size), key=jax.random.key(1),
                 controls=controls)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


def test_refilled_slot_never_sees_previous_occupant(tiny, invariant_static, monkeypatch):
    """`test_continuous_equals_static_bitwise[False-1-0]` decodes all 15 rows in one slot, each
    row after the previous one ends, and equals static batching. Here admission is made to leave
    the previous row's key positions on the generated region (a leak) and the tokens change, so
    that equality really checks that a refilled slot attends only to its own row.
    Catches: a refill that keeps the old occupant's keys visible."""
    cfg, params = tiny

    def leaky(pos_sl, slot_tgt, prompt_pos_ap):
        return pos_sl.at[slot_tgt, :prompt_pos_ap.shape[1]].set(prompt_pos_ap, mode="drop")

    monkeypatch.setattr(C, "_reset_positions", leaky)
    @functools.wraps(C.sample_continuous)
    def retraced(*args, **kwargs):  # a new function: jit traces it again, with the leak
        return C.sample_continuous(*args, **kwargs)

    monkeypatch.setattr(S, "_continuous_jit", jax.jit(retraced, static_argnames=("cfg", "spec", "layout")))
    leaked = generate(cfg, params, *PROMPTS, key=jax.random.key(5), controls=CONTROLS.replace(
        batch_invariant=True, scheduler="continuous", slots=1))
    want = np.asarray(invariant_static[False].tokens)
    assert (np.asarray(leaked.tokens) != want).any(axis=1).sum() >= 3


def test_layout_from_max_total_tokens_and_bad_controls():
    """Slots come from the KV budget: max_total_tokens // (prompt bucket + new-token bucket), capped
    by `slots` and by the rows; a budget below one slot and a bad scheduler are one-line errors.
    Catches: slots sized rows x max_len regardless of the budget, a silent zero-slot layout."""
    controls = SampleControls(max_new_tokens=100, num_samples=8, scheduler="continuous")
    assert C.plan_layout(controls.replace(max_total_tokens=10_000), 64, 64).slots == 10_000 // (64 + 128)
    assert C.plan_layout(controls.replace(max_total_tokens=10_000, slots=16), 64, 64).slots == 16
    assert C.plan_layout(controls, 4, 64).slots == 32 and C.plan_layout(controls, 64, 64).slots == 64
    layout = C.plan_layout(controls.replace(prefill_batch=8), 64, 64)
    assert (layout.prefill_batch, layout.refill) == (8, 16)
    assert C.plan_layout(controls.replace(prefill_batch=64), 64, 64).prefill_batch == 0  # all up front
    with pytest.raises(ConfigError, match=r"max_total_tokens=100 holds no slot of 192 tokens.*at least 192$"):
        C.plan_layout(controls.replace(max_total_tokens=100), 64, 64)
    with pytest.raises(ConfigError, match="scheduler must be one of static, continuous, got 'paged'"):
        SampleControls(max_new_tokens=8, scheduler="paged")
    with pytest.raises(ConfigError, match="slots must be >= 0"):
        SampleControls(max_new_tokens=8, slots=-1)


def test_rollout_with_continuous_scheduler(tiny, invariant_static):
    """`rljax train`'s rollout (`sampling.scheduler = "continuous"` in the recipe) samples through
    the continuous scheduler inside its jitted program: its completions are the static sampler's
    (bitwise, batch-invariant mode), and its metrics report the scheduler's decode steps and slot
    occupancy, live_row_steps / (decode_steps x slots).
    Catches: the traceable `sample` ignoring the scheduler switch, occupancy computed over rows
    instead of slots."""
    from rljax.rewards import Rewards
    from rljax.stages.rollout import rollout

    cfg, params = tiny
    controls = CONTROLS.replace(batch_invariant=True, scheduler="continuous", slots=4, prefill_batch=2)
    tokens, mask = S.pad_prompts(cfg, *PROMPTS)

    def reward_callback(tokens_bt, mask_bt, index_b):
        total = ((tokens_bt[:, 0] % 5) == 0).astype(jnp.float32) * mask_bt[:, 0]
        return Rewards(total, {"five": total}, jnp.zeros(total.shape, bool))

    batch, metrics, _ = jax.jit(lambda p, t, m, i, k: rollout(
        cfg, p, t, m, i, k, controls=controls, reward_callback=reward_callback, num_groups=5))(
        params, tokens, mask, jnp.arange(5, dtype=jnp.int32), jax.random.key(5))
    want = invariant_static[False]
    width = tokens.shape[1]
    np.testing.assert_array_equal(np.asarray(batch.tokens_bt)[:, width:], np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(batch.sampler_logp_bt)[:, width:], np.asarray(want.logprobs))
    live = int((np.asarray(want.lengths) - 1).sum())
    steps = float(metrics["rollout/decode_steps"])
    assert steps >= live / 4
    np.testing.assert_allclose(float(metrics["rollout/slot_occupancy"]), live / (steps * 4), rtol=1e-6)


def test_drain_moves_the_tail_into_fewer_slots(tiny, invariant_static, monkeypatch):
    """Once nothing is pending and at most slots / 4 rows run, the running slots move into a cache
    of slots / 4 (here 8 -> 2, with the drain's 16-slot minimum lowered to 8) and finish there:
    the result is still bitwise static batching's, every running row-step is decoded once, and
    fewer row-steps are computed than 8 slots x decode steps.
    Catches: a drain that drops or reorders a running slot (its row would stop or take another
    row's cache), or one that never engages."""
    cfg, params = tiny
    monkeypatch.setattr(C, "DRAIN_MIN_SLOTS", 8)
    got = generate(cfg, params, *PROMPTS, key=jax.random.key(5), controls=CONTROLS.replace(
        batch_invariant=True, scheduler="continuous", slots=8))
    want = invariant_static[False]
    _assert_same(got, want)
    live = int((np.asarray(want.lengths) - 1).sum())
    assert int(got.live_row_steps) == live
    assert live <= int(got.slot_steps) < 8 * int(got.decode_steps)
