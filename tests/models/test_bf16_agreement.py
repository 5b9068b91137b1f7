"""bf16: the sampler's policy log-probs agree with the trainer's, and the logged mismatch is true.

The sampler (prefill + KV-cached decode steps) and the trainer (one teacher-forced forward) run
different programs whose reductions differ in the last f32 bits; `rljax.models.hidden_states`
keeps the residual stream in f32 so those bits rarely reach a bf16 rounding (see its docstring
and the bound in `rljax.models.scoring`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.models as M
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.sampling import SampleControls, generate
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update_step

# The stated bound, in nats over completion tokens, for bf16 compute (scoring.py's docstring).
MAX_GAP = 2e-3
MEAN_GAP = 1e-4


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_bf16_sampler_logprobs_equal_trainer_scoring_within_bound(param_dtype):
    """A 4-layer model in bf16 compute (f32 and bf16 params): the sampler's log-probs of its own
    draws equal token_logprobs on prompt + completion to MAX_GAP (max) and MEAN_GAP (mean).

    Measured here (384 tokens; the same with LLVM -O0 and -O2 kernels): max 1.5e-3 / mean 4.2e-5
    with f32 params (19% of tokens differ by more than 1e-5: a last-bit difference reached a bf16
    rounding), max 3.2e-5 / mean 1.3e-7 with bf16 params. Catches an all-bf16 residual stream
    (every norm, residual add and matmul result rounded to bf16, the code before issue 17: mean
    6.9e-4, 99% of tokens over 1e-5, max 3.1e-3) and a sampler that scores with different
    numerics than the trainer (e.g. logits in bf16)."""
    cfg = M.preset("qwen2-test", num_layers=4, compute_dtype="bfloat16", param_dtype=param_dtype)
    params = M.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    b, p, n, new = 4, 12, 2, 48
    tokens = rng.integers(0, cfg.vocab_size, (b, p)).astype(np.int32)
    mask = np.ones((b, p), bool)
    for i, pad in enumerate((0, 3, 5, 1)):  # ragged left padding
        mask[i, :pad], tokens[i, :pad] = False, 0
    res = generate(cfg, params, tokens, mask, key=jax.random.key(1),
                   controls=SampleControls(max_new_tokens=new, num_samples=n))
    full = np.concatenate([np.repeat(tokens, n, 0), np.asarray(res.tokens)], 1)
    full_mask = np.concatenate([np.repeat(mask, n, 0), np.asarray(res.mask)], 1)
    logp, _ = M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))
    sel = np.asarray(res.mask)
    assert sel.sum() == b * n * new
    gap = np.abs(np.asarray(res.logprobs)[sel] - np.asarray(logp)[:, p:][sel])
    assert gap.max() <= MAX_GAP, gap.max()
    assert gap.mean() <= MEAN_GAP, gap.mean()
    assert (gap > 1e-5).mean() <= 0.3  # most tokens agree to f32 rounding


def _rollout_batch(cfg, params, noise: float, seed: int = 0) -> RolloutBatch:
    """8 rows (2 prompts x 4), prompt 4 + completion 8, ragged completion masks; the "sampler"
    log-probs are the trainer's plus `noise` x N(0, 1) on the completion tokens (a visible gap)."""
    rng = np.random.default_rng(seed)
    b, t, prompt = 8, 12, 4
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    attn = np.ones((b, t), bool)
    loss = np.zeros((b, t), bool)
    for i, length in enumerate(rng.integers(2, t - prompt + 1, b)):
        loss[i, prompt:prompt + length] = True
    logp, _ = M.token_logprobs(cfg, params, toks, jnp.asarray(attn))
    sampler = np.where(loss, np.asarray(logp) + noise * rng.standard_normal((b, t)), 0.0).astype(np.float32)
    return RolloutBatch(tokens_bt=toks, attn_mask_bt=jnp.asarray(attn), loss_mask_bt=jnp.asarray(loss),
                        sampler_logp_bt=jnp.asarray(sampler), rewards_b=jnp.asarray(rng.random(b), jnp.float32),
                        group_ids_b=prompt_major_group_ids(b, 4), completion_len=t - prompt)


@pytest.mark.parametrize("recompute", [False, True])
def test_logged_mismatch_equals_independent_recomputation(recompute):
    """`update/logp_diff_mean|max` equal NumPy's mean and max of |token_logprobs(pre-update params)
    - sampler_logp| over the loss mask, recompute on and off; `update/ratio_first_min|max` are
    exp of that difference's min and max when the loss starts from the sampler's log-probs, and 1
    (to f32 rounding) when it starts from the trainer's own.

    Two epochs and two micro-batches, so the update's own `logp_diff/abs_max` (every optimiser
    step) differs from the first mini-batch's. Catches: reporting the whole update's log-prob
    change instead of the first mini-batch's, only the first micro-batch's share, a mean over
    padding, params after the update, and the ratio of the wrong sign (sampler / trainer)."""
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(0))
    batch = _rollout_batch(cfg, params, noise=0.3)
    logp, _ = M.token_logprobs(cfg, params, batch.tokens_bt, batch.attn_mask_bt)
    mask = np.asarray(batch.loss_mask_bt)
    diff = (np.asarray(logp, np.float64) - np.asarray(batch.sampler_logp_bt, np.float64))[mask]

    algo = AlgorithmConfig(algorithm="grpo", recompute_old_logp=recompute)
    state = init_train_state(cfg, params, algo, OptimConfig(learning_rate=1e-2),
                             update_cfg=UpdateConfig(num_epochs=2, num_microbatches=2))
    _, m = update_step(state, batch, jax.random.key(0))
    np.testing.assert_allclose(float(m["update/logp_diff_mean"]), np.abs(diff).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["update/logp_diff_max"]), np.abs(diff).max(), rtol=1e-5)
    assert float(m["logp_diff/abs_max"]) > np.abs(diff).max() + 1e-3  # the whole update moved further
    if recompute:
        assert abs(float(m["update/ratio_first_min"]) - 1) < 1e-5
        assert abs(float(m["update/ratio_first_max"]) - 1) < 1e-5
    else:
        np.testing.assert_allclose(float(m["update/ratio_first_min"]), np.exp(diff.min()), rtol=1e-5)
        np.testing.assert_allclose(float(m["update/ratio_first_max"]), np.exp(diff.max()), rtol=1e-5)
