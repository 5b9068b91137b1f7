"""Long rollouts (issue 50): an 8,192-token response through the paged sampler
(`rljax.sampling.paged`) on a tiny model with positions for prompt + 8,192, in a page pool sized
by page arithmetic, with the trainer's scoring (query-chunked reference attention past 2,048
tokens) as the log-prob reference. 16k-32k rows are for bench/, not the suite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rljax.models as M
from rljax.models.attention import QUERY_CHUNK
from rljax.sampling import FINISH_LENGTH, SampleControls, generate

NEW = 8192
PAGE = 256
PROMPT_LENS = (1, 2)  # real tokens: 1 + 8,191 stored tokens fill 32 pages exactly, 2 + 8,191 spill into a 33rd
CFG = M.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, qkv_bias=True, max_positions=16 + NEW)


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def test_8k_response_in_bounded_pages_equals_trainer_logprobs():
    """Two rows of 1 and 2 prompt tokens each decode 8,192 new tokens (no EOS id: both reach the
    budget) in a pool of 66 pages of 256 tokens (33 per row: the layout's need for one row of
    the prompt bucket + 8,192). Checks, in f32:
    - finish reason "length" and 8,192 tokens in both rows;
    - the peak pages equal the page arithmetic: both rows are admitted in the first step and run to
      the end together (with one admission per step the second row's last page would come after
      the first row's pages are back: 64), and a row stores
      its prompt and every fed token (all but the last drawn), so it holds
      ceil((prompt + 8,191) / 256) pages: 32 + 33 = 65; no preemption; every page free at the end;
    - the sampler's log-probs equal the trainer's `token_logprobs` on prompt + response within
      1e-5 at every one of the 16,384 tokens, the trainer attending in 2,048-query chunks, whose
      compiled scoring program holds less than one [B, N, T, T] f32 score matrix.
    Catches: a page taken per token, one token early or for the last drawn token (66 instead of
    65), pages of a finished row not handed back (free < pool), a row cut before the budget or
    marked EOS, a position, page or offset wrong past the first pages or past 2,048 tokens, or
    two rows' pages overlapping (log-probs differ), a trainer that builds [T, T] scores for long
    rows. About 35 s of CPU at -O0, most of it the 8,192 paged decode steps (each gathers the
    row's pages into an 8k-wide view on CPU) and the 8k-token scoring pass."""
    rng = np.random.default_rng(0)
    width = max(PROMPT_LENS)
    mask = np.arange(width)[None, :] >= width - np.asarray(PROMPT_LENS)[:, None]
    tokens = np.where(mask, rng.integers(1, CFG.vocab_size, (len(PROMPT_LENS), width)), 0).astype(np.int32)
    params = M.init_params(CFG, jax.random.key(0), std=0.2)
    pool = 2 * _pages(8 + NEW)  # the layout's need for one row (prompt bucket 8 + 8,192), twice
    controls = SampleControls(max_new_tokens=NEW, temperature=1.0, eos_ids=(), pad_id=0, scheduler="continuous",
                              kv_layout="paged", page_size=PAGE, max_total_tokens=pool * PAGE, slots=2,
                              refill_batch=2)  # both rows admitted in the first step
    res = jax.device_get(generate(CFG, params, tokens, mask, key=jax.random.key(1), controls=controls))

    assert (res.finish_reason == FINISH_LENGTH).all() and (res.lengths == NEW).all() and res.mask.all()
    assert int(res.preemptions) == 0 and int(res.free_pages) == pool
    assert int(res.peak_pages) == sum(_pages(p + NEW - 1) for p in PROMPT_LENS) == 65

    full = jnp.asarray(np.concatenate([tokens, res.tokens], 1))
    full_mask = jnp.asarray(np.concatenate([mask, res.mask], 1))
    score = jax.jit(lambda p, t, m: M.token_logprobs(CFG, p, t, m)[0]).lower(params, full, full_mask).compile()
    b, t = full.shape
    assert t > QUERY_CHUNK and score.memory_analysis().temp_size_in_bytes < b * CFG.num_heads * t * t * 4
    logp = np.asarray(score(params, full, full_mask))[:, width:]
    np.testing.assert_allclose(res.logprobs, logp, atol=1e-5, rtol=0)
