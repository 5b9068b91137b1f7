"""The bf16 sampler/trainer log-prob gap on a model bigger than the test model's: 8 layers, width
512, Qwen2-shaped, 8 prompts x 4 samples x 64 new tokens (ragged left padding), f32 and bf16
params, two vocabularies. The gap is |sampler log-prob - trainer log-prob| of each sampled token,
in nats (`rljax.models.scoring` explains where it comes from and states the bound).

    .venv/bin/python bench/bf16_agreement.py      # writes bench/results/bf16_agreement.json
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

import rljax.models as M
from rljax.sampling import SampleControls, generate

SHAPES = {"qwen2-small (V 4096, untied)": {}, "qwen2-small (V 512, tied)": dict(vocab_size=512, tie_embeddings=True)}


def gap(cfg, b=8, p=16, n=4, new=64) -> dict:
    params = M.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (b, p)).astype(np.int32)
    mask = np.ones((b, p), bool)
    for i, pad in enumerate((0, 3, 5, 1, 0, 7, 2, 4)[:b]):
        mask[i, :pad], tokens[i, :pad] = False, 0
    res = generate(cfg, params, tokens, mask, key=jax.random.key(1),
                   controls=SampleControls(max_new_tokens=new, num_samples=n))
    full = np.concatenate([np.repeat(tokens, n, 0), np.asarray(res.tokens)], 1)
    full_mask = np.concatenate([np.repeat(mask, n, 0), np.asarray(res.mask)], 1)
    logp, _ = M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))
    sel = np.asarray(res.mask)
    d = np.abs(np.asarray(res.logprobs)[sel] - np.asarray(logp)[:, p:][sel])
    return {"max": float(d.max()), "mean": float(d.mean()), "frac_over_1e-5": float((d > 1e-5).mean()),
            "tokens": int(sel.sum())}


def main():
    rows = {}
    for name, kw in SHAPES.items():
        for param_dtype in ("float32", "bfloat16"):
            cfg = M.preset("qwen2-small", compute_dtype="bfloat16", param_dtype=param_dtype, **kw)
            rows[f"{name} / {param_dtype} params"] = row = gap(cfg)
            print(f"{name} / {param_dtype} params: {json.dumps(row)}", flush=True)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                       "load": os.getloadavg()},
           "versions": {"python": sys.version.split()[0], "jax": jax.__version__},
           "setup": "8 layers, hidden 512, 8 heads / 4 kv, bf16 compute; 8 prompts x 4 samples x 64 tokens",
           "rows": rows}
    path = os.path.join(os.path.dirname(__file__), "results", "bf16_agreement.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
