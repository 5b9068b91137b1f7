"""Sampling from image prompts: the tower once per prompt, then the static decode loop.

    image_nd = vision_tower(the B prompts' patches)          once per prompt, never per sample
    cache    = prefill(prompts, embeddings spliced, M-RoPE)  B rows
    cache    = repeat(cache, n)                              the n samples share the prefill
    decode   = `rljax.sampling.decode`'s loop, rotated by position + delta per row

It is `rljax.sampling.decode.sample_static` with two inputs swapped: the prompt pass (the
spliced embeddings and the per-row M-RoPE tables, `rljax.models.vlm`) and the decode loop's
rotary table (each row's text continuation after its images). Decode steps embed generated
tokens as text. Log-probs are the trainer's function on the decode logits, as for text; the
trainer scores the same tokens with `rljax.models.vlm.vl_token_logprobs`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rljax.errors import ConfigError, DataError
from rljax.models import default_positions, hidden_states, init_cache, logits_from_hidden, unstack_layers
from rljax.models.vlm import (VLConfig, VLInputs, image_embeddings, prepare_inputs, prompt_images, spliced_params,
                              text_params)
from rljax.sampling import decode as D
from rljax.sampling.continuous import trim
from rljax.sampling.controls import SampleControls, StaticControls
from rljax.sampling.sampler import generate, pad_prompts
from rljax.sampling.traced import sample


def require_vision(cfg, what: str = "images") -> VLConfig:
    """`cfg` if it has a vision tower; else one DataError line."""
    if not isinstance(cfg, VLConfig):
        raise DataError(f"the model ({getattr(cfg, 'model_type', type(cfg).__name__)}) has no vision tower but the "
                        f"prompts have {what}; load a vision-language checkpoint (qwen2_5_vl) or drop the images")
    return cfg


def vl_prompt_forward(cfg: VLConfig, lm_params, prompt_bt, mask_bt, rope_cos_sin):
    """The image prompts' pass: (a KV cache of P slots, the logits after the last real token)."""
    b, p = prompt_bt.shape
    h_btd, cache = hidden_states(cfg.text, lm_params, prompt_bt, default_positions(mask_bt), mask_bt,
                                 init_cache(cfg.text, b, p), rope_cos_sin=rope_cos_sin)
    last_b = p - 1 - jnp.argmax(jnp.flip(mask_bt, axis=1), axis=1)
    h_b1d = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)
    return cache, logits_from_hidden(cfg.text, lm_params, h_b1d)[:, 0]


def sample_static_vl(cfg: VLConfig, params, prompt_bt, mask_bt, inputs: VLInputs, key, max_new, scalars, rows, *,
                     spec: StaticControls, num_samples: int, new_bucket: int) -> D.SampleResult:
    """The static sampler for image prompts, one traceable function (see the module docstring).
    `inputs.rope_cos_sin` must cover positions up to P + new_bucket."""
    image_nd = image_embeddings(cfg, params, inputs)  # [patches / 4, D]: the B prompts' images, once
    prompt_params = unstack_layers(spliced_params(cfg, params, image_nd, prompt_images(cfg, prompt_bt, mask_bt)))
    decode_params = unstack_layers(text_params(params))
    prompt = vl_prompt_forward(cfg, prompt_params, prompt_bt, mask_bt, inputs.rope_cos_sin)
    state = D.prefill(cfg.text, decode_params, prompt_bt, mask_bt, key, max_new, scalars, spec=spec,
                      num_samples=num_samples, new_bucket=new_bucket, rows=rows, prompt=prompt)
    tables = tuple(jnp.repeat(t, num_samples, axis=0) for t in inputs.rope_cos_sin)
    state = D.decode_phases(cfg.text, decode_params, state, spec=spec, new_bucket=new_bucket,
                            decode=functools.partial(D.decode, rope_cos_sin=tables))
    return D.to_result(state, width=new_bucket)


_static_vl_jit = jax.jit(sample_static_vl, static_argnames=("cfg", "spec", "num_samples", "new_bucket"))


def check_image_controls(controls: SampleControls) -> None:
    """Image prompts sample with the static scheduler: one line naming it otherwise."""
    if controls.scheduler != "static":
        raise ConfigError(f"image prompts sample with sampling.scheduler='static' (the tower runs once per prompt "
                          f"before a static decode); the {controls.scheduler!r} scheduler does not take images yet")


def sample_images(images, params, prompt_bt, mask_bt, key, controls: SampleControls) -> D.SampleResult:
    """`sample_static_vl` on prompts with their `rljax.data.prompt_images.PromptImages`: P * n rows,
    prompt-major, `max_new_tokens` wide (traceable)."""
    check_image_controls(controls)
    rows = prompt_bt.shape[0] * controls.num_samples
    new_bucket = D.bucket_length(controls.max_new_tokens)
    out = sample_static_vl(images.vl, params, prompt_bt, mask_bt, images.inputs, key,
                           jnp.int32(controls.max_new_tokens), controls.scalars(), jnp.int32(rows),
                           spec=controls.static(), num_samples=controls.num_samples, new_bucket=new_bucket)
    return trim(out, rows, controls.max_new_tokens)


def sample_prompts(cfg, params, prompt_bt, mask_bt, key, controls: SampleControls, images=None) -> D.SampleResult:
    """The rollout's sampler (traceable): `rljax.sampling.sample` on text prompts (`images` None),
    `sample_images` on prompts with images (the tower once per prompt)."""
    if images is None:
        return sample(cfg, params, prompt_bt, mask_bt, key, controls)
    return sample_images(images, params, prompt_bt, mask_bt, key, controls)


_images_jit = jax.jit(sample_images, static_argnames=("controls",))


def generate_prompts(cfg, params, prompt_bt, mask_bt, *, key: jax.Array, controls: SampleControls,
                     images=None) -> D.SampleResult:
    """`rljax.sampling.generate` (host entry, the evaluator's) for text prompts, or for prompts
    with their `PromptImages` the jitted `sample_images`."""
    if images is None:
        return generate(cfg, params, prompt_bt, mask_bt, key=key, controls=controls)
    return _images_jit(images, params, prompt_bt, mask_bt, key, controls)


def patch_bucket(num_patches: int, unit: int = 4) -> int:
    """Patches padded to the next power of two (>= 64), so image batches compile once per bucket."""
    return max(64, 1 << max(num_patches - 1, 0).bit_length(), unit)


def generate_vl(cfg, params, prompt_tokens_bt, prompt_mask_bt, pixel_values, grid_thw, *, key: jax.Array,
                controls: SampleControls) -> D.SampleResult:
    """`rljax.sampling.generate` for prompts with images: `pixel_values` and `grid_thw` as
    `rljax.data.images.preprocess` makes them, the images in row-major order of the prompts'
    placeholders. Returns B * num_samples rows, prompt-major."""
    cfg = require_vision(cfg)
    if controls.scheduler != "static":
        raise ConfigError(f"image prompts sample with scheduler='static' for now, got {controls.scheduler!r}")
    spec = controls.static()
    tokens, mask = pad_prompts(cfg.text, prompt_tokens_bt, prompt_mask_bt, spec.pad_id)
    new_bucket = D.bucket_length(controls.max_new_tokens)
    num_patches = int(np.asarray(grid_thw).reshape(-1, 3).prod(axis=1).sum())
    inputs = prepare_inputs(cfg, tokens, mask, pixel_values, grid_thw, num_positions=tokens.shape[1] + new_bucket,
                            num_patches=patch_bucket(num_patches, cfg.vision.merge_unit))
    rows = tokens.shape[0] * controls.num_samples
    result = _static_vl_jit(cfg, params, tokens, mask, inputs, key, np.int32(controls.max_new_tokens),
                            controls.scalars(), np.int32(rows), spec=spec, num_samples=controls.num_samples,
                            new_bucket=new_bucket)
    return jax.device_put(trim(jax.device_get(result), rows, controls.max_new_tokens))
