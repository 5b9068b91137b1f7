"""Images for Qwen2-VL / Qwen2.5-VL prompts: load, resize, normalise, patchify (Pillow + NumPy).

    (h', w') = sizes near (h, w), multiples of 28 (patch 14 x merge 2), with
               min_pixels <= h' w' <= max_pixels and the aspect ratio kept as closely as possible
    x        = (bicubic_resize(rgb, (h', w')) / 255 - mean) / std          (CLIP's mean and std)
    patches  = x cut into 14 x 14 patches, each 2 x 2 block of patches consecutive (the merger's
               unit), every patch repeated over the 2 frames of a temporal patch:
               pixel_values [h' w' / 196, 3 * 2 * 14 * 14], image_grid_thw [1, h' / 14, w' / 14]

The arithmetic of Qwen2-VL (Wang et al., 2024) "naive dynamic resolution": an image keeps its own
size (within a pixel budget) instead of being squashed to a square, so the number of image tokens
is h' w' / 784. Values equal transformers' `Qwen2VLImageProcessor` (tests/data/test_images.py);
no torch at run time. Bad input (a missing or unreadable image, one over the size limits) is one
`DataError` line naming the image and the fix.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from pathlib import Path

import numpy as np

from rljax.errors import ConfigError, DataError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """How images become patches. `max_pixels` bounds the resized image (its token count is
    max_pixels / 784); `max_source_pixels` refuses larger source images before decoding them (a
    decompression bomb, or a file that is not the picture meant)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_source_pixels: int = 8192 * 8192
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self):
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigError(f"images: need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")
        if self.max_pixels < self.factor**2:
            raise ConfigError(f"images: max_pixels={self.max_pixels} is below one merged patch ({self.factor}^2)")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def fit_size(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """The resized (height, width): each side rounded to a multiple of `factor`; if the area is
    then above `max_pixels`, both sides are scaled by sqrt(h w / max_pixels) and rounded down; if
    below `min_pixels`, scaled by sqrt(min_pixels / (h w)) and rounded up."""
    f = cfg.factor
    if max(height, width) > 200 * min(height, width):
        raise DataError(f"an image of {width}x{height} has an aspect ratio above 200; crop it closer to square")
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > cfg.max_pixels:
        shrink = math.sqrt(height * width / cfg.max_pixels)
        h, w = max(f, math.floor(height / shrink / f) * f), max(f, math.floor(width / shrink / f) * f)
    elif h * w < cfg.min_pixels:
        grow = math.sqrt(cfg.min_pixels / (height * width))
        h, w = math.ceil(height * grow / f) * f, math.ceil(width * grow / f) * f
    return h, w


def load_image(source, cfg: ImageConfig = ImageConfig(), name: str | None = None):
    """A Pillow RGB image from a path, raw bytes or a Pillow image; transparency is composited on
    white (as the HF processors do)."""
    from PIL import Image, UnidentifiedImageError

    label = name or (str(source) if isinstance(source, (str, os.PathLike)) else "an image given as bytes")
    if isinstance(source, (str, os.PathLike)):
        if not Path(source).is_file():
            raise DataError(f"image {label} does not exist; fix the image path in the data row")
        opener = lambda: Image.open(source)
    elif isinstance(source, (bytes, bytearray)):
        opener = lambda: Image.open(io.BytesIO(source))
    elif isinstance(source, Image.Image):
        opener = lambda: source
    else:
        raise DataError(f"{label}: an image must be a path, bytes or a PIL image, got {type(source).__name__}")
    try:
        image = opener()
        if image.width * image.height > cfg.max_source_pixels:
            raise DataError(f"image {label} is {image.width}x{image.height}, over the limit of {cfg.max_source_pixels} "
                            "source pixels; shrink it or raise images.max_source_pixels")
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise DataError(f"image {label} cannot be read ({type(e).__name__}); replace it with a PNG or JPEG file") from e
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def patchify(x_hwc: np.ndarray, cfg: ImageConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Patches [gh gw, C Tp P P] of one normalised image [H, W, C] in the merger's order (row-major
    over 2x2 blocks, row-major within each), each patch repeated over the temporal patch."""
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    h, w, c = x_hwc.shape
    gh, gw = h // p, w // p
    x = x_hwc.reshape(gh // m, m, p, gw // m, m, p, c)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # [bh, bw, mh, mw, C, P, P]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
    return x.reshape(gh * gw, c * tp * p * p), (1, gh, gw)


def preprocess(images, cfg: ImageConfig = ImageConfig()) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [sum of patches, C Tp P P] f32, image_grid_thw [I, 3] int64) of `images`
    (paths, bytes or Pillow images), in order."""
    from PIL import Image

    mean, std = np.asarray(cfg.mean, np.float32), np.asarray(cfg.std, np.float32)
    patches, grids = [], []
    for image in images:
        rgb = load_image(image, cfg)
        h, w = fit_size(rgb.height, rgb.width, cfg)
        resized = np.asarray(rgb.resize((w, h), Image.Resampling.BICUBIC))
        x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
        x_patches, grid = patchify((x - mean) / std, cfg)
        patches.append(x_patches)
        grids.append(grid)
    if not patches:
        return np.zeros((0, 3 * cfg.temporal_patch_size * cfg.patch_size**2), np.float32), np.zeros((0, 3), np.int64)
    return np.concatenate(patches).astype(np.float32), np.asarray(grids, np.int64)


def image_tokens(grid_thw, cfg: ImageConfig = ImageConfig()) -> int:
    """Placeholder tokens one image takes in the prompt: t h w / merge^2."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // cfg.merge_size**2
