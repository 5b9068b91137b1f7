"""Images in the update: each row of a `RolloutBatch` carries its prompt's image patches.

    image_bmd = vision_tower(pixels_bnp[b], layout[b])        per row (vmapped), in the loss
    embed     = image_bmd[b, k] on row b's k-th image slot, else the text embedding
    logp      = token_logprobs(decoder, spliced embed, M-RoPE tables of row b)

Every leaf is row-aligned ([B, ...]), so the update's mini- and micro-batch splits (`rows`) and
shuffles cut the images with their rows. The tower therefore runs once per row in the update
(each row's gradient reaches it), while the sampler runs it once per prompt
(`rljax.sampling.vision`); the rows of a prompt carry the same patches, so both encode the same
embeddings. `train_b` False (`model.train_vision=false`) stops the gradient at the tower's output and the update zeroes
the tower's optimiser updates (`freeze_tower`), so a frozen tower is bitwise unchanged whatever
the optimiser's weight decay (right for a pretrained tower, never for a random one).
Image slots lie in the prompt, outside the loss mask: attended to, never trained on. Packed
micro-batches (`update.packing`) move each row's embeddings and M-RoPE tables with its tokens
(`VisionRows.splice` with a slab): packed equals padded.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from rljax.errors import ConfigError
from rljax.models.vision import PatchLayout, VisionConfig, vision_tower
from rljax.models.vlm import text_lookup, text_matrix


@flax.struct.dataclass
class RowImageSplice:
    """An embedding weight whose lookup puts row b's k-th merged image row (`image_bmd[b, k]`) on
    the k-th marked slot of row b (`image_bt`), the text embedding elsewhere. The row-aligned form
    of `rljax.models.vlm.ImageSplice` (same protocol as a LoRA adapter: `lookup`, `output_matrix`)."""

    embed: Any
    image_bmd: jax.Array
    image_bt: jax.Array

    def lookup(self, ids_bt, dtype):
        text_btd = text_lookup(self.embed, ids_bt, dtype)
        if self.image_bt.shape != ids_bt.shape:
            raise ValueError(f"RowImageSplice made for tokens {self.image_bt.shape} looked up with {ids_bt.shape}")
        k_bt = jnp.clip(jnp.cumsum(self.image_bt, axis=1) - 1, 0, self.image_bmd.shape[1] - 1)
        image_btd = jnp.take_along_axis(self.image_bmd.astype(jnp.float32), k_bt[..., None], axis=1)
        return jnp.where(self.image_bt[..., None], image_btd, text_btd)

    def output_matrix(self):
        return text_matrix(self.embed)


@flax.struct.dataclass
class VisionRows:
    """The image side of a batch, one entry per row. `pixels_bnp` [B, N, C*Tp*P*P] (each row's
    prompt images, padded to N patches), their layout ([B, N, 2] / [B, N] / [B, N]), `image_bt`
    [B, T] the slots that take merged rows (the prompt's image tokens), `cos_bph` / `sin_bph`
    [B, >= T, H] the M-RoPE tables by mask position (`rljax.models.mrope.mrope_table`)."""

    vision: VisionConfig = flax.struct.field(pytree_node=False)
    train_b: jax.Array  # bool [B]: the tower trains on this row (a leaf, so frozen and trained share one program)
    pixels_bnp: jax.Array
    hw_bn2: jax.Array
    image_bn: jax.Array
    window_bn: jax.Array
    image_bt: jax.Array
    cos_bph: jax.Array
    sin_bph: jax.Array

    def embeddings(self, visual_params, remat: bool | str = False) -> jax.Array:
        """Each row's merged image rows [B, N / 4, D] (f32); constant of the loss when frozen.

        The tower attends in query chunks that save no scores (`chunked=True`, the dense path's
        numbers) and recomputes its blocks in the backward per `remat` (`update.remat`, as the
        decoder): what the backward keeps is O(B x Lv x N x Dv) for these B rows (one micro-batch's
        in the update), not the B x Lv x Nv x N^2 scores and masks of the dense attention."""
        def one(pixels_np, hw_n2, image_n, window_n):
            return vision_tower(self.vision, visual_params, pixels_np, PatchLayout(hw_n2, image_n, window_n),
                                remat=remat, chunked=True)

        image_bmd = jax.vmap(one)(self.pixels_bnp, self.hw_bn2, self.image_bn, self.window_bn)
        return jnp.where(self.train_b[:, None, None], image_bmd, jax.lax.stop_gradient(image_bmd))

    def splice(self, params, slab=None, tokens_bt=None, attn_mask_bt=None,
               remat: bool | str = False) -> tuple[Any, dict[str, Any]]:
        """(the decoder's params with the images spliced into its embedding, the keyword arguments
        `token_logprobs` takes for these rows: their M-RoPE tables).

        With `slab` (a packed micro-batch, `rljax.update.packing.Slab`) both are the slab's: every
        real token of row b takes its padded row's embedding (image or text) at its buffer slot,
        and the tables are re-indexed by the buffers' running positions (`Slab.pack_tables`), so
        each packed row keeps its own images and M-RoPE positions. The tower still runs over the
        mini-batch's rows (`tokens_bt`, `attn_mask_bt`), once per slab. `remat`: the tower's
        (`embeddings`)."""
        if "visual" not in params:
            raise ConfigError("the batch carries images but the policy has no vision tower; load a qwen2_5_vl "
                              "checkpoint (or model.vision) or drop the images from the data")
        lm = {k: v for k, v in params.items() if k != "visual"}
        splice = RowImageSplice(lm["embed"], self.embeddings(params["visual"], remat), self.image_bt)
        tables = (self.cos_bph, self.sin_bph)
        if slab is None:
            return {**lm, "embed": splice}, {"rope_cos_sin": tables}
        embeds_nld = slab.pack(splice.lookup(tokens_bt, jnp.float32), attn_mask_bt)
        packed = RowImageSplice(lm["embed"], embeds_nld, jnp.ones(embeds_nld.shape[:2], bool))
        return {**lm, "embed": packed}, {"rope_cos_sin": slab.pack_tables(tables, attn_mask_bt)}


def freeze_tower(updates, vision: VisionRows | None):
    """The optimiser's updates with the tower's zeroed when the batch's tower is frozen (so
    weight decay and momentum cannot move it either); unchanged otherwise."""
    if vision is None or not isinstance(updates, dict) or "visual" not in updates:
        return updates
    train = jnp.any(vision.train_b)
    return {**updates, "visual": jax.tree.map(lambda u: jnp.where(train, u, jnp.zeros_like(u)), updates["visual"])}


# What the update does not run with images yet, each with the setting that turns it off.
UNSUPPORTED = (
    ("a value model", lambda state: state.algo.needs.values, "a critic-free algorithm (grpo)"),
    ("a teacher", lambda state: state.teacher is not None, "algorithm.distill='none'"),
    ("a learned reward", lambda state: state.reward_model is not None, "no [reward.model]"),
    ("token controls", lambda state: bool(state.algo.token_controls), "no Clip-Cov / KL-Cov / entropy selection"),
)


def check_vision_update(state) -> None:
    """One ConfigError line for an update feature that does not score image rows yet."""
    for what, on, fix in UNSUPPORTED:
        if on(state):
            raise ConfigError(f"image prompts: {what} does not score image rows yet; set {fix}")
