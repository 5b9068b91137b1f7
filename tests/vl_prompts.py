"""Image prompts for the VL tests that need no torch: the tiny models' special tokens, left-padded
rows with image placeholders and random patches, and generated pictures behind text prompts."""

from __future__ import annotations

import jax.extend
import numpy as np

from rljax.data.vl_rows import visual_examples

IMAGE, START, END = 120, 118, 119
GRIDS = np.array([[1, 10, 14], [1, 6, 8]])  # two images of different sizes (t, h, w patches)


def left_padded(rows, dtype=np.int32):
    """(tokens, bool mask) of `rows` left-padded with 0 to the widest."""
    width = max(map(len, rows))
    tokens = np.array([[0] * (width - len(r)) + list(r) for r in rows], dtype)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], bool)
    return tokens, mask


def placeholder_batch():
    """Two left-padded rows, one image each (`GRIDS`), and their flattened random patches."""
    ph = lambda g: [START] + [IMAGE] * (int(np.prod(g)) // 4) + [END]  # noqa: E731
    tokens, mask = left_padded([[5, 9] + ph(GRIDS[0]) + [33, 7], [11] + ph(GRIDS[1]) + [3, 8, 60, 61, 62, 4, 12]],
                               np.int64)
    pixels = np.random.default_rng(0).standard_normal((int(GRIDS.prod(axis=1).sum()), 1176)).astype(np.float32)
    return tokens, mask, pixels


def visual_prompts(lengths=(5, 3, 4), size: int = 84):
    """(examples, tokens, mask): generated "count" pictures behind random text prompts of `lengths`
    tokens (so the images start at different positions)."""
    examples = visual_examples("count", "train", len(lengths), size=size)
    rng = np.random.default_rng(0)
    return (examples, *left_padded([list(rng.integers(4, 100, k)) for k in lengths]))


def tower_rows(jaxpr, patch_dim: int) -> list[int]:
    """Row counts of every matmul in `jaxpr` (nested jaxprs too) whose operand has `patch_dim`
    columns: the patch embedding, so the patches the tower encodes."""
    rows = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and eqn.invars[0].aval.shape[-1] == patch_dim:
            rows.append(eqn.invars[0].aval.shape[0])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            rows += tower_rows(sub, patch_dim)
    return rows


def sampler_inputs(cfg, new_slots: int = 16):
    """(tokens, mask, VLInputs) of `placeholder_batch` for a sampler: prompts padded to its bucket,
    patches to their bucket, M-RoPE tables over the prompt plus `new_slots`."""
    from rljax.models.vlm import prepare_inputs
    from rljax.sampling.sampler import pad_prompts
    from rljax.sampling.vision import patch_bucket

    tokens, mask, pixels = placeholder_batch()
    tokens, mask = pad_prompts(cfg.text, tokens, mask)
    inputs = prepare_inputs(cfg, tokens, mask, pixels, GRIDS, num_positions=tokens.shape[1] + new_slots,
                            num_patches=patch_bucket(len(pixels)))
    return tokens, mask, inputs
