"""Qwen2.5-VL (`qwen2_5_vl`): the vision tower's merged embeddings fed to the same decoder.

    image_nd  = vision_tower(pixels)                              (rljax.models.vision)
    embeds_bt = image_nd[k] where tokens_bt is the k-th image token, else embed[tokens_bt]
    logits    = decoder(embeds, M-RoPE tables, causal mask by slot)   (rljax.models.transformer)

Nothing in the decoder knows about images. The merged embeddings join through the embedding
weight (`ImageSplice`, the protocol a LoRA adapter uses, `rljax.models.layers.is_adapted`):
its lookup returns the k-th merged row for the k-th `image_token_id` of the batch (row-major,
as HF's `masked_scatter`) and the text embedding elsewhere. The rotary angles come from
per-row M-RoPE tables indexed by mask position (`rljax.models.mrope.mrope_table`), passed as
the decoder's `rope_cos_sin`; the causal mask stays the slot order (`default_positions`).

Params: the text model's dict (`rljax.models.transformer`) plus `visual` (the tower's,
`rljax.models.vision`). `VLInputs` holds the host-built pieces of one batch (padded patches,
their layout, the rope tables), so the jitted functions here see fixed shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rljax.errors import ConfigError, DataError
from rljax.models.config import ModelConfig
from rljax.models.layers import is_adapted
from rljax.models.mrope import mrope_table, rope_index
from rljax.models.scoring import token_logprobs
from rljax.models.transformer import (default_positions, forward, hidden_states, init_cache, init_params,
                                      logits_from_hidden)
from rljax.models.vision import (PatchLayout, VisionConfig, init_vision_params, num_merged_tokens, patch_layout,
                                 vision_tower)


@dataclasses.dataclass(frozen=True)
class VLConfig:
    """A vision-language model: the text decoder's config, the tower's, and the special tokens."""

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int
    mrope_section: tuple[int, ...] = (16, 24, 24)
    model_type: str = "qwen2_5_vl"

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(int(s) for s in self.mrope_section))
        if sum(self.mrope_section) != self.text.head_dim // 2:
            raise ConfigError(f"mrope_section {self.mrope_section} must sum to head_dim / 2 = "
                              f"{self.text.head_dim // 2}")

    def replace(self, **changes) -> VLConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        return self.text.num_params() + self.vision.num_params()


@struct.dataclass
class ImageSplice:
    """An embedding weight whose lookup puts merged image embeddings on the image tokens.

    `embed` is the text embedding [V, D] (or its LoRA-adapted weight); `image_nd` [Ni, D] the
    merger's rows in image order; `image_bt` [B, T] marks the slots that take them (the prompts'
    image tokens: an image token the policy generates stays text). The k-th marked slot of the
    batch (row-major) takes row k. Only for a lookup of exactly the [B, T] tokens it was made for."""

    embed: Any
    image_nd: jax.Array
    image_bt: jax.Array

    def lookup(self, ids_bt, dtype):
        text_btd = text_lookup(self.embed, ids_bt, dtype)
        is_image_bt = self.image_bt
        if is_image_bt.shape != ids_bt.shape:
            raise ValueError(f"ImageSplice made for tokens {is_image_bt.shape} looked up with {ids_bt.shape}")
        k_bt = jnp.cumsum(is_image_bt.reshape(-1)).reshape(ids_bt.shape) - 1
        image_btd = jnp.take(self.image_nd.astype(jnp.float32), jnp.clip(k_bt, 0, self.image_nd.shape[0] - 1), axis=0)
        return jnp.where(is_image_bt[..., None], image_btd, text_btd)

    def output_matrix(self):
        return text_matrix(self.embed)


def text_lookup(embed, ids_bt, dtype):
    """The text embedding of `ids_bt` (f32 [B, T, D]) from a plain [V, D] weight or its LoRA-adapted
    form: what an image splice puts beside the image rows."""
    return embed.lookup(ids_bt, dtype) if is_adapted(embed) else jnp.take(embed, ids_bt, axis=0).astype(jnp.float32)


def text_matrix(embed):
    """The [V, D] matrix of a plain or LoRA-adapted embedding (a tied LM head's weight)."""
    return embed.output_matrix() if is_adapted(embed) else embed


@struct.dataclass
class VLInputs:
    """The host-built image side of one batch: `pixels_np` [Np, C*Tp*P*P] (padded), their
    `layout`, and the per-row M-RoPE tables `rope_cos_sin` ([B, P, H] each, by mask position)."""

    pixels_np: jax.Array
    layout: PatchLayout
    rope_cos_sin: tuple[jax.Array, jax.Array]
    deltas_b: jax.Array


def init_vl_params(cfg: VLConfig, key: jax.Array, std: float = 0.02):
    """Random-init params: the text model's and `visual`."""
    k_text, k_vis = jax.random.split(key)
    params = init_params(cfg.text, k_text, std)
    return {**params, "visual": init_vision_params(cfg.vision, k_vis, std, cfg.text.params_jnp_dtype)}


def text_params(params):
    """The decoder's params (without the tower)."""
    return {k: v for k, v in params.items() if k != "visual"}


def prepare_inputs(cfg: VLConfig, tokens_bt, mask_bt, pixel_values, grid_thw, *, num_positions: int,
                   num_patches: int | None = None, image_bt=None, segment_ids_bt=None) -> VLInputs:
    """Checks one batch's images against its placeholders and builds its `VLInputs` on the host.

    `pixel_values` [Np, C*Tp*P*P] and `grid_thw` [I, 3] as the processor makes them
    (`rljax.data.images`), images in row-major order of their placeholders; `num_positions` covers
    every mask position the batch will reach (prompt plus new tokens); `num_patches` pads the
    patches (a bucket, so batches compile once per bucket); `image_bt` marks the image slots when
    not every real image token is one (a prompt + completion row: the prompt's only).

    Packed rows (`segment_ids_bt`): each segment's M-RoPE positions restart, and the table is
    indexed by the row's mask position, which runs on across segments. So the decoder, given
    `default_positions(mask)` (not restarting) and the segment ids, masks causally within each
    segment and rotates each token as in its own row: packed equals padded."""
    tokens_bt, mask_bt = np.asarray(tokens_bt), np.asarray(mask_bt).astype(bool)
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    pixels = np.asarray(pixel_values, np.float32).reshape(-1, cfg.vision.patch_dim) if len(grid) else \
        np.zeros((0, cfg.vision.patch_dim), np.float32)
    if pixels.shape[0] != int(grid.prod(axis=1).sum()):
        raise DataError(f"pixel_values has {pixels.shape[0]} patches but image_grid_thw describes "
                        f"{int(grid.prod(axis=1).sum())}; pass the processor's two outputs together")
    placeholders = int(((tokens_bt == cfg.image_token_id) & mask_bt).sum()) if image_bt is None else int(image_bt.sum())
    if placeholders != num_merged_tokens(cfg.vision, grid):
        raise DataError(f"the prompts hold {placeholders} image tokens but the images make "
                        f"{num_merged_tokens(cfg.vision, grid)}; expand each image placeholder to its grid's count")
    if image_bt is not None:  # generated image tokens are text: give them a token id rope_index reads as text
        tokens_bt = np.where(np.asarray(image_bt) | (tokens_bt != cfg.image_token_id), tokens_bt, -1)
    positions_3bt, deltas_b = rope_index(tokens_bt, mask_bt, grid, cfg.image_token_id, cfg.vision.spatial_merge_size,
                                         segment_ids_bt)
    num_patches = max(pixels.shape[0], cfg.vision.merge_unit) if num_patches is None else num_patches
    layout = patch_layout(cfg.vision, grid, num_patches)
    pixels = np.pad(pixels, ((0, num_patches - pixels.shape[0]), (0, 0)))
    tables = mrope_table(positions_3bt, mask_bt, deltas_b, cfg.text, cfg.mrope_section, num_positions)
    return VLInputs(pixels_np=jnp.asarray(pixels), layout=jax.tree.map(jnp.asarray, layout), rope_cos_sin=tables,
                    deltas_b=jnp.asarray(deltas_b))


def image_embeddings(cfg: VLConfig, params, inputs: VLInputs):
    """The merger's rows [Np / 4, D] for the batch's images (padding rows last)."""
    return vision_tower(cfg.vision, params["visual"], inputs.pixels_np, inputs.layout)


def spliced_params(cfg: VLConfig, params, image_nd, image_bt):
    """The decoder's params with the embedding replaced by an `ImageSplice` of `image_nd` on the
    slots `image_bt`."""
    lm = text_params(params)
    return {**lm, "embed": ImageSplice(lm["embed"], image_nd, image_bt)}


def prompt_images(cfg: VLConfig, tokens_bt, mask_bt):
    """The slots of a batch that take image embeddings: its real image tokens."""
    return (tokens_bt == cfg.image_token_id) & mask_bt.astype(bool)


def vl_forward(cfg: VLConfig, params, tokens_bt, mask_bt, inputs: VLInputs, *, remat: bool = False):
    """Logits [B, T, V] (f32) of token rows whose image placeholders take the tower's embeddings:
    the tower once, then the decoder's full-sequence forward."""
    lm = spliced_params(cfg, params, image_embeddings(cfg, params, inputs), prompt_images(cfg, tokens_bt, mask_bt))
    logits, _ = forward(cfg.text, lm, tokens_bt, default_positions(mask_bt), mask_bt, remat=remat,
                        rope_cos_sin=inputs.rope_cos_sin)
    return logits


def _prefill(cfg: VLConfig, params, tokens_bt, mask_bt, inputs: VLInputs, max_len: int):
    lm = spliced_params(cfg, params, image_embeddings(cfg, params, inputs), prompt_images(cfg, tokens_bt, mask_bt))
    cache = init_cache(cfg.text, tokens_bt.shape[0], max_len)
    positions = default_positions(mask_bt)
    h, cache = hidden_states(cfg.text, lm, tokens_bt, positions, mask_bt, cache, rope_cos_sin=inputs.rope_cos_sin)
    return logits_from_hidden(cfg.text, lm, h[:, -1:])[:, 0], cache, positions[:, -1]


def _decode(cfg: VLConfig, params, token_b, position_b, cache, rope_cos_sin):
    lm = text_params(params)
    h, cache = hidden_states(cfg.text, lm, token_b[:, None], position_b[:, None], None, cache,
                             rope_cos_sin=rope_cos_sin)
    return logits_from_hidden(cfg.text, lm, h)[:, 0], cache


_prefill_jit = jax.jit(_prefill, static_argnames=("cfg", "max_len"))
_decode_jit = jax.jit(_decode, static_argnames=("cfg",))


def greedy_generate(cfg: VLConfig, params, tokens_bt, mask_bt, pixel_values, grid_thw, max_new_tokens: int):
    """Greedy tokens [B, max_new_tokens] with a KV cache: the tower and the prompt in one prefill,
    then one decode step per token, rotated by mask position + delta (the reference decode loop
    for image prompts; `rljax.sampling` draws from the same forward)."""
    tokens_bt, mask_bt = np.asarray(tokens_bt, np.int32), np.asarray(mask_bt).astype(bool)
    max_len = tokens_bt.shape[1] + max_new_tokens
    inputs = prepare_inputs(cfg, tokens_bt, mask_bt, pixel_values, grid_thw, num_positions=max_len)
    logits_bv, cache, position_b = _prefill_jit(cfg, params, tokens_bt, mask_bt, inputs, max_len=max_len)
    out = []
    for _ in range(max_new_tokens):
        token_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        out.append(token_b)
        position_b = position_b + 1
        logits_bv, cache = _decode_jit(cfg, params, token_b, position_b, cache, inputs.rope_cos_sin)
    return np.asarray(jnp.stack(out, axis=1))



def vl_token_logprobs(cfg: VLConfig, params, tokens_bt, mask_bt, inputs: VLInputs, *, train_vision: bool = True,
                      image_bt=None, **kwargs):
    """The trainer's log-probs (`rljax.models.token_logprobs`, aligned with `tokens_bt`) of token
    rows with images: the tower on the rows' images, spliced, M-RoPE tables. With
    `train_vision=False` the merged embeddings are a constant of the loss (a frozen tower: right for
    a pretrained one, never for a random one). Image tokens are attended to; the caller's loss mask
    (completion tokens) never trains on them. `image_bt` marks the slots that take the images
    (default: every real image token; an RL batch passes its prompts' only, so an image token the
    policy generated is text, as the sampler embedded it)."""
    image_nd = image_embeddings(cfg, params, inputs)
    if not train_vision:
        image_nd = jax.lax.stop_gradient(image_nd)
    image_bt = prompt_images(cfg, tokens_bt, mask_bt) if image_bt is None else image_bt
    return token_logprobs(cfg.text, spliced_params(cfg, params, image_nd, image_bt), tokens_bt, mask_bt,
                          default_positions(mask_bt), rope_cos_sin=inputs.rope_cos_sin, **kwargs)
