"""Tiny random-init Qwen2.5-VL checkpoints and image prompts, built in the test process.

The tower's window is 56 px = 2 merged patches per side; the test images are 10 x 14 and 6 x 8
patches (5 x 7 and 3 x 4 merged), so windows are cut short at the right and bottom edges and an
image spans several windows per side (a window index that ignores the edges, or treats an image
as one window, changes the logits)."""

from __future__ import annotations

import numpy as np
import torch
import transformers

IMAGE, VIDEO, START, END = 120, 121, 118, 119
GRIDS = np.array([[1, 10, 14], [1, 6, 8]])


def vl_config(windowed: bool = True):
    vision = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, out_hidden_size=64, in_channels=3,
                  fullatt_block_indexes=[1, 3] if windowed else [0, 1, 2, 3])
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    return transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                                         video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def make_vl_checkpoint(path, windowed: bool = True, seed: int = 0):
    """Saves a random-init Qwen2_5_VLForConditionalGeneration (norms and biases randomised too)."""
    torch.manual_seed(seed)
    cfg = vl_config(windowed)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif "visual" in name:
                p.mul_(5.0)  # the default std is tiny for a 32-wide tower: make its attention matter
    model.save_pretrained(path)
    return model


def placeholder(grid) -> list[int]:
    t, h, w = (int(x) for x in grid)
    return [START] + [IMAGE] * (t * h * w // 4) + [END]


def left_pad(rows: list[list[int]], pad: int = 0):
    width = max(len(r) for r in rows)
    tokens = np.array([[pad] * (width - len(r)) + r for r in rows], np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int64)
    return tokens, mask


def image_batch(seed: int = 0):
    """Two left-padded rows, one image each (of different sizes), and their flattened patches."""
    rng = np.random.default_rng(seed)
    rows = [[5, 9, 17] + placeholder(GRIDS[0]) + [33, 7, 2, 40],
            [11] + placeholder(GRIDS[1]) + [3, 8, 60, 61, 62, 4, 12, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100]]
    tokens, mask = left_pad(rows)
    pixels = rng.standard_normal((int(GRIDS.prod(axis=1).sum()), 3 * 2 * 14 * 14)).astype(np.float32)
    return tokens, mask, pixels, GRIDS
