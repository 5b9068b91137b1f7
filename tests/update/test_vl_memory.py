"""The vision tower's memory in the update (issue 49): its work follows the micro-batch, its
blocks are recomputed in the backward with `update.remat`, its attention saves no [Np x Np]
scores, and none of that moves the numbers (the dense, un-rematerialised tower is the reference)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.data.prompt_images import ImagePrompter
from rljax.data.vl_rows import visual_examples
from rljax.models import preset
from rljax.models import vision as V
from rljax.models.vlm import VLConfig, init_vl_params
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, microbatch_loss, prepare_batch, update_step
from rljax.update import vision as UV
from rljax.update.loss import aggregation_denominator

IMAGE, START, END = 120, 118, 119
PROMPTS, N, NEW, HEADS = 4, 2, 4, 4
SIZE = 224  # 16 x 16 = 256 patches a picture: the attention's scores dominate what a dense tower saves


def _vl(depth: int) -> VLConfig:
    text = preset("qwen2-test", vocab_size=128, tie_embeddings=False, num_layers=1)
    vision = V.VisionConfig(depth=depth, hidden_size=32, num_heads=HEADS, intermediate_size=48, out_hidden_size=64,
                            window_size=56, fullatt_block_indexes=(depth - 1,))
    return VLConfig(text=text, vision=vision, image_token_id=IMAGE, vision_start_token_id=START,
                    vision_end_token_id=END, video_token_id=121, mrope_section=(2, 3, 3))


@functools.lru_cache(maxsize=None)
def _setup(depth: int, micro: int, remat: bool, size: int = SIZE, abstract: bool = False):
    """(state, batch): PROMPTS generated pictures of `size` px x N samples, NEW completion tokens;
    `abstract`: the state's arrays as shapes only (enough to compile)."""
    vl = _vl(depth)
    examples = visual_examples("count", "train", PROMPTS, size=size)
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 100, (PROMPTS, 4)).astype(np.int32)
    prompter = ImagePrompter.build(vl, examples, max_prompt_tokens=4, max_new_tokens=NEW, pad_id=0, train_vision=True)
    toks, msk, images = prompter(examples, tokens, np.ones_like(tokens, bool))
    b = PROMPTS * N
    comp = rng.integers(4, 100, (b, NEW)).astype(np.int32)
    ones = np.ones((b, NEW), bool)
    batch = RolloutBatch(
        tokens_bt=jnp.asarray(np.concatenate([np.repeat(toks, N, 0), comp], 1)),
        attn_mask_bt=jnp.asarray(np.concatenate([np.repeat(msk, N, 0), ones], 1)),
        loss_mask_bt=jnp.asarray(np.concatenate([np.zeros_like(np.repeat(msk, N, 0)), ones], 1)),
        sampler_logp_bt=jnp.asarray(-2.0 + 0.1 * rng.standard_normal((b, toks.shape[1] + NEW)), jnp.float32),
        rewards_b=jnp.asarray(rng.random(b), jnp.float32), group_ids_b=prompt_major_group_ids(b, N),
        completion_len=NEW, vision=images.rows_for(jnp.arange(PROMPTS), N, NEW))
    def make(key):
        return init_train_state(vl.text, init_vl_params(vl, key, std=0.2), AlgorithmConfig(algorithm="grpo",
                                                                                          kl_coef=0.0),
                                OptimConfig(learning_rate=1e-3), update_cfg=UpdateConfig(num_microbatches=micro,
                                                                                         remat=remat))

    key = jax.random.key(0)
    return (jax.eval_shape(make, key) if abstract else jax.jit(make)(key)), batch


@functools.lru_cache(maxsize=None)
def _temp_bytes(depth: int, micro: int, remat: bool = True) -> int:
    state, batch = _setup(depth, micro, remat, abstract=True)
    compiled = update_step.lower(state, batch, jax.random.key(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _scores_bytes(rows: int) -> int:
    """One block's dense attention scores over `rows` rows: rows x heads x Np^2 f32."""
    patches = (SIZE // 14) ** 2
    return rows * HEADS * patches**2 * 4


def test_tower_memory_follows_the_microbatch():
    """8 rows in 4 micro-batches plan under half the temporaries of 8 rows in 1. Running the tower
    over the whole mini-batch's rows in every micro-batch fails this."""
    one, four = _temp_bytes(2, 1), _temp_bytes(2, 4)
    assert four < 0.5 * one, (four, one)


def test_remat_tower_saves_no_scores_per_block():
    """With `update.remat`, each extra tower block adds well under one block's [heads, Np, Np]
    scores to the plan (its input is what the backward keeps). A tower that saves its blocks'
    scores and probabilities for the backward (no remat, or the dense attention under a
    dot-saving policy) adds at least two blocks' worth per block and fails this."""
    shallow, deep = _temp_bytes(2, 1), _temp_bytes(4, 1)
    per_block = (deep - shallow) / 2
    assert per_block < 0.25 * _scores_bytes(PROMPTS * N), (shallow, deep, _scores_bytes(PROMPTS * N))


def _reference_tower(vcfg, vparams, pixels_np, layout, *, remat=False, chunked=False):
    """The dense, un-rematerialised tower (what the update ran before issue 49's fix)."""
    return V.vision_tower(vcfg, vparams, pixels_np, layout)


def test_chunked_remat_tower_keeps_the_loss_and_gradients(monkeypatch):
    """The update's loss and gradients (remat, tower trained; 112 px pictures: 64 patches in 4
    query chunks of 16, 4 windows and a full-attention block) equal the dense un-rematerialised
    tower's within 1e-6 (f32). A chunk that attends within its own queries only, or a segment
    mask off by a chunk, fails this."""
    monkeypatch.setattr(V, "ATTENTION_CHUNK", 16)
    state, batch = _setup(2, 1, True, size=112)
    prepared, _ = jax.jit(prepare_batch)(state, batch)
    den = aggregation_denominator(prepared, state.algo, NEW)

    def loss_grad():  # a fresh function each call: traced anew, so the patched tower is what runs
        fn = functools.partial(microbatch_loss, cfg=state.model_cfg, algo=state.algo, update_cfg=state.update_cfg,
                               norm_length=NEW)
        return jax.jit(jax.value_and_grad(fn, has_aux=True))(state.trainable, prepared, den)

    (loss, _), grads = loss_grad()
    monkeypatch.setattr(UV, "vision_tower", _reference_tower)
    (ref_loss, _), ref_grads = loss_grad()
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-7)
    flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    scale = max(float(jnp.max(jnp.abs(g))) for g in ref_flat)
    for g, r in zip(flat, ref_flat):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-6 * max(scale, 1.0))
    tower = jax.tree.leaves(grads[0]["visual"])
    assert max(float(jnp.max(jnp.abs(g))) for g in tower) > 1e-4  # the tower trains: its gradient is checked


def test_chunked_attention_equals_dense_with_padding_patches():
    """The tower alone (a window block, a full block) over two images and padding patches
    (segment -1), 3 query chunks: merged
    rows equal the dense path's within 1e-6, the pixel gradient within 1e-5 of its largest entry
    (f32 rounding through two blocks of a std-0.3 tower reaches 4e-6 of it; a chunk that drops
    keys outside itself, or the padding's segment, moves it by O(1))."""
    vcfg = _vl(2).vision
    vparams = V.init_vision_params(vcfg, jax.random.key(2), std=0.3)
    layout = V.patch_layout(vcfg, np.array([[1, 8, 12], [1, 4, 4]]), num_patches=120)
    pixels = jax.random.normal(jax.random.key(3), (120, vcfg.patch_dim))
    tower = lambda chunked, p: V.vision_tower(vcfg, vparams, p, layout, chunked=chunked)  # noqa: E731
    f = lambda chunked, p: jnp.sum(jnp.sin(tower(chunked, p)))  # noqa: E731
    assert V.query_chunk(120, 48) == 40
    dense_g = jax.jit(jax.grad(functools.partial(f, False)))(pixels)
    dense = jax.jit(functools.partial(tower, False))(pixels)
    old = V.ATTENTION_CHUNK
    try:
        V.ATTENTION_CHUNK = 48
        fast_g = jax.jit(jax.grad(functools.partial(f, True)))(pixels)
        fast = jax.jit(functools.partial(tower, True))(pixels)
    finally:
        V.ATTENTION_CHUNK = old
    np.testing.assert_allclose(fast, dense, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(dense))))
    np.testing.assert_allclose(fast_g, dense_g, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(dense_g))))
