"""The paged KV layout (`rljax.sampling.paged`): the slot layout's and the static sampler's tokens,
with pages shared by a prompt's samples, preemption when they run out, and no page leaked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.models as M
from rljax.errors import ConfigError
from rljax.sampling import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, SampleControls, generate
from rljax.sampling import continuous as C
from rljax.sampling import paged as PG

FIELDS = ("tokens", "logprobs", "sampling_logprobs", "mask", "lengths", "finish_reason")
NEW = 40  # new-token bucket 64


def _ragged(seed, lengths, width, vocab):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (len(lengths), width)).astype(np.int32)
    mask = np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]
    return np.where(mask, tokens, 0), mask


# The prompts and controls of tests/sampling/test_continuous.py, so the static reference is the same program
# (a hit in the suite's XLA cache when both files run).
PROMPT_LENS = [6, 9, 3, 1, 7]
PROMPTS = _ragged(0, PROMPT_LENS, 9, 128)
CONTROLS = SampleControls(max_new_tokens=NEW, num_samples=3, temperature=1.0, top_k=50, eos_ids=(3, 7),
                          stop_sequences=((11,), (20, 30)), pad_id=0)
TIGHT = dict(page_size=4, max_total_tokens=100, slots=6)  # 25 pages; one row alone needs 20
ROOMY = dict(page_size=2, max_total_tokens=2048, slots=16, refill_batch=16)  # every row admitted at once


@pytest.fixture(scope="module")
def tiny():
    cfg = M.preset("qwen2-test")
    return cfg, M.init_params(cfg, jax.random.key(0), std=0.2)


@pytest.fixture(scope="module")
def static(tiny):
    cfg, params = tiny
    return generate(cfg, params, *PROMPTS, key=jax.random.key(5), controls=CONTROLS.replace(batch_invariant=True))


def _paged(tiny, **changes):
    cfg, params = tiny
    controls = CONTROLS.replace(scheduler="continuous", kv_layout="paged", **changes)
    return generate(cfg, params, *PROMPTS, key=jax.random.key(5), controls=controls)


@pytest.fixture(scope="module")
def tight(tiny):
    return _paged(tiny, batch_invariant=True, **TIGHT)


@pytest.fixture(scope="module")
def roomy(tiny):
    return _paged(tiny, **ROOMY)


def test_paged_equals_static_bitwise_through_preemption(static, tight):
    """Batch-invariant paged decoding, with a pool of 25 pages of 4 tokens for 6 slots (a row of
    prompt bucket 16 + new-token bucket 64 alone needs 20), preempts rows and still gives bitwise
    the static sampler's (and so the slot layout's) tokens, log-probs, masks, lengths and finish
    reasons, sampled, on ragged prompts ending by EOS, stop sequence and length. Every page is
    free at the end and the peak stays within the pool.
    Catches: a gathered view that puts a key at another slot or position than the slot layout, a
    fed token written to the wrong page or offset, prompt padding copied into the pages, a
    preempted row resumed instead of restarted, a preempted row never re-admitted, pages leaked
    by preemption or by rows that end."""
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(tight, field)), np.asarray(getattr(static, field)),
                                      err_msg=field)
    assert set(np.asarray(static.finish_reason).tolist()) == {FINISH_EOS, FINISH_STOP, FINISH_LENGTH}
    pages = TIGHT["max_total_tokens"] // TIGHT["page_size"]
    assert int(tight.preemptions) > 0
    assert int(tight.free_pages) == pages and 0 < int(tight.peak_pages) <= pages


def _peaks(lengths_r, page: int, n: int):
    """(paged peak, peak without sharing) when every row is admitted in the first step: at decode
    step t a running row (length > t) holds ceil((prompt + t) / page) pages, of which its
    prompt's floor(prompt / page) full pages are shared by the prompt's running rows; admission
    holds the full pages of every prompt plus each row's partial prompt page."""
    plen_r = np.repeat(PROMPT_LENS, n)
    full_r = plen_r // page
    group_r = np.arange(len(plen_r)) // n
    admit = sum(full_r[::n]) + int((plen_r % page > 0).sum())
    shared, unshared = [admit], [int(np.ceil(plen_r / page).sum())]
    for t in range(1, int(lengths_r.max())):
        alive = lengths_r > t
        held = -(-(plen_r + t) // page)
        groups = np.unique(group_r[alive])
        shared.append(int(full_r[::n][groups].sum() + (held - full_r)[alive].sum()))
        unshared.append(int(held[alive].sum()))
    return max(shared), max(unshared)


def test_prompt_pages_shared_and_counted(static, roomy):
    """With room for every row at once (16 slots, 16 admitted per step, pages of 2 tokens), the
    default (not batch-invariant) mode gives the static tokens and log-probs to f32 rounding
    (XLA:CPU matmul kernels depend on the row count), preempts nothing, frees every page, and its
    peak equals the page count computed from the lengths with a prompt's full pages shared by its
    samples, below the count without sharing.
    Catches: full prompt pages copied per row instead of shared, shared pages freed while a
    sample still runs or never freed, a page taken before the length crosses a page boundary or
    a second time, the partial prompt page shared (copy on write missing: tokens would change)."""
    for field in ("tokens", "mask", "lengths", "finish_reason"):
        np.testing.assert_array_equal(np.asarray(getattr(roomy, field)), np.asarray(getattr(static, field)),
                                      err_msg=field)
    np.testing.assert_allclose(np.asarray(roomy.logprobs), np.asarray(static.logprobs), atol=1e-5, rtol=0)
    shared, unshared = _peaks(np.asarray(static.lengths), ROOMY["page_size"], CONTROLS.num_samples)
    assert int(roomy.preemptions) == 0
    assert int(roomy.free_pages) == ROOMY["max_total_tokens"] // ROOMY["page_size"]
    assert int(roomy.peak_pages) == shared < unshared


def test_tpu_kernel_step_matches_gather_step_in_interpret_mode(tiny):
    """The TPU decode step (`kernel_forward`: each layer writes the fed token into its page and
    attends with JAX's Pallas paged-attention kernel through the model's `kv_attend` hook), run on
    CPU in TPU interpret mode, matches the CPU/GPU step (`gather_forward`) on 3 rows with prompts
    of 3, 10 and 16 tokens at positions 5, 17 and 30 over shuffled pages of 4 tokens: logits
    within 5e-2 of values up to 4 (measured 1.8e-2: the interpreter rounds matmuls like the TPU's
    default precision), the first layer's written pages to 1e-6, while the gather over a shifted
    page table is 4 away.
    Catches: the kernel's query left unscaled, lengths that miss the fed token, the fed token
    written to another page or offset than the gather path reads, pages in another layout."""
    from jax.experimental.pallas import tpu as pltpu

    cfg, params = tiny
    layer_params = M.unstack_layers(params)
    rng = np.random.default_rng(0)
    page, pages, prompt_len, width = 4, 24, 16, 32
    shape = (cfg.num_kv_heads, pages, page, cfg.head_dim)
    kv = tuple({name: jnp.asarray(0.5 * rng.normal(size=shape), jnp.float32) for name in "kv"}
               for _ in range(cfg.num_layers))
    zero_s, zero = jnp.zeros((3,), jnp.int32), jnp.zeros((), jnp.int32)

    def page_table(table):
        return PG.PageTable(table_sk=jnp.asarray(table.reshape(3, 8), jnp.int32), shared_s=zero_s, held_s=zero_s,
                            prompt_s=zero_s, prompt_len_s=jnp.asarray([3, 10, 16], jnp.int32), order_s=zero_s,
                            group_pages_gk=jnp.zeros((1, 4), jnp.int32), refs_g=jnp.zeros((1,), jnp.int32),
                            stack_p=jnp.arange(pages, dtype=jnp.int32), free=zero, admitted=zero, peak=zero,
                            preemptions=zero)

    table = rng.permutation(pages)
    step = (jnp.asarray([5, 17, 99], jnp.int32), jnp.asarray([5, 17, 30], jnp.int32), jnp.ones((3,), bool))
    rope = M.rope_table(cfg, width)
    gather = jax.jit(lambda kv, pt: PG.gather_forward(cfg, layer_params, *step, kv, pt, rope, prompt_len=prompt_len,
                                                      width=width, page_size=page, num_pages=pages,
                                                      batch_invariant=False))
    with pltpu.force_tpu_interpret_mode():
        got_logits, got_kv = jax.jit(lambda kv, pt: PG.kernel_forward(
            cfg, layer_params, *step, kv, pt, rope, page_size=page, num_pages=pages))(kv, page_table(table))
    want_logits, want_kv = gather(kv, page_table(table))
    shifted_logits, _ = gather(kv, page_table(np.roll(table, 1)))
    got_logits, want_logits = np.asarray(got_logits), np.asarray(want_logits)
    assert np.abs(got_logits - want_logits).max() < 5e-2 < 1 < np.abs(got_logits - np.asarray(shifted_logits)).max()
    for name in "kv":
        np.testing.assert_allclose(np.asarray(got_kv[0][name]), np.asarray(want_kv[0][name]), atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(got_kv[1][name]), np.asarray(want_kv[1][name]), atol=5e-2, rtol=0)


def test_paged_controls_and_layout():
    """The paged layout's controls are one-line errors when wrong (unknown layout, page size 0,
    without the continuous scheduler, without a token budget, with in-loop prefill, a budget below
    one row), and its slots are not capped by the budget: pages are taken as rows grow.
    Catches: a paged run silently falling back to slots, a zero-page pool, slots sized from the
    budget as the slot layout does."""
    base = SampleControls(max_new_tokens=100, num_samples=8, scheduler="continuous")
    cases = [(dict(kv_layout="pages"), "kv_layout must be one of slots, paged, got 'pages'"),
             (dict(kv_layout="paged", max_total_tokens=4096, page_size=0), "page_size must be >= 1"),
             (dict(kv_layout="paged", max_total_tokens=4096, scheduler="static"), "needs scheduler='continuous'"),
             (dict(kv_layout="paged"), "set max_total_tokens"),
             (dict(kv_layout="paged", max_total_tokens=4096, prefill_batch=4), "set prefill_batch = 0")]
    for changes, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            base.replace(**changes)
        assert "\n" not in str(err.value)
    paged = base.replace(kv_layout="paged", max_total_tokens=4096)
    layout = C.plan_layout(paged, 64, 64)
    assert (layout.slots, layout.num_pages, layout.page_size) == (64, 256, 16)
    assert C.plan_layout(paged.replace(kv_layout="slots"), 64, 64).slots == 4096 // (64 + 128)
    with pytest.raises(ConfigError, match=r"holds 11 pages of 16 tokens.*needs 12; raise it to at least 192$"):
        C.plan_layout(paged.replace(max_total_tokens=180), 64, 64)
