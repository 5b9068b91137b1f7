"""Image preprocessing against transformers' Qwen2-VL image processor (the PIL backend)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from rljax.data.images import ImageConfig, fit_size, image_tokens, preprocess
from rljax.errors import DataError

# (width, height, mode): wide, tall, tiny (grown to min_pixels), large (shrunk to max_pixels), RGBA, grey
SIZES = [(200, 90, "RGB"), (61, 150, "RGB"), (20, 33, "RGB"), (700, 500, "RGBA"), (130, 131, "L")]


def _images(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h, mode) in enumerate(SIZES):
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        yy, xx = np.mgrid[0:h, 0:w]
        smooth = (127 + 120 * np.sin(xx / 7.0 + i) * np.cos(yy / 5.0))[..., None]
        arr = np.clip(smooth + rng.integers(-40, 40, (h, w, channels)), 0, 255).astype(np.uint8)
        path = tmp_path / f"img{i}.png"
        Image.fromarray(arr[..., 0] if channels == 1 else arr, mode).save(path)
        paths.append(path)
    return paths


def test_pixel_values_match_transformers(tmp_path):
    """pixel_values and image_grid_thw equal Qwen2VLImageProcessor's on five images of different
    sizes, aspect ratios and modes, with the min/max pixel bounds both in play (a resize rounded
    the other way, a patch order with the 2x2 blocks not consecutive, or RGBA not composited on
    white changes them)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = ImageConfig(min_pixels=56 * 56 * 2, max_pixels=28 * 28 * 120)
    paths = _images(tmp_path)
    ref = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)(
        [Image.open(p) for p in paths])
    pixels, grids = preprocess(paths, cfg)
    np.testing.assert_array_equal(grids, np.asarray(ref["image_grid_thw"]))
    np.testing.assert_allclose(pixels, np.asarray(ref["pixel_values"]), atol=1e-6, rtol=0)
    # both bounds bind: the 20x33 image grows to 84x112 (min_pixels), the 700x500 one shrinks to 336x252
    assert [tuple(g) for g in grids[[2, 3], 1:]] == [(8, 6), (18, 24)]
    assert sum(image_tokens(g, cfg) for g in grids) == pixels.shape[0] // 4


def test_fit_size_bounds():
    """Resized sizes are multiples of 28 within [min_pixels, max_pixels]."""
    cfg = ImageConfig(min_pixels=3136, max_pixels=28 * 28 * 16)
    for h, w in [(10, 10), (1000, 370), (224, 224), (3000, 2000)]:
        rh, rw = fit_size(h, w, cfg)
        assert rh % 28 == 0 and rw % 28 == 0 and cfg.min_pixels <= rh * rw <= cfg.max_pixels


@pytest.mark.parametrize("case", ["missing", "corrupt", "too_large", "aspect"])
def test_bad_images_get_one_line(tmp_path, case):
    """A missing file, a file that is no image, a source over max_source_pixels and an aspect
    ratio above 200 each raise one DataError line naming the fix."""
    cfg = ImageConfig(max_source_pixels=100 * 100)
    if case == "missing":
        source, match = tmp_path / "nope.png", "does not exist"
    elif case == "corrupt":
        source, match = tmp_path / "bad.png", "cannot be read"
        source.write_bytes(b"\x89PNG not really")
    elif case == "too_large":
        source, match = tmp_path / "big.png", "over the limit"
        Image.new("RGB", (101, 100)).save(source)
    else:
        source, match = tmp_path / "thin.png", "aspect ratio"
        Image.new("RGB", (201 * 2, 2)).save(source)
        cfg = ImageConfig()
    with pytest.raises(DataError, match=match) as err:
        preprocess([source], cfg)
    assert "\n" not in str(err.value)
