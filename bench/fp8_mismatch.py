"""Issue 48: the sampler-vs-trainer policy log-prob gap of each FP8 rollout form on CPU.

qwen2-test (std 0.02 init, f32 compute), 8 prompts x 2 samples x 32 new tokens (key 4): for each
(sampling.weight_dtype, sampling.kv_dtype) the sampler's log-probs against the f32 trainer's
(`rljax.models.token_logprobs`) on the sampled tokens, mean and max |difference| in nats. FP8 is
emulated by XLA:CPU (it upcasts float8 dots), so the numbers are the formats' rounding, not a
GPU's kernels. The FP8 KV forms run again with the continuous scheduler's two KV layouts (slots,
and paged with 8-token pages) on the same key, and the KV cache bytes per token of each layout
are counted from the buffers the loops carry (`jax.eval_shape`, no compute), bf16 vs FP8, for a
bf16 model of Qwen2.5-0.5B's attention shapes (24 layers, 2 kv heads, head_dim 64). About two
minutes on a 2-core CPU.

    python bench/fp8_mismatch.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rljax.models as M
from rljax.sampling import SampleControls, generate

FORMS = [("model", "model"), ("fp8", "model"), ("fp8_w8a8", "model"), ("model", "fp8"), ("fp8_w8a8", "fp8")]
LAYOUTS = {"static": {}, "slots": dict(scheduler="continuous", slots=8),
           "paged": dict(scheduler="continuous", kv_layout="paged", page_size=8, max_total_tokens=512, slots=8)}


def main():
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(0), std=0.02)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (8, 8)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    runs = [(w, kv, "static") for w, kv in FORMS] + [(w, kv, layout) for w, kv in FORMS if kv == "fp8"
                                                     for layout in ("slots", "paged")]
    for weight_dtype, kv_dtype, layout in runs:
        controls = SampleControls(max_new_tokens=32, num_samples=2, temperature=1.0, weight_dtype=weight_dtype,
                                  kv_dtype=kv_dtype, **LAYOUTS[layout])
        res = generate(cfg, params, tokens, mask, key=jax.random.key(4), controls=controls)
        full = np.concatenate([np.repeat(tokens, 2, 0), np.asarray(res.tokens)], 1)
        full_mask = np.concatenate([np.repeat(mask, 2, 0), np.asarray(res.mask)], 1)
        trainer, _ = M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))
        diff = np.abs(np.asarray(res.logprobs) - np.asarray(trainer)[:, tokens.shape[1]:])[np.asarray(res.mask)]
        print(f"{layout:6s} weights {weight_dtype:9s} kv {kv_dtype:6s}: mean {diff.mean():.2e} max {diff.max():.2e} "
              f"nats over {diff.size} tokens", flush=True)
    cache_bytes()


def cache_bytes():
    """KV bytes per cached token, per layout, of a bf16 model with Qwen2.5-0.5B's attention shapes."""
    from rljax.sampling import paged as PG
    from rljax.sampling.continuous import plan_layout
    from rljax.sampling.slots import empty_kv_layers, empty_pool

    cfg = M.preset("qwen2-test", compute_dtype="bfloat16").replace(num_layers=24, num_kv_heads=2, num_heads=14,
                                                                   head_dim=64)
    size = lambda build: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(build)))
    slots, width, prompts, prompt_len = 8, 640, 4, 128
    for kv_dtype in ("model", "fp8"):
        controls = SampleControls(max_new_tokens=512, scheduler="continuous", kv_layout="paged", page_size=16,
                                  max_total_tokens=8192, slots=slots)
        layout = plan_layout(controls, prompts, prompt_len)
        per_token = {
            "static/slots cache": size(lambda: empty_kv_layers(cfg, M.init_cache(cfg, slots, width)["layers"],
                                                               kv_dtype)) / (slots * width),
            "prompt pool": size(lambda: empty_pool(cfg, prompts, prompt_len, kv_dtype).layers) / (prompts * prompt_len),
            "paged pool": size(lambda: PG._empty_pages(cfg, layout, prompts, prompt_len, kv_dtype)[0])
            / (layout.num_pages * layout.page_size)}
        print(f"kv {kv_dtype:6s} bytes per token: " + ", ".join(f"{k} {v:.0f}" for k, v in per_token.items()),
              flush=True)


if __name__ == "__main__":
    main()
