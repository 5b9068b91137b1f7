"""Issue 51: what each rollout correction removes on bf16 and FP8 rollouts (docs/stability.md's evidence).

For each sampler form (bf16 compute, FP8 weight-only emulated, FP8 W8A8, W8A8 + FP8 KV cache)
a qwen2-test model (`--std` init: 0.02 is a flat, near-uniform policy; 0.2 a sharp one, as in
tests/sampling/test_fp8.py) samples 16 prompts x 4 samples x 32 tokens at temperature 1; the f32
trainer scores the same tokens (`rljax.models.token_logprobs`), and every registered correction
is applied at its defaults to the pair (k = pi_trainer / mu_sampler): the share of completion
tokens given weight 0 or dropped (tis: the share truncated at its cap), and for seq_reject the
share of rows rejected. FP8 is emulated by XLA:CPU, so the numbers are the formats' rounding, not
a GPU kernel's. About a minute on a 2-core CPU.

    python bench/correction_shares.py [--std 0.2]
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import rljax.models as M
from rljax.objectives import OFF_POLICY
from rljax.sampling import SampleControls, generate

FORMS = {"bf16 compute": dict(), "fp8 weights": dict(weight_dtype="fp8"),
         "fp8 W8A8": dict(weight_dtype="fp8_w8a8"), "W8A8 + fp8 KV": dict(weight_dtype="fp8_w8a8", kv_dtype="fp8")}


def removed(name, trainer, sampler, mask):
    """The share of valid tokens a correction zeroes or drops (tis: truncates), and of rows it rejects."""
    w, m = (np.asarray(x) for x in OFF_POLICY.get(name)(jnp.asarray(trainer), jnp.asarray(sampler),
                                                          jnp.asarray(mask)))
    on = mask > 0
    gone = (m == 0) | (w == 0) if name != "tis" else w < np.exp(trainer - sampler) - 1e-6
    rows = on.any(1)
    return float((gone & on).sum() / on.sum()), float(((m == 0) | ~on).all(1)[rows].mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--std", type=float, default=0.2)
    args = ap.parse_args()
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(0), std=args.std)
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (16, 8)).astype(np.int32)
    pmask = np.ones_like(prompts, bool)
    out = {"std": args.std, "forms": {}}
    names = [n for n in ("tis", "mis", "icepop", "seq_reject", "mask_kl") if n in OFF_POLICY.names()]
    for form, kw in FORMS.items():
        scfg = cfg.replace(compute_dtype="bfloat16") if form == "bf16 compute" else cfg
        controls = SampleControls(max_new_tokens=32, num_samples=4, temperature=1.0, **kw)
        res = generate(scfg, params, prompts, pmask, key=jax.random.key(4), controls=controls)
        full = np.concatenate([np.repeat(prompts, 4, 0), np.asarray(res.tokens)], 1)
        full_mask = np.concatenate([np.repeat(pmask, 4, 0), np.asarray(res.mask)], 1)
        trainer = np.asarray(M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))[0])
        trainer = trainer[:, prompts.shape[1]:]
        mask = np.asarray(res.mask).astype(np.float32)
        sampler = np.where(mask > 0, np.asarray(res.logprobs), 0.0)
        trainer = np.where(mask > 0, trainer, 0.0)
        gap = np.abs(trainer - sampler)[mask > 0]
        row = {"gap_mean": float(gap.mean()), "gap_max": float(gap.max()), "tokens": int(mask.sum())}
        row.update({n: dict(zip(("tokens_removed", "rows_rejected"), removed(n, trainer, sampler, mask)))
                    for n in names})
        out["forms"][form] = row
        print(f"{form:14s} |gap| mean {row['gap_mean']:.2e} max {row['gap_max']:.2e} | " + ", ".join(
            f"{n} {row[n]['tokens_removed']:.2%} tok / {row[n]['rows_rejected']:.1%} rows" for n in names), flush=True)
    path = os.path.join(os.path.dirname(__file__), "results", f"correction_shares_std{args.std}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
