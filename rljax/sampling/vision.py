"""Sampling from image prompts: the tower once per prompt, then any scheduler's decode loop.

    image_nd = vision_tower(the B prompts' patches)          once per prompt, never per sample
    prompt   = prefill(prompts, embeddings spliced, M-RoPE)  B rows: (cache, last logits)
    decode   = the scheduler's loop on `prompt`, each row rotated by its prompt's table
               (text positions p + delta after the images)

The schedulers take two hooks in place of their own prompt pass and 1D rotary table: `prompt`
(the static sampler repeats its cache for the n samples; the continuous and paged ones put it
in their prompt pool, from which every admitted slot copies its prompt) and `prompt_rope`, the
prompts' M-RoPE tables by mask position (the static loop repeats them per sample; a slot reads
its prompt's, `rljax.sampling.slots.slot_rope`). So whichever scheduler decodes, the tower and
the prefill run once per prompt and the decode loop is the text one. Decode steps embed
generated tokens as text. Log-probs are the trainer's function on the decode logits, as for
text; the trainer scores the same tokens with `rljax.models.vlm.vl_token_logprobs`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rljax.errors import ConfigError, DataError
from rljax.models import default_positions, hidden_states, init_cache, logits_from_hidden, unstack_layers
from rljax.models.vlm import (ImageSplice, VLConfig, VLInputs, image_embeddings, prepare_inputs, prompt_images,
                              spliced_params, text_params)
from rljax.sampling import continuous as C
from rljax.sampling import decode as D
from rljax.sampling import paged as PG
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


def image_prompt_pass(cfg: VLConfig, params, prompt_bt, mask_bt, inputs: VLInputs, *, batch_invariant: bool = False):
    """The image prompts' (cache, last logits): the tower once over the B prompts' images, the
    embeddings spliced into the prefill with the M-RoPE tables. `batch_invariant`: each prompt's
    decoder pass alone, on its spliced embeddings, as `rljax.sampling.decode.prompt_forward` does."""
    image_nd = image_embeddings(cfg, params, inputs)  # [patches / 4, D]: the B prompts' images, once
    splice = spliced_params(cfg, params, image_nd, prompt_images(cfg, prompt_bt, mask_bt))
    if not batch_invariant:
        return vl_prompt_forward(cfg, unstack_layers(splice), prompt_bt, mask_bt, inputs.rope_cos_sin)
    lm = unstack_layers(text_params(params))
    embeds_btd = splice["embed"].lookup(prompt_bt, jnp.float32)

    def one(tokens, mask, embeds, rope):  # the row's embeddings as a splice over all of its slots
        row = {**lm, "embed": ImageSplice(lm["embed"], embeds[0], jnp.ones(tokens.shape, bool))}
        return vl_prompt_forward(cfg, row, tokens, mask, rope)

    cache, logits_bv = D.one_row_at_a_time(one, prompt_bt, mask_bt, embeds_btd, inputs.rope_cos_sin)
    return dict(cache, index=jnp.asarray(prompt_bt.shape[1], jnp.int32)), logits_bv


def scheduler_run(controls: SampleControls, cfg, num_prompts: int, prompt_len: int):
    """The traceable sampler `controls` names, as f(cfg, params, prompts, mask, key, max_new, scalars,
    rows, prompt=, prompt_rope=): static, continuous (slots) or paged; all take the image hooks."""
    spec = controls.static()
    if controls.scheduler != "continuous":
        return functools.partial(D.sample_static, spec=spec, num_samples=controls.num_samples,
                                 new_bucket=D.bucket_length(controls.max_new_tokens))
    layout = C.plan_layout(controls, num_prompts, prompt_len, cfg)
    return functools.partial(PG.sample_paged if layout.kv_layout == "paged" else C.sample_continuous, spec=spec,
                             layout=layout)


def sample_vl(cfg: VLConfig, params, prompt_bt, mask_bt, inputs: VLInputs, key, max_new, scalars, rows, *,
              controls: SampleControls) -> D.SampleResult:
    """Image prompts through the scheduler `controls` names, one traceable function (see the module
    docstring): B * n rows at the new-token bucket's width. `inputs.rope_cos_sin` must cover
    positions up to P + new_bucket."""
    check_image_controls(controls, cfg.text)
    prompt = image_prompt_pass(cfg, params, prompt_bt, mask_bt, inputs, batch_invariant=controls.batch_invariant)
    run = scheduler_run(controls, cfg.text, *prompt_bt.shape)
    return run(cfg.text, text_params(params), prompt_bt, mask_bt, key, max_new, scalars, rows, prompt=prompt,
               prompt_rope=inputs.rope_cos_sin)


def sample_static_vl(cfg: VLConfig, params, prompt_bt, mask_bt, inputs: VLInputs, key, max_new, scalars, rows, *,
                     spec: StaticControls, num_samples: int, new_bucket: int) -> D.SampleResult:
    """The static sampler for image prompts (`sample_vl` with the static scheduler's pieces)."""
    prompt = image_prompt_pass(cfg, params, prompt_bt, mask_bt, inputs, batch_invariant=spec.batch_invariant)
    return D.sample_static(cfg.text, text_params(params), prompt_bt, mask_bt, key, max_new, scalars, rows, spec=spec,
                           num_samples=num_samples, new_bucket=new_bucket, prompt=prompt,
                           prompt_rope=inputs.rope_cos_sin)


_vl_jit = jax.jit(sample_vl, static_argnames=("cfg", "controls"))


def check_image_controls(controls: SampleControls, text_cfg=None) -> None:
    """What image prompts do not sample with yet, one line each: recording an MoE decoder's routes
    with the continuous scheduler (its pool re-runs the prompts' routes without the images).
    Every scheduler takes image prompts otherwise."""
    if controls.scheduler == "continuous" and text_cfg is not None and D.records_routes(text_cfg, controls.static()):
        raise ConfigError("image prompts do not record MoE routes with sampling.scheduler='continuous' yet; "
                          "set sampling.scheduler='static' or sampling.record_routes=false")


def sample_images(images, params, prompt_bt, mask_bt, key, controls: SampleControls) -> D.SampleResult:
    """`sample_vl` on prompts with their `rljax.data.prompt_images.PromptImages`: P * n rows,
    prompt-major, `max_new_tokens` wide (traceable)."""
    rows = prompt_bt.shape[0] * controls.num_samples
    out = sample_vl(images.vl, params, prompt_bt, mask_bt, images.inputs, key, jnp.int32(controls.max_new_tokens),
                    controls.scalars(), jnp.int32(rows), controls=controls)
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
    spec = controls.static()
    tokens, mask = pad_prompts(cfg.text, prompt_tokens_bt, prompt_mask_bt, spec.pad_id)
    new_bucket = D.bucket_length(controls.max_new_tokens)
    num_patches = int(np.asarray(grid_thw).reshape(-1, 3).prod(axis=1).sum())
    inputs = prepare_inputs(cfg, tokens, mask, pixel_values, grid_thw, num_positions=tokens.shape[1] + new_bucket,
                            num_patches=patch_bucket(num_patches, cfg.vision.merge_unit))
    rows = tokens.shape[0] * controls.num_samples
    result = _vl_jit(cfg, params, tokens, mask, inputs, key, np.int32(controls.max_new_tokens), controls.scalars(),
                     np.int32(rows), controls=controls)
    return jax.device_put(trim(jax.device_get(result), rows, controls.max_new_tokens))
