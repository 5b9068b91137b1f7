"""Images as typed prompt data: the image side of a prompt batch, built on the host, carried by
the one RL iteration through sampling, verification and the update.

    batch  = PromptBatch(tokens_bt, mask_bt, indices_b, examples)           text (images=None)
    batch  = ImagePrompter(...).add_to(batch)                                the host step, per batch
           = PromptBatch(tokens with each image's placeholders, ..., images=PromptImages)
    sample:  the tower once over the P prompts' patches (`PromptImages.inputs`), n samples share it
    update:  each of the P * n rows carries its prompt's patches (`PromptImages.rows_for`)

A text batch's `images` is None: a pytree with no leaves, so the text iteration traces and runs
exactly as before. `PromptImages` is the whole image side of one batch (the model's special
tokens and tower config static, arrays as leaves): the rollout (`rljax.stages.rollout`), the
evaluator (`rljax.evaluation.runner`) and the warm start (`rljax.warmstart.sft`) take it beside
the prompt tokens, and nothing above them knows whether a batch has pictures.

Widths are fixed per run (`ImagePrompter.width`: the prompt budget plus the widest image block,
rounded to 8; `num_patches` per row), so every batch of same-size images compiles once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rljax.data.example import Example
from rljax.data.images import ImageConfig, image_tokens, preprocess
from rljax.data.vl_rows import example_images, image_prompts
from rljax.models.vlm import VLConfig, VLInputs, prepare_inputs
from rljax.sampling import decode as D
from rljax.update.vision import VisionRows


@flax.struct.dataclass
class PromptImages:
    """The image side of P prompts. `vl`: the model's tower config and special tokens (static);
    `inputs`: the P prompts' patches flattened in placeholder order, their layout and the per-row
    M-RoPE tables (the sampler's, `rljax.models.vlm.VLInputs`); `rows`: the same per prompt
    (`rljax.update.vision.VisionRows`, [P, ...]), which the update repeats over each prompt's
    samples. The tables cover the prompt plus the sampler's decode bucket."""

    vl: VLConfig = flax.struct.field(pytree_node=False)
    inputs: VLInputs
    rows: VisionRows

    def rows_for(self, groups_g, n: int, completion_len: int) -> VisionRows:
        """The `VisionRows` of a `RolloutBatch` of groups `groups_g` (prompt indices) x n samples,
        prompt-major, the image slots extended over the completion columns (a generated image
        token is text, as the sampler embedded it)."""
        take = lambda x: jnp.repeat(jnp.take(x, groups_g, axis=0), n, axis=0)  # noqa: E731
        rows = jax.tree.map(take, self.rows)
        image_bt = jnp.concatenate([rows.image_bt, jnp.zeros((rows.image_bt.shape[0], completion_len), bool)], axis=1)
        return rows.replace(image_bt=image_bt)


@dataclasses.dataclass(frozen=True)
class ImagePrompter:
    """The host step that gives prompts their images (`rljax.data.vl_rows.image_prompts`) and
    builds their `PromptImages`. `width`: the token width of every image prompt; `num_patches`:
    the per-row patch bucket; `positions`: M-RoPE table rows (prompt + decode bucket)."""

    vl: VLConfig
    width: int
    num_patches: int
    positions: int
    pad_id: int = 0
    train_vision: bool = True
    image_cfg: ImageConfig = ImageConfig()

    @classmethod
    def build(cls, vl: VLConfig, examples: Sequence[Example], *, max_prompt_tokens: int, max_new_tokens: int,
              pad_id: int, train_vision: bool, image_cfg: ImageConfig = ImageConfig()) -> ImagePrompter:
        """Widths from `examples` (a sample of the run's rows): the prompt budget plus the widest
        image block (each image's tokens and its start/end markers), rounded up to 8."""
        block = patches = 0
        for e in examples:
            pv, grid = preprocess(example_images(e), image_cfg)
            block = max(block, sum(image_tokens(g, image_cfg) + 2 for g in grid))
            patches = max(patches, pv.shape[0])
        width = -(-(max_prompt_tokens + block) // 8) * 8
        num_patches = max(64, vl.vision.merge_unit, 1 << max(patches - 1, 0).bit_length())
        return cls(vl, width, num_patches, width + D.bucket_length(max_new_tokens), pad_id, train_vision, image_cfg)

    def __call__(self, examples: Sequence[Example], tokens_pt, mask_pt) -> tuple[np.ndarray, np.ndarray, PromptImages]:
        """(tokens, mask, `PromptImages`) of left-padded text prompts `tokens_pt` of `examples`."""
        p = image_prompts(self.vl, examples, tokens_pt, mask_pt, image_cfg=self.image_cfg, pad_id=self.pad_id,
                          width=self.width, num_patches=self.num_patches)
        flat = len(examples) * self.num_patches  # the sampler's patch count: fixed per batch size
        inputs = prepare_inputs(self.vl, p.tokens_pt, p.mask_pt, p.pixel_values, p.grid_thw,
                                num_positions=self.positions, num_patches=flat)
        cos, sin = inputs.rope_cos_sin
        b = p.tokens_pt.shape[0]
        rows = VisionRows(vision=self.vl.vision, train_b=jnp.full((b,), self.train_vision),
                          pixels_bnp=jnp.asarray(p.pixels_pnd), hw_bn2=jnp.asarray(p.layout.hw_n2),
                          image_bn=jnp.asarray(p.layout.image_n), window_bn=jnp.asarray(p.layout.window_n),
                          image_bt=jnp.asarray((p.tokens_pt == self.vl.image_token_id) & p.mask_pt),
                          cos_bph=cos, sin_bph=sin)
        return p.tokens_pt, p.mask_pt, PromptImages(self.vl, inputs, rows)

    def add_to(self, batch):
        """A `rljax.data.pipeline.PromptBatch` with its images (placeholders in its tokens)."""
        tokens, mask, images = self(batch.examples, batch.tokens_bt, batch.mask_bt)
        return dataclasses.replace(batch, tokens_bt=tokens, mask_bt=mask, images=images)
