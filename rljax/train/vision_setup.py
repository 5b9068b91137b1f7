"""The pieces a vision-language run adds to `build_run`, and nothing else:

    vision = build_vision(cfg, tokenizer, key, layouts)    # None: a text run
    policy = vision.cfg (the tower and decoder), vision.params (the decoder's plus `visual`)
    images = vision.prompter(cfg, examples)                # the host step that gives prompts their pictures

The run is then the text run's: the same loop, sync driver and iteration, whose prompt batches
carry their `rljax.data.prompt_images.PromptImages` (`rljax.data.pipeline.prompt_batches(...,
images=...)`), and whose evaluator and warm start take the same host step. The state's
`model_cfg` is the decoder's config; the tower's config and special tokens travel as static
fields of each batch's images. What a vision-language run does not take yet is refused here,
one line each (`check_vision_run`), and the drivers' table refuses every driver but sync
(`rljax.drivers.registry`, feature "images").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax

from rljax.data.example import Example
from rljax.data.prompt_images import ImagePrompter
from rljax.data.vl_rows import visual_examples
from rljax.errors import ConfigError
from rljax.models.setup import policy_config
from rljax.models.vl_setup import build_vl_policy, is_image_run, is_vl_checkpoint
from rljax.models.vlm import VLConfig


def check_vision_run(cfg, layouts) -> None:
    """One line for each setting a vision-language run does not take yet."""
    ckpt = cfg.model.checkpoint
    if not (cfg.model.vision.enabled or (ckpt is not None and is_vl_checkpoint(ckpt))):
        raise ConfigError("data.source='visual' has images but the model has no vision tower; set [model.vision] "
                          "depth >= 1 or load a qwen2_5_vl checkpoint")
    refusals = (
        (any(layout is not None for layout in layouts), "more than one device", "mesh.devices=1"),
        (bool(cfg.warm_start.target_accuracy or cfg.warm_start.patience), "warm_start.target_accuracy / patience",
         "a fixed warm_start.steps (and max_seconds)"),
    )
    for on, what, fix in refusals:
        if on:
            raise ConfigError(f"a vision-language run does not take {what} yet; use {fix}")


class TextDecoder:
    """The tokenizer with ids past its vocabulary dropped on decode: a from-scratch VLM's four
    special tokens (after the vocabulary, `rljax.models.vl_setup.scratch_vl_config`) are no text,
    and a policy may sample them."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def _text(self, ids):
        v = self._tokenizer.vocab_size
        return [i for i in (ids.tolist() if hasattr(ids, "tolist") else ids) if i < v]

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._tokenizer.decode(self._text(ids), skip_special=skip_special)

    def decode_batch(self, batch_ids, skip_special: bool = True) -> list[str]:
        return self._tokenizer.decode_batch([self._text(ids) for ids in batch_ids], skip_special=skip_special)


@dataclasses.dataclass(frozen=True)
class VisionPolicy:
    """A vision-language policy: its config, params (the decoder's plus `visual`), and the run's
    tokenizer (decoding text ids only, for a from-scratch VLM)."""

    cfg: VLConfig
    params: Any
    tokenizer: Any

    def prompter(self, cfg, examples: Sequence[Example]) -> ImagePrompter:
        """The run's host step for image prompts, its widths fixed from a sample of `examples`."""
        return ImagePrompter.build(self.cfg, examples[:16], max_prompt_tokens=cfg.data.max_prompt_tokens,
                                   max_new_tokens=cfg.sampling.max_new_tokens, pad_id=self.tokenizer.pad_id or 0,
                                   train_vision=cfg.model.train_vision)


def build_vision(cfg, tokenizer, key: jax.Array, layouts) -> VisionPolicy | None:
    """The vision-language policy of `cfg` (`[model.vision]` or a `qwen2_5_vl` checkpoint), or None
    for a text run."""
    if not is_image_run(cfg):
        return None
    check_vision_run(cfg, layouts)
    text_cfg = None if cfg.model.checkpoint else policy_config(cfg.model, tokenizer)
    vl, params = build_vl_policy(cfg.model.vision, text_cfg, key, checkpoint=cfg.model.checkpoint,
                                 param_dtype=cfg.model.param_dtype, compute_dtype=cfg.model.compute_dtype)
    return VisionPolicy(vl, params, tokenizer if cfg.model.checkpoint else TextDecoder(tokenizer))


def visual_splits(one) -> tuple[tuple[Example, ...], tuple[Example, ...], int]:
    """(train, held-out, skipped) of a generated visual task (`data.source = "visual"`): the
    splits are disjoint by drawing (`rljax.data.visual_tasks`)."""
    kw = dict(one.task_kwargs)
    size = int(kw.pop("image_size", 112))
    short = bool(kw.pop("short", False))
    if kw:
        raise ConfigError(f"data.task_kwargs {sorted(kw)} are unknown for a visual task; use image_size, short")
    return (visual_examples(one.task, "train", one.size, size=size, short=short),
            visual_examples(one.task, "test", one.eval_size, size=size, short=short), 0)
