"""The static decode loop (`rljax.sampling.decode`): decoding in chunks of steps changes nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import rljax.models as M
from rljax.sampling import SampleControls, generate


@pytest.mark.parametrize("chunk", [5])
def test_chunked_decode_equals_step_by_step(chunk):
    """`decode_chunk` = 5 (whole chunks, then a tail of < 5 steps run one at a time, in each phase) gives
    bitwise the tokens, both log-probs, masks, lengths and finish reasons of the step-by-step loop,
    on ragged prompts whose rows end by EOS at scattered steps inside chunks, across the CPU's three
    decode phases (max_new_tokens 40: widths 16, 32, 64). Catches a chunk that steps past the phase
    width or max_new_tokens (a column or cache slot clamped and overwritten), rows that keep
    counting length after EOS inside a chunk, a tail step dropped."""
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(0), std=0.2)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, cfg.vocab_size, (3, 8)).astype(np.int32)
    mask = np.arange(8)[None, :] >= 8 - np.asarray([8, 5, 2])[:, None]
    controls = SampleControls(max_new_tokens=40, num_samples=2, temperature=1.0, top_k=50, eos_ids=(3, 7))
    want = generate(cfg, params, tokens, mask, key=jax.random.key(5), controls=controls)
    got = generate(cfg, params, tokens, mask, key=jax.random.key(5), controls=controls.replace(decode_chunk=chunk))
    lengths = np.asarray(want.lengths)
    assert len(set(lengths.tolist())) >= 3 and lengths.max() > 32  # EOS at several steps; the third phase runs
    for field in ("tokens", "logprobs", "sampling_logprobs", "mask", "lengths", "finish_reason", "live_row_steps"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), field)
    assert int(got.decode_steps) >= int(want.decode_steps)
