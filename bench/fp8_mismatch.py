"""Issue 48: the sampler-vs-trainer policy log-prob gap of each FP8 rollout form on CPU.

qwen2-test (std 0.02 init, f32 compute), 8 prompts x 2 samples x 32 new tokens (key 4): for each
(sampling.weight_dtype, sampling.kv_dtype) the sampler's log-probs against the f32 trainer's
(`rljax.models.token_logprobs`) on the sampled tokens, mean and max |difference| in nats. FP8 is
emulated by XLA:CPU (it upcasts float8 dots), so the numbers are the formats' rounding, not a
GPU's kernels. About a minute on a 2-core CPU.

    python bench/fp8_mismatch.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rljax.models as M
from rljax.sampling import SampleControls, generate

FORMS = [("model", "model"), ("fp8", "model"), ("fp8_w8a8", "model"), ("model", "fp8"), ("fp8_w8a8", "fp8")]


def main():
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(0), std=0.02)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (8, 8)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    for weight_dtype, kv_dtype in FORMS:
        controls = SampleControls(max_new_tokens=32, num_samples=2, temperature=1.0, weight_dtype=weight_dtype,
                                  kv_dtype=kv_dtype)
        res = generate(cfg, params, tokens, mask, key=jax.random.key(4), controls=controls)
        full = np.concatenate([np.repeat(tokens, 2, 0), np.asarray(res.tokens)], 1)
        full_mask = np.concatenate([np.repeat(mask, 2, 0), np.asarray(res.mask)], 1)
        trainer, _ = M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))
        diff = np.abs(np.asarray(res.logprobs) - np.asarray(trainer)[:, tokens.shape[1]:])[np.asarray(res.mask)]
        print(f"weights {weight_dtype:9s} kv {kv_dtype:6s}: mean {diff.mean():.2e} max {diff.max():.2e} nats "
              f"over {diff.size} tokens", flush=True)


if __name__ == "__main__":
    main()
