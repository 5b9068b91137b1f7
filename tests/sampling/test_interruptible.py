"""Partial (interruptible) rollouts (`rljax.sampling.interruptible`): without a swap, bitwise the
sampler; with a swap at step s, the tokens of an independent cache-free decode that changes
params at s by hand, each token's recorded log-prob the score of the policy that drew it, its
version recorded; one compile per cache width."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.models as M
from rljax.sampling import SampleControls, sample
from rljax.sampling import decode as D
from rljax.sampling import interruptible as I
from rljax.sampling.fp8 import sampler_params

CFG = M.preset("qwen2-test")
P = 16  # prompt bucket
SEGMENT = 5  # decode steps between polls: swaps happen after token 1, 6, 11, 16 or 21 was drawn
# 24 new tokens: cache widths 16 then 32, so a run crosses a phase boundary; 10 of the 128 ids end a
# row, so some rows end early and some run to the budget.
CONTROLS = SampleControls(max_new_tokens=24, num_samples=3, temperature=1.0, top_p=0.95,
                          eos_ids=tuple(range(3, 13)), pad_id=0)


@pytest.fixture(scope="module")
def setup():
    params_a = M.init_params(CFG, jax.random.key(0), std=0.2)
    params_b = M.init_params(CFG, jax.random.key(1), std=0.2)
    rng = np.random.default_rng(0)
    mask = np.ones((3, P), bool)
    mask[0, :9], mask[1, :4] = False, False  # left padding
    tokens = np.where(mask, rng.integers(13, CFG.vocab_size, (3, P)), 0)
    return params_a, params_b, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), jax.random.key(7)


def _weights(schedule):
    """A `weights()` that returns schedule[i] on its i-th call (the last one from then on)."""
    calls = iter(range(10 ** 6))
    return lambda: schedule[min(next(calls), len(schedule) - 1)]


def _run(setup, schedule, controls=CONTROLS):
    _, _, tokens, mask, key = setup
    return I.sample_with_updates(CFG, tokens, mask, key, controls, segment_steps=SEGMENT, weights=_weights(schedule))


def test_without_a_swap_it_is_bitwise_the_sampler(setup):
    """With one version throughout, `sample_with_updates` (segments of 5 steps, across the 16 -> 32
    cache phase boundary) gives bitwise `sample`'s tokens, log-probs, sampling log-probs, mask,
    lengths and finish reasons; every drawn token records version 0 and the rest -1. Catches a
    segment that skips or repeats a step at a boundary, a widening at the wrong step, and a
    layout that attends over a wider cache than the sampler (last-bit log-prob differences)."""
    params_a, _, tokens, mask, key = setup
    ref = jax.jit(sample, static_argnames=("cfg", "controls"))(CFG, params_a, tokens, mask, key, controls=CONTROLS)
    result, version_bc, swaps = _run(setup, [(params_a, 0)])
    assert swaps == 0
    for name in ("tokens", "logprobs", "sampling_logprobs", "mask", "lengths", "finish_reason"):
        np.testing.assert_array_equal(np.asarray(getattr(result, name)), np.asarray(getattr(ref, name)), name)
    lengths = np.asarray(result.lengths)
    assert lengths.min() < SEGMENT + 1 and lengths.max() == CONTROLS.max_new_tokens  # rows end early, and late
    np.testing.assert_array_equal(np.asarray(version_bc), np.where(np.asarray(result.mask), 0, -1))


@jax.jit
def _reference_step(params, seq_bt, seq_mask_bt, t, row_keys_b):
    """Token t of every row from a full forward (no cache) over prompt + tokens 0..t-1."""
    logits_btv, _ = M.forward(CFG, params, seq_bt, None, seq_mask_bt)
    logits_bv = jax.lax.dynamic_index_in_dim(logits_btv, P - 1 + t, axis=1, keepdims=False)
    rows = seq_bt.shape[0]
    return D.draw(logits_bv, row_keys_b, jnp.arange(rows), jnp.full((rows,), t), CONTROLS.scalars(),
                  CONTROLS.static())[0]


def _reference(setup, swap_at):
    """Cache-free decode: token t is drawn, with the sampler's own `draw` and row keys, from the
    logits of a full forward over prompt + tokens 0..t-1 under params A for t < swap_at and B from
    then on. Returns (tokens, lengths) [rows, max_new]."""
    params_a, params_b, tokens, mask, key = setup
    n, new = CONTROLS.num_samples, CONTROLS.max_new_tokens
    rows = tokens.shape[0] * n
    seq = np.concatenate([np.repeat(np.asarray(tokens), n, 0), np.zeros((rows, new), np.int32)], 1)
    seq_mask = np.concatenate([np.repeat(np.asarray(mask), n, 0), np.zeros((rows, new), bool)], 1)
    row_keys = D.row_keys(key, rows)
    done = np.zeros(rows, bool)
    for t in range(new):
        tok = np.asarray(_reference_step(params_a if t < swap_at else params_b, seq, seq_mask, t, row_keys))
        seq[:, P + t] = np.where(done, CONTROLS.pad_id, tok)
        seq_mask[:, P + t] = ~done
        done |= np.isin(tok, CONTROLS.eos_ids) & ~done
    return seq[:, P:], seq_mask[:, P:].sum(1)


@pytest.mark.parametrize("swap_call,batch_invariant", [(3, False), (5, False), (3, True)])
def test_a_swap_gives_the_tokens_and_logprobs_of_changing_params_by_hand(setup, swap_call, batch_invariant):
    """New weights (version 1) first returned on poll 3 (swap after token 5: s = 6, inside the
    first cache phase) or poll 5 (s = 16, exactly when that phase is full), and with the sampler's
    batch-invariant mode (one cache width, rows recomputed one at a time): tokens equal the
    cache-free reference that switches A -> B at s (sampled, top_p 0.95); recorded log-probs equal
    A's `token_logprobs` of the final sequences before s and B's from s on (1e-5, f32); version_bc
    is 0 before s and 1 from s on for drawn tokens, -1 after a row's end, and rows that ended
    before s (some do) have no version-1 token; `start`/`advance`/`swap_weights`/`finish` called by
    hand give the driver's rollout bitwise. Catches a cache recomputed under the old params,
    a prefix that drops a fed token, wrong positions after
    left padding, a swap that edits finished rows' tokens, and versions recorded on the wrong
    tokens."""
    params_a, params_b, tokens, mask, _ = setup
    swap_at = 1 + SEGMENT * (swap_call - 2)
    schedule = [(params_a, 0)] * (swap_call - 1) + [(params_b, 1)]
    result, version_bc, swaps = _run(setup, schedule, CONTROLS.replace(batch_invariant=batch_invariant))
    assert swaps == 1
    ref_tokens, ref_lengths = _reference(setup, swap_at)
    np.testing.assert_array_equal(np.asarray(result.tokens), ref_tokens)
    np.testing.assert_array_equal(np.asarray(result.lengths), ref_lengths)

    n = CONTROLS.num_samples
    seq = jnp.concatenate([jnp.repeat(tokens, n, 0), result.tokens], 1)
    seq_mask = jnp.concatenate([jnp.repeat(mask, n, 0), result.mask], 1)
    score_a = np.asarray(M.token_logprobs(CFG, params_a, seq, seq_mask)[0])[:, P:]
    score_b = np.asarray(M.token_logprobs(CFG, params_b, seq, seq_mask)[0])[:, P:]
    col = np.arange(CONTROLS.max_new_tokens)[None, :]
    drawn = np.asarray(result.mask)
    expected = np.where(col < swap_at, score_a, score_b)
    np.testing.assert_allclose(np.asarray(result.logprobs)[drawn], expected[drawn], atol=1e-5, rtol=0)
    assert np.abs(score_a - score_b)[drawn & (col >= swap_at)].min() > 1e-3  # A and B tell apart
    np.testing.assert_array_equal(np.asarray(version_bc), np.where(drawn, (col >= swap_at).astype(int), -1))
    lengths = np.asarray(result.lengths)
    assert (lengths <= swap_at).any() and (lengths > swap_at).any()  # ended before s, and went on
    if swap_call == 3 and not batch_invariant:  # the step-by-step API gives the driver's rollout
        split_a, split_b = M.unstack_layers(params_a), M.unstack_layers(params_b)  # as the driver passes them
        partial = I.start(CFG, split_a, tokens, mask, setup[4], CONTROLS, version=0)
        partial = I.advance(CFG, split_a, partial, steps=swap_at - 1, version=0)
        partial = I.advance(CFG, split_b, I.swap_weights(CFG, split_b, partial), steps=100, version=1)
        manual, manual_versions = I.finish(partial)
        np.testing.assert_array_equal(np.asarray(manual.tokens), np.asarray(result.tokens))
        np.testing.assert_array_equal(np.asarray(manual.logprobs), np.asarray(result.logprobs))
        np.testing.assert_array_equal(np.asarray(manual_versions), np.asarray(version_bc))


def test_segments_reuse_one_compile_per_cache_width(setup):
    """A run of up to 5 segments (different step limits, a swap) compiles one decode segment per
    cache width (2: 16 and 32 new slots) and one swap per width swapped in; two more runs with
    swaps at other steps and another version number compile nothing. The controls are a fresh
    static variant (top_k on) so the count does not depend on which tests ran before. Catches
    the step limit, `version` or the step counter made static (a compile per segment or per
    version) and a donated state whose layout changes between segments."""
    params_a, params_b, *_ = setup
    controls = CONTROLS.replace(top_k=50)
    jits = (I._start_jit, I._segment_jit, I._swap_jit, I._widen_jit, I._finish_jit)
    before = [f._cache_size() for f in jits]
    _run(setup, [(params_a, 0), (params_a, 0), (params_b, 1)], controls)  # swap at step 6 (width 16)
    first = [f._cache_size() - b for f, b in zip(jits, before)]
    assert first[1] == len(D.decode_widths(controls.static(), 32, CONTROLS.max_new_tokens)) == 2 and first[2] == 1
    after = [f._cache_size() for f in jits]
    _run(setup, [(params_a, 0)] * 2 + [(params_b, 4)], controls)
    _run(setup, [(params_a, 0)] * 2 + [(params_a, 0), (params_b, 1)], controls)  # swap at step 11
    assert [f._cache_size() for f in jits] == after


def test_an_fp8_cache_survives_a_swap(setup):
    """With `kv_dtype = "fp8"`, a swap to the same params at step 6 (version 1) rebuilds the FP8
    cache decoding wrote (the prompt quantised as the prefill's, the generated tokens where the
    cached forward writes them): the tokens are those of the run without a swap and the log-probs
    within 1e-5 (measured 2.4e-6), while the FP8 cache itself moves them well off the model-dtype
    run's (by up to 3.3 nats here). Fails if the swap rebuilds the cache in the compute dtype
    (decoding then goes on without FP8), or if the start refuses FP8 or ignores it. (Without a
    swap this is `sample`'s static FP8 path: measured bitwise equal.)"""
    params_a, *_ = setup
    controls = CONTROLS.replace(kv_dtype="fp8")
    plain, _, swaps = _run(setup, [(params_a, 0)], controls)
    model_dtype, _, _ = _run(setup, [(params_a, 0)])
    assert swaps == 0
    both = np.asarray(plain.mask) & np.asarray(model_dtype.mask)
    assert np.abs(np.asarray(plain.logprobs) - np.asarray(model_dtype.logprobs))[both].max() > 0.01
    swapped, version_bc, swaps = _run(setup, [(params_a, 0)] * 2 + [(params_a, 1)], controls)
    assert swaps == 1 and (np.asarray(version_bc) == 1).any()
    np.testing.assert_array_equal(np.asarray(swapped.tokens), np.asarray(plain.tokens))
    drawn = np.asarray(plain.mask)
    np.testing.assert_allclose(np.asarray(swapped.logprobs)[drawn], np.asarray(plain.logprobs)[drawn], atol=1e-5,
                               rtol=0)


def test_fp8_weights_are_taken_at_each_version(setup):
    """`weight_dtype = "fp8"` with a swap from params A to B at step 6: bitwise the rollout of
    handing in A's and then B's FP8 sampler copy (`rljax.sampling.fp8.sampler_params`) by hand
    with the model dtype, and not the rollout of A and B as they are. Fails if the driver ignores
    `weight_dtype`, or takes the copy only once, at the first version (the tokens after the swap
    then come from A's copy or from B unquantised)."""
    params_a, params_b, *_ = setup
    copy = lambda p: sampler_params(p, "fp8")  # noqa: E731
    swapped, _, swaps = _run(setup, [(params_a, 0)] * 2 + [(params_b, 1)], CONTROLS.replace(weight_dtype="fp8"))
    by_hand, _, _ = _run(setup, [(copy(params_a), 0)] * 2 + [(copy(params_b), 1)])
    as_they_are, _, _ = _run(setup, [(params_a, 0)] * 2 + [(params_b, 1)])
    assert swaps == 1
    for name in ("tokens", "logprobs", "mask"):
        np.testing.assert_array_equal(np.asarray(getattr(swapped, name)), np.asarray(getattr(by_hand, name)), name)
    assert not np.array_equal(np.asarray(swapped.logprobs), np.asarray(as_they_are.logprobs))
