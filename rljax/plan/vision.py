"""What `rljax plan` says about a vision-language recipe: the tower's parameters and the image
tokens per prompt, and how often the tower runs per iteration.

    tower params     = VisionConfig.num_params()   (patch embedding, blocks, merger)
    image tokens     = t h w / 4 per image, (h, w) the resized image in 14-px patches
                       (`rljax.data.images.fit_size`), + vision_start / vision_end
    tower patches    rollout: prompts x patches (once per prompt, shared by its samples);
                     update: prompts x samples x patches (once per row, each row's gradient)

The memory plan of the compiled VL programs is not written yet: `rljax plan` prints these
counts and stops before compiling (the text programs would leave the tower out).
"""

from __future__ import annotations

import dataclasses

from rljax.data.images import ImageConfig, fit_size, image_tokens
from rljax.models.vl_setup import scratch_vl_config


@dataclasses.dataclass(frozen=True)
class VisionPlan:
    decoder_params: int
    tower_params: int
    image_tokens: int  # per image, without vision_start / vision_end
    patches: int  # per image
    prompts: int
    samples: int
    image_source: str  # where the image size comes from

    def lines(self) -> list[str]:
        total = self.decoder_params + self.tower_params
        return [f"vision-language: {total / 1e6:,.3f}M params = decoder {self.decoder_params / 1e6:,.3f}M + vision "
                f"tower {self.tower_params / 1e6:,.3f}M ({100 * self.tower_params / total:.1f}%)",
                f"images: {self.image_tokens} image tokens (+2 delimiters) and {self.patches} patches per image "
                f"({self.image_source})",
                f"tower per iteration: rollout {self.prompts * self.patches} patches (once per prompt), update "
                f"{self.prompts * self.samples * self.patches} patches (once per row)",
                "memory plan of the vision-language programs: not written yet (these counts only)"]


def vision_plan(cfg, text_cfg) -> VisionPlan | None:
    """The counts of a recipe with `[model.vision]` (None for a text recipe). `text_cfg` is the
    tokenizer-sized decoder (`policy_config`); a visual task's image side is its `image_size`,
    any other source's the processor's pixel budget (an upper bound)."""
    if not cfg.model.vision.enabled:
        return None
    vl = scratch_vl_config(cfg.model.vision, text_cfg)
    images = ImageConfig()
    if cfg.data.source == "visual":
        side = int(dict(cfg.data.task_kwargs).get("image_size", 112))
        h, w = fit_size(side, side, images)
        source = f"{side} x {side} px generated pictures"
    else:
        h = w = int((images.max_pixels ** 0.5) // images.factor * images.factor)
        source = f"at most, images.max_pixels = {images.max_pixels}"
    grid = (1, h // images.patch_size, w // images.patch_size)
    return VisionPlan(decoder_params=vl.text.num_params(), tower_params=vl.vision.num_params(),
                      image_tokens=image_tokens(grid, images), patches=grid[1] * grid[2],
                      prompts=cfg.rl.num_prompts, samples=cfg.sampling.num_samples, image_source=source)
