"""Packed micro-batches of image rows (`rljax.update.packing` with `rljax.update.vision`): each
packed row keeps its own image splice and M-RoPE positions, so the packed loss and gradients
equal the padded ones; image tokens are attended to (they move the loss) but never trained on."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.data.prompt_images import ImagePrompter
from rljax.models import preset
from rljax.models.vision import VisionConfig
from rljax.models.vlm import VLConfig, init_vl_params
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, microbatch_loss, prepare_batch
from rljax.update import packing as P
from rljax.update.loss import aggregation_denominator
from vl_prompts import visual_prompts

IMAGE, START, END = 120, 118, 119
N, NEW = 2, 6  # samples per prompt, completion columns


@pytest.fixture(scope="module")
def setup():
    """Three generated pictures (84 px, 9 image tokens each) behind text prompts of 5, 3 and 4
    tokens (so the images start at different positions), 2 ragged completions each."""
    text = preset("qwen2-test", vocab_size=128, tie_embeddings=False, num_layers=1)
    vision = VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                          window_size=56, fullatt_block_indexes=())
    vl = VLConfig(text=text, vision=vision, image_token_id=IMAGE, vision_start_token_id=START,
                  vision_end_token_id=END, video_token_id=121, mrope_section=(2, 3, 3))
    examples, tokens, mask = visual_prompts()
    width = tokens.shape[1]
    rng = np.random.default_rng(0)
    prompter = ImagePrompter.build(vl, examples, max_prompt_tokens=width, max_new_tokens=NEW, pad_id=0,
                                   train_vision=True)
    toks, msk, images = prompter(examples, tokens, mask)
    b = 3 * N
    lengths = np.array([6, 2, 4, 1, 5, 3])
    comp = rng.integers(4, 100, (b, NEW))
    comp_mask = np.arange(NEW)[None, :] < lengths[:, None]
    all_toks = np.concatenate([np.repeat(toks, N, axis=0), np.where(comp_mask, comp, 0)], axis=1)
    attn = np.concatenate([np.repeat(msk, N, axis=0), comp_mask], axis=1)
    loss = np.concatenate([np.zeros_like(np.repeat(msk, N, axis=0)), comp_mask], axis=1)
    batch = RolloutBatch(tokens_bt=jnp.asarray(all_toks, jnp.int32), attn_mask_bt=jnp.asarray(attn),
                         loss_mask_bt=jnp.asarray(loss),
                         sampler_logp_bt=jnp.asarray(np.where(loss, -2.0 + 0.1 * rng.standard_normal(loss.shape), 0),
                                                     jnp.float32),
                         rewards_b=jnp.asarray(rng.random(b), jnp.float32), group_ids_b=prompt_major_group_ids(b, N),
                         completion_len=NEW, vision=images.rows_for(jnp.arange(3), N, NEW))
    params = init_vl_params(vl, jax.random.key(0), std=0.2)
    state = init_train_state(vl.text, params, AlgorithmConfig(algorithm="grpo", kl_coef=0.0, entropy_coef=0.01),
                             OptimConfig(learning_rate=1e-3, eps=1.0), update_cfg=UpdateConfig(),
                             key=jax.random.key(1))
    prepared, _ = prepare_batch(state, batch)
    den = aggregation_denominator(prepared, state.algo, NEW)
    loss_grad = jax.jit(jax.value_and_grad(functools.partial(
        microbatch_loss, cfg=vl.text, algo=state.algo, update_cfg=state.update_cfg, norm_length=NEW), has_aux=True))
    return state, prepared, den, loss_grad


def _packed(state, prepared, den, loss_grad, per):
    """Summed loss and gradients over packed slabs of `per` buffers of 3 row widths."""
    plan = P.pack_rows(prepared.attn_mask_bt, prepared.loss_mask_bt, 3 * prepared.tokens_bt.shape[1])
    n = int(plan.num_buffers)
    slabs = [P.Slab(plan, jnp.asarray(i * per), per) for i in range(-(-n // per))]
    total, grads = 0.0, None
    for slab in slabs:
        (loss, _), g = loss_grad(state.trainable, prepared, den, share=1.0 / len(slabs), slab=slab)
        total += loss
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    return plan, total, grads


def _assert_equal(a, b, what):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0,
                                   err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def test_packed_image_rows_equal_padded(setup):
    """The packed loss and every gradient leaf (the tower's included) equal the padded
    micro-batch's within 1e-5 (f32), with one buffer per slab (slabs past the first included)
    and several rows in a buffer (their running positions are not their own). Catches: a packed
    row rotated by its running position instead of its own M-RoPE position, the tables indexed
    by the row's position in a buffer read by running position, a row's image embeddings (or
    text) landing in another row's slots."""
    state, prepared, den, loss_grad = setup
    (loss_pad, _), g_pad = loss_grad(state.trainable, prepared, den)
    plan, loss, grads = _packed(state, prepared, den, loss_grad, 1)
    assert 1 < int(plan.num_buffers) < 3 * N  # rows share buffers, and there is more than one slab
    np.testing.assert_allclose(float(loss), float(loss_pad), atol=1e-5, rtol=0)
    _assert_equal(grads, g_pad, "packed")
    # image tokens: attended to (the tower gets a gradient), never trained on (outside the loss mask)
    assert float(jnp.abs(grads[0]["visual"]["patch_embed"]).max()) > 0
    assert not bool(jnp.any((prepared.loss_mask_bt > 0) & (prepared.tokens_bt == IMAGE)))

