"""Data rows with images (`rljax.data.vl_rows`): JSONL rows whose `image` column names a file,
bytes and data URLs, the generated visual task, and bad input as one line each."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from rljax.data.example import Example
from rljax.data.images import ImageConfig, preprocess
from rljax.data.sources import load_task
from rljax.data.vl_rows import example_images, image_prompts, visual_examples
from rljax.errors import DataError
from rljax.models import preset
from rljax.models.vision import VisionConfig
from rljax.models.vlm import VLConfig

IMAGE, START, END = 120, 118, 119


def _vl():
    text = preset("qwen2-test", vocab_size=128, bos_token_id=1)
    vision = VisionConfig(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=text.hidden_size,
                          window_size=56)
    return VLConfig(text=text, vision=vision, image_token_id=IMAGE, vision_start_token_id=START,
                    vision_end_token_id=END, video_token_id=121, mrope_section=(2, 3, 3))


def _png(tmp_path, name="a.png", size=(84, 56)):
    from PIL import Image

    path = tmp_path / name
    Image.new("RGB", size, (200, 10, 10)).save(path)
    return path


def test_jsonl_rows_with_an_image_column(tmp_path):
    """A JSONL row {question, answer, image: path} keeps its image in the metadata; its prompt gets
    vision_start, (84 / 28) * (56 / 28) = 6 image tokens, vision_end after BOS, and its patches
    equal the processor path's. A data URL of the same PNG gives the same patches. Catches a
    dropped image column, a placeholder count off the grid, BOS moved behind the image."""
    path = _png(tmp_path)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"question": "how many", "answer": "3", "image": str(path)}) + "\n")
    ex = load_task("jsonl", path=str(tmp_path / "rows.jsonl")).examples[0]
    assert example_images(ex) == (str(path),)
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    ex_url = Example(id="u", question="q", answer="3", metadata={"image": url})
    tokens, mask = np.array([[0, 1, 40, 41]]), np.array([[False, True, True, True]])
    for e in (ex, ex_url):
        p = image_prompts(_vl(), [e], tokens, mask, pad_id=0)
        real = p.tokens_pt[0][p.mask_pt[0]].tolist()
        assert real == [1, START] + [IMAGE] * 6 + [END, 40, 41]
        np.testing.assert_array_equal(p.pixel_values, preprocess([str(path)])[0])
        np.testing.assert_array_equal(p.grid_thw, [[1, 4, 6]])


def test_visual_task_examples_carry_their_picture():
    """The generated task's examples hold a PNG that decodes to the drawn picture."""
    ex = visual_examples("tallest", "train", 2, size=56)
    assert len(ex) == 2 and all(len(example_images(e)) == 1 for e in ex)
    assert ex[0].answer.isdigit()


@pytest.mark.parametrize("image, cfg, match", [
    ("/nonexistent/x.png", ImageConfig(), "does not exist"),
    (b"not a png at all", ImageConfig(), "cannot be read"),
    ("BIG", ImageConfig(max_source_pixels=1000), "over the limit"),
    ("data:image/png;base64,%%%", ImageConfig(), "not valid base64"),
])
def test_bad_images_are_one_line(tmp_path, image, cfg, match):
    """A missing file, corrupt bytes, a source over the pixel budget, a broken data URL: one
    DataError line naming the image and the fix."""
    if image == "BIG":
        image = str(_png(tmp_path, "big.png", (100, 100)))
    ex = Example(id="bad", question="q", answer="1", metadata={"image": image})
    with pytest.raises(DataError, match=match) as e:
        image_prompts(_vl(), [ex], np.array([[1, 40]]), np.array([[True, True]]), image_cfg=cfg)
    assert "\n" not in str(e.value)


def test_images_for_a_model_without_a_tower_are_one_line():
    """The update given image rows on a policy without `visual` params: one ConfigError line."""
    import jax.numpy as jnp

    from rljax.errors import ConfigError
    from rljax.update.vision import VisionRows

    vl = _vl()
    rows = VisionRows(vision=vl.vision, train_b=jnp.ones((1,), bool), pixels_bnp=jnp.zeros((1, 4, 1176)),
                      hw_bn2=jnp.zeros((1, 4, 2), jnp.int32), image_bn=jnp.zeros((1, 4), jnp.int32),
                      window_bn=jnp.zeros((1, 4), jnp.int32), image_bt=jnp.zeros((1, 3), bool),
                      cos_bph=jnp.zeros((1, 3, 8)), sin_bph=jnp.zeros((1, 3, 8)))
    with pytest.raises(ConfigError, match="no vision tower") as e:
        rows.splice({"embed": jnp.zeros((128, 64))})
    assert "\n" not in str(e.value)
