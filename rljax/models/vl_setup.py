"""The `[model.vision]` section: a from-scratch Qwen2.5-VL-shaped vision tower on the policy's
decoder, or a `qwen2_5_vl` checkpoint, and `model.train_vision`.

    [model.vision]   depth = 2, hidden_size = 32, ...   (depth = 0: no tower, a text model)

A from-scratch VLM's special tokens (image, vision_start, vision_end, video) take the four ids
after the tokenizer's vocabulary, so no text ever encodes to them; the decoder's vocabulary
grows by four. `mrope_section` must sum to the decoder's head_dim / 2.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from rljax.config_io import bounded
from rljax.errors import ConfigError
from rljax.models.vision import VisionConfig
from rljax.models.vlm import VLConfig, init_vl_params


@dataclasses.dataclass(frozen=True)
class VisionSection:
    """A from-scratch tower's sizes (HF `vision_config` names); `depth = 0` is no tower.
    `out_hidden_size` is the decoder's width (the merger projects to it)."""

    depth: int = bounded(0, ge=0)
    hidden_size: int = bounded(32, ge=4)
    num_heads: int = bounded(2, ge=1)
    intermediate_size: int = bounded(64, ge=1)
    window_size: int = bounded(56, ge=28)
    fullatt_block_indexes: tuple[int, ...] = bounded((), ge=0)
    mrope_section: tuple[int, ...] = bounded((), ge=1)  # default: head_dim / 2 split 1/4, 3/8, 3/8 (Qwen2.5-VL's 16/24/24)

    @property
    def enabled(self) -> bool:
        return self.depth > 0


def is_vl_checkpoint(path) -> bool:
    """Whether a checkpoint directory holds a Qwen2.5-VL model (its config.json says so)."""
    cfg = Path(path) / "config.json"
    return cfg.exists() and json.loads(cfg.read_text()).get("model_type") == "qwen2_5_vl"


def is_image_run(cfg) -> bool:
    """Whether a run config (`rljax.train.config.TrainConfig`) trains a vision-language policy or
    asks for image data: `[model.vision]`, a `qwen2_5_vl` checkpoint, or `data.source="visual"`."""
    ckpt = cfg.model.checkpoint
    return cfg.model.vision.enabled or cfg.data.source == "visual" or (ckpt is not None and is_vl_checkpoint(ckpt))


def default_mrope_section(head_dim: int) -> tuple[int, int, int]:
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return (t, h, half - t - h)


def scratch_vl_config(section: VisionSection, text_cfg) -> VLConfig:
    """A from-scratch VLM on `text_cfg` (a tokenizer-sized decoder): the vocabulary grows by the
    four special tokens, placed after it."""
    if not section.enabled:
        raise ConfigError("model.vision.depth = 0 is a text model; set depth >= 1 for a vision tower")
    v = text_cfg.vocab_size
    vision = VisionConfig(depth=section.depth, hidden_size=section.hidden_size, num_heads=section.num_heads,
                          intermediate_size=section.intermediate_size, out_hidden_size=text_cfg.hidden_size,
                          window_size=section.window_size, fullatt_block_indexes=section.fullatt_block_indexes)
    return VLConfig(text=text_cfg.replace(vocab_size=v + 4), vision=vision, image_token_id=v,
                    vision_start_token_id=v + 1, vision_end_token_id=v + 2, video_token_id=v + 3,
                    mrope_section=section.mrope_section or default_mrope_section(text_cfg.head_dim))


def build_vl_policy(section: VisionSection, text_cfg, key: jax.Array, *, checkpoint: str | None = None,
                    param_dtype: str = "float32", compute_dtype: str = "float32"):
    """(VLConfig, params): a `qwen2_5_vl` checkpoint's, or a random-init tower on a random-init
    decoder sized by `text_cfg`."""
    if checkpoint is not None:
        from rljax.models.vl_io import load_vl

        return load_vl(checkpoint, param_dtype=param_dtype, compute_dtype=compute_dtype)
    cfg = scratch_vl_config(section, text_cfg)
    return cfg, init_vl_params(cfg, key)
