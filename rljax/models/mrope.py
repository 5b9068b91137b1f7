"""Multimodal rotary position embeddings (M-RoPE) of Qwen2-VL / Qwen2.5-VL.

Every token has three positions (temporal, height, width). A text token's three are equal and
count up by one per token, as in 1D RoPE; an image's merged tokens (an h x w grid after the 2x2
merge) share the temporal position s (the position the image starts at) and take s + row and
s + column as height and width; the text after the image resumes at s + max(h, w). The rotary
frequencies are split into three sections (`mrope_section`, summing to head_dim / 2): frequency i
of section j rotates by position component j (Qwen2-VL, Wang et al., 2024, sec. 2.1; Qwen2.5-VL
keeps it for images). `rope_index` builds the positions on the host exactly as transformers'
`get_rope_index` does; `mrope_table` turns them into the per-row (cos, sin) tables the decoder's
`rope_cos_sin` takes.

Decoding continues with text only, so a generated token at mask position p (its count of real
tokens before it, `rljax.models.transformer.default_positions`) rotates by p + delta, with the
prompt's `delta` = max position + 1 - number of real prompt tokens (non-positive: an image takes
fewer positions than slots), in all three components.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from rljax.errors import DataError
from rljax.models.config import ModelConfig, rope_inv_freq


def rope_index(tokens_bt, mask_bt, grid_thw, image_token_id: int, spatial_merge_size: int = 2,
               segment_ids_bt=None) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE positions [3, B, T] int32 and deltas [B] for token rows whose runs of
    `image_token_id` are images, consumed in order (row-major over the batch) from `grid_thw`
    [I, 3] (patch grids before merging). Padding (mask False) gets position 0, as in HF.

    `segment_ids_bt` (packed rows, `rljax.update.packing`): each segment's positions start at 0,
    as if it were its own row (the deltas are then 0: packed rows are scored, never decoded)."""
    tokens_bt, mask_bt = np.asarray(tokens_bt), np.asarray(mask_bt).astype(bool)
    grids = iter(np.asarray(grid_thw, np.int64).reshape(-1, 3))
    b, t = tokens_bt.shape
    positions = np.zeros((3, b, t), np.int64)
    deltas = np.zeros((b,), np.int64)
    for row in range(b):
        if segment_ids_bt is None:
            real = tokens_bt[row][mask_bt[row]]
            row_pos = _row_positions(real, grids, image_token_id, spatial_merge_size, row)
            positions[:, row, mask_bt[row]] = row_pos
            deltas[row] = (row_pos.max() + 1 if row_pos.size else 0) - len(real)
            continue
        seg_row = np.asarray(segment_ids_bt)[row]
        for seg in dict.fromkeys(seg_row[mask_bt[row]].tolist()):  # segments in order of appearance
            slots = mask_bt[row] & (seg_row == seg)
            positions[:, row, slots] = _row_positions(tokens_bt[row][slots], grids, image_token_id,
                                                      spatial_merge_size, row)
    return positions.astype(np.int32), deltas.astype(np.int32)


def _row_positions(real, grids, image_token_id: int, m: int, row: int) -> np.ndarray:
    """[3, n] positions of one sequence's real tokens (text counts on; an image takes its grid)."""
    is_image = real == image_token_id
    parts, cur, start = [], 0, 0
    while start < len(real):
        end = start
        while end < len(real) and is_image[end] == is_image[start]:
            end += 1
        if not is_image[start]:
            parts.append(np.broadcast_to(np.arange(end - start) + cur, (3, end - start)))
            cur += end - start
        else:
            grid = next(grids, None)
            if grid is None:
                raise DataError(f"row {row} has more image-token runs than images given; pass one "
                                "image grid per image placeholder")
            gt, gh, gw = int(grid[0]), int(grid[1]) // m, int(grid[2]) // m
            if gt * gh * gw != end - start:
                raise DataError(f"row {row}: an image placeholder of {end - start} tokens does not fit its "
                                f"image ({gt * gh * gw} merged patches); build prompts with the image's own "
                                "placeholder count")
            tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
            parts.append(np.stack([tt, hh, ww]).reshape(3, -1) + cur)
            cur += max(gh, gw)
        start = end
    return np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)


def mrope_table(positions_3bt, mask_bt, deltas_b, cfg: ModelConfig, mrope_section: tuple[int, ...],
                num_positions: int):
    """Per-row rotary tables (cos, sin) [B, P, H] indexed by mask position (`default_positions`),
    the form the decoder's `rope_cos_sin` takes per row: entry p of row b holds the M-RoPE angles of
    the row's real token with mask position p (from `positions_3bt` [3, B, T]) and, past the
    prompt, text positions p + delta_b in all three components (what decoding continues with).
    Indexing by mask position makes the table independent of padding and slot order."""
    positions_3bt, mask_bt = np.asarray(positions_3bt), np.asarray(mask_bt).astype(bool)
    b = mask_bt.shape[0]
    table_3bp = np.broadcast_to(np.arange(num_positions)[None, None] + np.asarray(deltas_b)[None, :, None],
                                (3, b, num_positions)).copy()
    for row in range(b):
        n = int(mask_bt[row].sum())
        if n > num_positions:
            raise ValueError(f"num_positions={num_positions} is below row {row}'s {n} prompt tokens")
        table_3bp[:, row, :n] = positions_3bt[:, row, mask_bt[row]]
    return mrope_tables(table_3bp, cfg, mrope_section)


def mrope_tables(positions_3bt, cfg: ModelConfig, mrope_section: tuple[int, ...]):
    """(cos, sin) [B, T, H] for M-RoPE positions [3, B, T]: frequency i (of H / 2) rotates by the
    position component of the section it falls in, the angles repeated for rotate-half."""
    inv_freq = np.asarray(rope_inv_freq(cfg), np.float32)
    if sum(mrope_section) != inv_freq.shape[0]:
        raise ValueError(f"mrope_section {mrope_section} must sum to head_dim / 2 = {inv_freq.shape[0]}")
    component = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)  # [H/2]
    pos_bth = jnp.moveaxis(jnp.asarray(positions_3bt)[component], 0, -1).astype(jnp.float32)
    angles = pos_bth * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)
