"""Vision tower cost per rollout: encode each prompt's image once (rljax) against once per sample.

For B image prompts and n samples each, `rljax.sampling.vision.sample_static_vl` runs the tower
over the B prompts' patches and repeats the prefill cache for the samples. A pipeline that treats
the n samples as n independent prompts (what a sampler without prefix sharing does) encodes every
image n times and prefills n times. This script compiles both on the same model and reports XLA's
`cost_analysis` FLOPs and the wall time of the compiled rollout (median of `--repeats`).

    python bench/vl_tower_cost.py [--samples 1 4 8] [--vision-depth 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from rljax.models import preset
from rljax.models.vision import VisionConfig
from rljax.models.vlm import VLConfig, init_vl_params, prepare_inputs
from rljax.sampling import SampleControls
from rljax.sampling import decode as D
from rljax.sampling.sampler import pad_prompts
from rljax.sampling.vision import patch_bucket, sample_static_vl

IMAGE, START, END = 120, 118, 119
GRIDS = np.array([[1, 16, 16], [1, 12, 20]])


def build(depth: int):
    text = preset("qwen2-test", vocab_size=128, tie_embeddings=False)
    vision = VisionConfig(depth=depth, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=64,
                          window_size=112, fullatt_block_indexes=tuple(range(3, depth, 4)))
    cfg = VLConfig(text=text, vision=vision, image_token_id=IMAGE, vision_start_token_id=START,
                   vision_end_token_id=END, video_token_id=121, mrope_section=(2, 3, 3))
    return cfg, init_vl_params(cfg, jax.random.key(0), std=0.2)


def prompts(grids, repeat: int):
    ph = lambda g: [START] + [IMAGE] * (int(np.prod(g)) // 4) + [END]
    rows = [[5, 9] + ph(g) + [33, 7, 2] for g in grids for _ in range(repeat)]
    width = max(map(len, rows))
    tokens = np.array([[0] * (width - len(r)) + r for r in rows])
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], bool)
    return tokens, mask


def compiled(cfg, params, grids, prompt_repeat: int, num_samples: int, new_tokens: int = 16):
    """(compiled rollout, its args) for the prompts repeated `prompt_repeat` times, n samples each."""
    rng = np.random.default_rng(0)
    tokens, mask = prompts(grids, prompt_repeat)
    tokens, mask = pad_prompts(cfg.text, tokens, mask)
    all_grids = np.repeat(grids, prompt_repeat, axis=0)
    pixels = rng.standard_normal((int(all_grids.prod(axis=1).sum()), cfg.vision.patch_dim)).astype(np.float32)
    new_bucket = D.bucket_length(new_tokens)
    inputs = prepare_inputs(cfg, tokens, mask, pixels, all_grids, num_positions=tokens.shape[1] + new_bucket,
                            num_patches=patch_bucket(len(pixels)))
    controls = SampleControls(max_new_tokens=new_tokens, num_samples=num_samples, temperature=1.0)
    fn = jax.jit(lambda p, i, k: sample_static_vl(cfg, p, tokens, mask, i, k, np.int32(new_tokens), controls.scalars(),
                                                  np.int32(tokens.shape[0] * num_samples), spec=controls.static(),
                                                  num_samples=num_samples, new_bucket=new_bucket))
    return fn.lower(params, inputs, jax.random.key(1)).compile(), (params, inputs, jax.random.key(1))


def measure(exe, args, repeats: int):
    jax.block_until_ready(exe(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*args))
        times.append(time.perf_counter() - t0)
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", float("nan"))), statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--vision-depth", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg, params = build(args.vision_depth)
    print(f"backend={jax.default_backend()} prompts={len(GRIDS)} patches/prompt={GRIDS.prod(axis=1).tolist()} "
          f"vision depth={args.vision_depth}")
    print("n  | once per prompt: GFLOP, s | once per sample: GFLOP, s | FLOP ratio | time ratio")
    for n in args.samples:
        once = measure(*compiled(cfg, params, GRIDS, 1, n), args.repeats)
        per_sample = measure(*compiled(cfg, params, GRIDS, n, 1), args.repeats)
        print(f"{n:<3}| {once[0] / 1e9:8.3f}, {once[1]:.3f}     | {per_sample[0] / 1e9:8.3f}, {per_sample[1]:.3f}      "
              f"| {per_sample[0] / once[0]:.2f}x      | {per_sample[1] / once[1]:.2f}x")


if __name__ == "__main__":
    main()
