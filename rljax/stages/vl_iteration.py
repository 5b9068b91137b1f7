"""One RL iteration on image prompts, compiled as one program:

    host:   examples -> image prompts (placeholders, patches, layouts, M-RoPE tables)   `vl_prompts`
    device: sample_static_vl (tower once per prompt, n samples share it)
            -> rollout_from_samples (verifier callback, the `RolloutBatch`)
            -> each row carries its prompt's images (`VisionRows`, repeated n times)
            -> update (log-probs over the text tokens, tower spliced per row; frozen or trained)

The same stages as `rljax.stages.iteration.make_iteration`, with the sampler swapped for the
image sampler and the batch given its images; the update is `rljax.update.update` unchanged
(its loss splices `batch.vision`). Static scheduler only (`rljax.sampling.vision`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax.data.images import ImageConfig
from rljax.data.vl_rows import image_prompts
from rljax.errors import ConfigError
from rljax.models.vlm import VLConfig, VLInputs, prepare_inputs
from rljax.sampling import SampleControls
from rljax.sampling import decode as D
from rljax.sampling.continuous import trim
from rljax.sampling.vision import patch_bucket, require_vision, sample_static_vl
from rljax.stages.iteration import merge_metrics
from rljax.stages.rollout import rollout_from_samples
from rljax.update import update
from rljax.update.vision import VisionRows


def check_image_controls(controls: SampleControls) -> None:
    """Image prompts sample with the static scheduler: one line naming it otherwise."""
    if controls.scheduler != "static":
        raise ConfigError(f"image prompts sample with sampling.scheduler='static' (the tower runs once per prompt "
                          f"before a static decode); the {controls.scheduler!r} scheduler does not take images yet")


def vl_prompts(vl_cfg: VLConfig, examples, tokens_pt, mask_pt, controls: SampleControls, *, train_vision: bool,
               image_cfg: ImageConfig = ImageConfig(), width: int | None = None, num_patches: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, VLInputs, VisionRows]:
    """Host: (tokens, mask, the sampler's `VLInputs`, the per-prompt `VisionRows`) of a batch of
    examples whose metadata holds images (`rljax.data.vl_rows`). The tables cover the prompt
    plus the sampler's decode bucket."""
    p = image_prompts(vl_cfg, examples, tokens_pt, mask_pt, image_cfg=image_cfg,
                      pad_id=controls.pad_id or 0, width=width, num_patches=num_patches)
    positions = p.tokens_pt.shape[1] + D.bucket_length(controls.max_new_tokens)
    flat = patch_bucket(int(np.asarray(p.grid_thw).prod(axis=1).sum()), vl_cfg.vision.merge_unit)
    inputs = prepare_inputs(vl_cfg, p.tokens_pt, p.mask_pt, p.pixel_values, p.grid_thw, num_positions=positions,
                            num_patches=flat)
    cos, sin = inputs.rope_cos_sin
    rows = VisionRows(vision=vl_cfg.vision, train_vision=train_vision, pixels_bnp=jnp.asarray(p.pixels_pnd),
                      hw_bn2=jnp.asarray(p.layout.hw_n2), image_bn=jnp.asarray(p.layout.image_n),
                      window_bn=jnp.asarray(p.layout.window_n),
                      image_bt=jnp.asarray((p.tokens_pt == vl_cfg.image_token_id) & p.mask_pt), cos_bph=cos, sin_bph=sin)
    return p.tokens_pt, p.mask_pt, inputs, rows


def with_completions(rows: VisionRows, n: int, completion_len: int) -> VisionRows:
    """The prompts' `VisionRows` for their n samples each (prompt-major), the image slots
    extended over the completion columns (a generated image token is text)."""
    rep = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
    image_bt = rep(rows.image_bt)
    image_bt = jnp.concatenate([image_bt, jnp.zeros((image_bt.shape[0], completion_len), bool)], axis=1)
    return rows.replace(pixels_bnp=rep(rows.pixels_bnp), hw_bn2=rep(rows.hw_bn2), image_bn=rep(rows.image_bn),
                        window_bn=rep(rows.window_bn), image_bt=image_bt, cos_bph=rep(rows.cos_bph),
                        sin_bph=rep(rows.sin_bph))


def vl_rollout(vl_cfg: VLConfig, params, tokens_pt, mask_pt, inputs: VLInputs, rows: VisionRows, index_p, key, *,
               controls: SampleControls, reward_callback: Callable):
    """Sample (tower once per prompt), score, and give each row of the `RolloutBatch` its images."""
    spec, n = controls.static(), controls.num_samples
    new_bucket = D.bucket_length(controls.max_new_tokens)
    num_rows = tokens_pt.shape[0] * n
    out = sample_static_vl(vl_cfg, params, tokens_pt, mask_pt, inputs, key, jnp.int32(controls.max_new_tokens),
                           controls.scalars(), jnp.int32(num_rows), spec=spec, num_samples=n, new_bucket=new_bucket)
    out = trim(out, num_rows, controls.max_new_tokens)
    batch, metrics, preview = rollout_from_samples(vl_cfg.text, params, out, tokens_pt, mask_pt, index_p, key,
                                                   controls=controls, reward_callback=reward_callback,
                                                   num_groups=tokens_pt.shape[0])
    return batch.replace(vision=with_completions(rows, n, out.tokens.shape[1])), metrics, preview


def make_vl_iteration(vl_cfg, controls: SampleControls, reward_callback: Callable):
    """`iteration(state, tokens_pt, mask_pt, inputs, rows, index_p, key) -> (state, metrics,
    preview)`, ONE jitted program with the state donated (`state.model_cfg` is the decoder's
    config; `state.params` holds `visual`). Every prompt is a group (no dynamic sampling)."""
    vl_cfg = require_vision(vl_cfg)
    check_image_controls(controls)

    def iteration(state, tokens_pt, mask_pt, inputs, rows, index_p, key):
        k_sample, k_update = jax.random.split(key)
        batch, rollout_metrics, preview = vl_rollout(vl_cfg, state.sampler_params(), tokens_pt, mask_pt, inputs, rows,
                                                     index_p, k_sample, controls=controls,
                                                     reward_callback=reward_callback)
        state, train_metrics = update(state, batch, k_update)
        return state, merge_metrics(rollout_metrics, train_metrics), preview

    return jax.jit(iteration, donate_argnums=(0,))
