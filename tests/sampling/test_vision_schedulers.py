"""Image prompts through the continuous and paged schedulers (`rljax.sampling.vision.sample_vl`):
the same tokens as the static scheduler, the trainer's log-probs, the tower once per prompt.
The prompts are `tests/sampling/test_vision.py`'s (two images of 10 x 14 and 6 x 8 patches,
different M-RoPE deltas), on a one-layer decoder and a one-block windowed tower."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import preset
from rljax.models.vision import VisionConfig
from rljax.models.vlm import VLConfig, init_vl_params, prepare_inputs, vl_token_logprobs
from rljax.sampling import SampleControls
from rljax.sampling.vision import generate_vl, patch_bucket, sample_vl
from vl_prompts import END, GRIDS, IMAGE, START, placeholder_batch, sampler_inputs, tower_rows

N = 3  # samples per prompt: 6 rows through 2 slots, so every slot is refilled across prompts
BASE = SampleControls(max_new_tokens=8, num_samples=N, temperature=1.0, batch_invariant=True)
SCHEDULERS = {"continuous": BASE.replace(scheduler="continuous", slots=2),
              "paged": BASE.replace(scheduler="continuous", slots=2, kv_layout="paged", max_total_tokens=256,
                                    page_size=8)}


def _batch():
    return placeholder_batch()


@pytest.fixture(scope="module")
def model():
    text = preset("qwen2-test", vocab_size=128, tie_embeddings=False, num_layers=1)
    vision = VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                          window_size=56, fullatt_block_indexes=())
    cfg = VLConfig(text=text, vision=vision, image_token_id=IMAGE, vision_start_token_id=START,
                   vision_end_token_id=END, video_token_id=121, mrope_section=(2, 3, 3))
    return cfg, init_vl_params(cfg, jax.random.key(0), std=0.2)


@pytest.fixture(scope="module")
def sampled(model):
    """Each scheduler's batch-invariant result on the same prompts and key."""
    cfg, params = model
    tokens, mask, pixels = _batch()
    run = lambda controls: jax.device_get(generate_vl(cfg, params, tokens, mask, pixels, GRIDS,
                                                      key=jax.random.key(1), controls=controls))
    return {"static": run(BASE), **{name: run(c) for name, c in SCHEDULERS.items()}}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_equal_to_static_bitwise(sampled, name):
    """Batch-invariant continuous (2 slots for 6 rows) and paged sampling of image prompts give the
    static scheduler's tokens, log-probs, masks and finish reasons bit for bit. Catches: a slot
    decoding with the 1D table or another prompt's M-RoPE table (its row's delta lost on refill),
    a prompt pool prefilled without the image splice or without the M-RoPE prompt tables."""
    want, got = sampled["static"], sampled[name]
    assert got.tokens.shape == (2 * N, 8) and want.mask.all()
    for field in ("tokens", "logprobs", "mask", "finish_reason"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_logprobs_equal_trainer(model, sampled, name):
    """Each token's sampled log-prob equals the trainer's `vl_token_logprobs` over prompt +
    completion (images re-encoded per row) within 1e-5 in f32."""
    cfg, params = model
    tokens, mask, pixels = _batch()
    res = sampled[name]
    full = np.concatenate([np.repeat(tokens, N, axis=0), res.tokens], axis=1)
    full_mask = np.concatenate([np.repeat(mask, N, axis=0), res.mask], axis=1)
    split = np.cumsum(GRIDS.prod(axis=1))[:-1]
    pix = np.concatenate([np.concatenate([p] * N) for p in np.split(pixels, split)])
    image_bt = np.zeros(full.shape, bool)
    image_bt[:, :tokens.shape[1]] = np.repeat(tokens == IMAGE, N, axis=0)
    inputs = prepare_inputs(cfg, full, full_mask, pix, np.repeat(GRIDS, N, axis=0), num_positions=full.shape[1],
                            image_bt=image_bt)
    logp = jax.jit(lambda p, t, m, i, im: vl_token_logprobs(cfg, p, t, m, i, image_bt=im)[0])(
        params, jnp.asarray(full, jnp.int32), jnp.asarray(full_mask), inputs, jnp.asarray(image_bt))
    np.testing.assert_allclose(res.logprobs, np.asarray(logp)[:, tokens.shape[1]:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_tower_runs_once_per_prompt(model, name):
    """The traced continuous / paged rollout has one patch-embedding matmul with the prompts'
    patch count as rows, at n = 1 and n = 4 samples. Catches: re-encoding the image per sample
    (pixels repeated n times: n x the rows) or per admitted slot (a matmul inside the loop)."""
    cfg, params = model
    tokens, mask, inputs = sampler_inputs(cfg)
    num_patches = patch_bucket(int(GRIDS.prod(axis=1).sum()))  # the prompts' patches, bucketed
    for n in (1, 4):
        controls = SCHEDULERS[name].replace(num_samples=n, max_new_tokens=4, batch_invariant=False)
        jaxpr = jax.make_jaxpr(lambda p, i: sample_vl(cfg, p, tokens, mask, i, jax.random.key(0), np.int32(4),
                                                      controls.scalars(), np.int32(2 * n), controls=controls))(
            params, inputs)
        assert tower_rows(jaxpr.jaxpr, cfg.vision.patch_dim) == [num_patches]


def test_moe_routes_with_continuous_images_is_one_line():
    """Recording an MoE decoder's routes on image prompts with the continuous scheduler (its pool
    would record the prompt routes without the images) is one line naming the fix; a dense
    decoder, or the static scheduler, is accepted."""
    from rljax.errors import ConfigError
    from rljax.models.moe_config import MoEConfig
    from rljax.sampling.vision import check_image_controls

    moe = preset("qwen2-test", moe=MoEConfig(num_experts=4, top_k=2, expert_size=32))
    controls = SCHEDULERS["paged"].replace(record_routes=True)
    with pytest.raises(ConfigError, match="record_routes=false") as err:
        check_image_controls(controls, moe)
    assert "\n" not in str(err.value)
    check_image_controls(controls, preset("qwen2-test"))
    check_image_controls(BASE.replace(record_routes=True), moe)
