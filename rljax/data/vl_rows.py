"""Data rows with images: the examples of the visual tasks and of JSONL/Parquet rows, and the
host step that turns a prompt batch of them into image prompts.

A row's images travel in its `Example.metadata` under `image` (one) or `images` (a list), each a
file path, raw bytes (a Parquet binary column, the generated tasks' PNGs) or a base64 data URL
(`data:image/png;base64,...`). A JSONL row `{"question": ..., "answer": ..., "image": "a.png"}`
read by `rljax.data.sources` keeps its `image` column in the metadata (every unmapped column is
kept), so no new source kind is needed.

`image_prompts` (host, per batch): each prompt's images preprocessed as the processor does
(`rljax.data.images.preprocess`); each image's `vision_start`, `t h w / 4` image tokens and
`vision_end` put at the head of the prompt (after BOS; a chat prompt's user turn starts there),
rows left-padded again; the patches both flattened in row-major order (what the sampler encodes
once per prompt) and per row, padded to a common patch count (what the update encodes per row).
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any, Sequence

import numpy as np

from rljax.data.example import Example
from rljax.data.images import ImageConfig, image_tokens, preprocess
from rljax.data.visual_tasks import generate
from rljax.errors import DataError
from rljax.models.vision import PatchLayout, patch_layout


def example_images(example: Example) -> tuple[Any, ...]:
    """The images of an example (paths, bytes; data URLs decoded), in order; () for a text row."""
    meta = example.metadata or {}
    value = meta.get("images", meta.get("image"))
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else (value,)
    out = []
    for item in items:
        if isinstance(item, str) and item.startswith("data:"):
            try:
                item = base64.b64decode(item.split(",", 1)[1], validate=True)
            except (ValueError, IndexError) as e:
                raise DataError(f"example {example.id}: its image data URL is not valid base64; re-encode it") from e
        out.append(item)
    return tuple(out)


def short_question(spec) -> str:
    """A terse question for a tiny character-level model: `count <colour>`, `tallest`, `clock`."""
    return f"count {spec[2]}" if spec[0] == "count" else spec[0]


def visual_examples(task: str, split: str, count: int, *, size: int = 112, start: int = 0,
                    short: bool = False) -> tuple[Example, ...]:
    """`count` generated problems (`rljax.data.visual_tasks`) as examples whose metadata holds the
    picture as PNG bytes; ids `visual/<task>/<split>/<i>`. `short`: the terse question form
    (`short_question`), for a from-scratch character tokenizer."""
    return tuple(Example(id=f"visual/{task}/{split}/{i}", question=short_question(p.spec) if short else p.question,
                         answer=p.answer, metadata={"image": p.png()})
                 for i, p in enumerate(generate(task, split, count, size=size, start=start)))


@dataclasses.dataclass(frozen=True)
class ImagePrompts:
    """A batch of image prompts (NumPy). `tokens_pt`/`mask_pt`: left-padded, placeholders
    expanded; `pixel_values` [sum patches, C*Tp*P*P] and `grid_thw` [I, 3] in row-major order of
    the placeholders; `pixels_pnd` [P, N, C*Tp*P*P] and `layout` ([P, N, ...]) each row's own."""

    tokens_pt: np.ndarray
    mask_pt: np.ndarray
    pixel_values: np.ndarray
    grid_thw: np.ndarray
    pixels_pnd: np.ndarray
    layout: PatchLayout


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def image_prompts(vl_cfg, examples: Sequence[Example], tokens_pt, mask_pt, *, image_cfg: ImageConfig = ImageConfig(),
                  pad_id: int = 0, width: int | None = None, num_patches: int | None = None) -> ImagePrompts:
    """The prompts `tokens_pt`/`mask_pt` (left-padded text) of `examples` with their images.

    `width` fixes the token width (default: the widest row, rounded up to a multiple of 8) and
    `num_patches` the per-row patch count (default: a power of two >= 64), so batches of
    same-size images compile once. A row without images is a text row of the batch."""
    tokens_pt, mask_pt = np.asarray(tokens_pt), np.asarray(mask_pt).astype(bool)
    bos = vl_cfg.text.bos_token_id
    rows, pixels, grids, per_row = [], [], [], []
    for ex, toks, mask in zip(examples, tokens_pt, mask_pt):
        real = [int(t) for t in toks[mask]]
        pv, grid = preprocess(example_images(ex), image_cfg)
        block = []
        for g in grid:
            block += [vl_cfg.vision_start_token_id] + [vl_cfg.image_token_id] * image_tokens(g, image_cfg) + \
                     [vl_cfg.vision_end_token_id]
        head = 1 if real and bos is not None and real[0] == bos else 0
        rows.append(real[:head] + block + real[head:])
        pixels.append(pv)
        grids.append(grid)
        per_row.append(pv.shape[0])
    longest = max(len(r) for r in rows)
    width = -(-longest // 8) * 8 if width is None else width
    if longest > width:
        raise DataError(f"an image prompt takes {longest} tokens, over its width {width}; shrink the images "
                        "(images.max_pixels) or raise data.max_prompt_tokens")
    unit = vl_cfg.vision.merge_unit
    num_patches = _bucket(max(per_row), max(64, unit)) if num_patches is None else num_patches
    if max(per_row) > num_patches:
        raise DataError(f"a prompt's images make {max(per_row)} patches, over the batch's {num_patches}; "
                        "shrink the images (images.max_pixels)")
    out_tokens = np.full((len(rows), width), pad_id, np.int32)
    out_mask = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        out_tokens[i, width - len(r):] = r
        out_mask[i, width - len(r):] = True
    layouts = [patch_layout(vl_cfg.vision, g, num_patches) for g in grids]
    layout = PatchLayout(*(np.stack([getattr(lay, f.name) for lay in layouts])
                           for f in dataclasses.fields(PatchLayout)))
    pixels_pnd = np.stack([np.pad(p, ((0, num_patches - p.shape[0]), (0, 0))) for p in pixels]).astype(np.float32)
    return ImagePrompts(out_tokens, out_mask, np.concatenate(pixels).astype(np.float32),
                        np.concatenate(grids).reshape(-1, 3), pixels_pnd, layout)
