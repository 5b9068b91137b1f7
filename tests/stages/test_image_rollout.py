"""Image prompts through the text run's compiled RL iteration (`rljax.stages.iteration.make_iteration`
with the prompts' `PromptImages`, `rljax.data.prompt_images`): generated visual problems -> image
prompts -> the image sampler -> the update scoring text tokens with the tower spliced per row. A
tiny random-init Qwen2.5-VL-shaped model (no torch)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.lora import LoraConfig
from rljax.models import preset
from rljax.models.vision import VisionConfig
from rljax.models.vlm import VLConfig, init_vl_params
from rljax.objectives import AlgorithmConfig
from rljax.optim import OptimConfig
from rljax.rewards.base import Rewards
from rljax.sampling import SampleControls
from rljax.data.prompt_images import ImagePrompter
from rljax.stages.iteration import make_iteration
from rljax.update import init_train_state
from rljax.update.config import UpdateConfig
from vl_prompts import visual_prompts

IMAGE, START, END = 120, 118, 119
CONTROLS = SampleControls(max_new_tokens=4, num_samples=2, temperature=1.0, eos_ids=(3,), pad_id=0)


def reward_callback(tokens_bt, mask_bt, index_b):
    del index_b
    total = ((tokens_bt[:, 0] % 3) == 0).astype(jnp.float32) * mask_bt[:, 0]
    return Rewards(total, {"correct": total}, jnp.zeros(total.shape, bool))


@pytest.fixture(scope="module")
def vl():
    text = preset("qwen2-test", vocab_size=128, tie_embeddings=False)
    vision = VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                          window_size=56, fullatt_block_indexes=(1,))
    return VLConfig(text=text, vision=vision, image_token_id=IMAGE, vision_start_token_id=START,
                    vision_end_token_id=END, video_token_id=121, mrope_section=(2, 3, 3))


@pytest.fixture(scope="module")
def prompts(vl):
    """Three generated problems (84 px: 6 x 6 patches, cut by the 4-patch window) with text tokens."""
    return visual_prompts()


def _state(vl, lr=1e-2, weight_decay=0.1):
    params = init_vl_params(vl, jax.random.key(0), std=0.2)
    return init_train_state(vl.text, params, AlgorithmConfig(algorithm="grpo", kl_coef=0.0),
                            OptimConfig(learning_rate=lr, weight_decay=weight_decay, warmup_steps=0),
                            update_cfg=UpdateConfig())


def vl_prompts(vl, examples, tokens, mask, controls, *, train_vision):
    """(tokens, mask, PromptImages) of the batch, widths from its own examples."""
    prompter = ImagePrompter.build(vl, examples, max_prompt_tokens=tokens.shape[1],
                                   max_new_tokens=controls.max_new_tokens, pad_id=controls.pad_id,
                                   train_vision=train_vision)
    return prompter(examples, tokens, mask)


@functools.cache
def _iteration():
    return make_iteration(CONTROLS, reward_callback, num_groups=3)


def _run(vl, prompts, train_vision: bool, state=None):
    examples, tokens, mask = prompts
    toks, msk, images = vl_prompts(vl, examples, tokens, mask, CONTROLS, train_vision=train_vision)
    state = _state(vl) if state is None else state
    before = jax.tree.map(np.array, state.params)
    state, metrics, _ = _iteration()(state, toks, msk, np.arange(3, dtype=np.int32), jax.random.key(1),
                                     images=images)
    return before, jax.tree.map(np.array, state.params), jax.device_get(metrics), toks


def _changed(a, b):
    return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_prompts_hold_the_image_placeholders(vl, prompts):
    """Each row: its text tokens with vision_start, 9 image tokens (6 x 6 patches / 4), vision_end
    at the head. Catches a placeholder count off the grid, and images put in the wrong row."""
    examples, tokens, mask = prompts
    toks, msk, images = vl_prompts(vl, examples, tokens, mask, CONTROLS, train_vision=True)
    rows = images.rows
    for i in range(3):
        real = toks[i][msk[i]].tolist()
        assert real[:11] == [START] + [IMAGE] * 9 + [END]
        assert real[11:] == tokens[i][mask[i]].tolist()
    assert np.asarray(rows.pixels_bnp).shape == (3, 64, 1176)
    assert int(np.asarray(rows.image_bt).sum()) == 27


def test_frozen_tower_is_bitwise_unchanged_and_the_update_scores_images(vl, prompts):
    """train_vision=False: after a step with weight decay every tower param is bitwise what it was,
    while the decoder moved. The update's first mini-batch scores each sampled token as the
    sampler did (|logp diff| < 1e-5 in f32): the trainer sees the same images, slots and M-RoPE
    tables. Catches: a frozen tower that weight decay still moves, rows without their images
    (the diff is then O(1)), tables or slots misaligned after the repeat over samples."""
    before, after, metrics, _ = _run(vl, prompts, train_vision=False)
    assert not _changed(before["visual"], after["visual"])
    assert _changed({k: v for k, v in before.items() if k != "visual"}, {k: v for k, v in after.items() if k != "visual"})
    assert metrics["update/logp_diff_max"] < 1e-5, metrics["update/logp_diff_max"]
    assert all(np.isfinite(v) for v in metrics.values())


def test_trained_tower_moves_in_the_frozen_runs_program(vl, prompts):
    """train_vision=True: the tower's params change (its gradient reaches them through the
    spliced embeddings), and it runs the program the frozen run compiled (the flag is a leaf of
    the images, not a second compile). Catches a stop_gradient or a zeroed update left on a
    trained tower, and a flag that is static again (two compiles)."""
    _run(vl, prompts, train_vision=False)
    compiled = _iteration()._cache_size()
    before, after, metrics, _ = _run(vl, prompts, train_vision=True)
    assert _changed(before["visual"], after["visual"])
    assert metrics["update/logp_diff_max"] < 1e-5
    assert _iteration()._cache_size() == compiled


def test_lora_trains_the_decoders_adapters_and_nothing_else(vl, prompts):
    """LoRA on the language model of a VL policy, one iteration: the adapters move, every base
    weight (the tower's too) is bitwise what it was, and the trainer (base + adapters, tower
    spliced per row) scores the sampled tokens as the sampler did (merged weights, tower once per
    prompt) within 1e-5. Catches a LoRA update that drops the images (O(1) difference), a splice
    that cannot read adapted weights, and a base or tower that moves."""
    examples, tokens, mask = prompts
    toks, msk, images = vl_prompts(vl, examples, tokens, mask, CONTROLS, train_vision=True)
    params = init_vl_params(vl, jax.random.key(0), std=0.2)
    state = init_train_state(vl.text, params, AlgorithmConfig(algorithm="grpo", kl_coef=0.0),
                             OptimConfig(learning_rate=1e-2, warmup_steps=0), update_cfg=UpdateConfig(),
                             lora=LoraConfig(rank=4))
    base, adapters = jax.tree.map(np.array, (state.params, state.adapters))
    state, metrics, _ = _iteration()(state, toks, msk, np.arange(3, dtype=np.int32), jax.random.key(1), images=images)
    metrics = jax.device_get(metrics)
    assert not _changed(base, jax.tree.map(np.array, state.params))
    assert _changed(adapters, jax.tree.map(np.array, state.adapters))
    assert metrics["update/logp_diff_max"] < 1e-5, metrics["update/logp_diff_max"]


def test_kl_reference_and_recomputed_old_logp_score_the_images(vl, prompts):
    """A KL reference and `recompute_old_logp` with image rows: on the first iteration the
    reference and the trainer's recomputed log-probs are the sampler's policy on the same
    images, so the first mini-batch's KL is 0 (< 1e-6) and the recompute's mismatch < 1e-5.
    Catches a reference or old-log-prob pass that scores the rows without their images (both
    then O(0.1-1))."""
    examples, tokens, mask = prompts
    toks, msk, images = vl_prompts(vl, examples, tokens, mask, CONTROLS, train_vision=True)
    params = init_vl_params(vl, jax.random.key(0), std=0.2)
    state = init_train_state(vl.text, params, AlgorithmConfig(algorithm="grpo", kl_coef=0.1, recompute_old_logp=True),
                             OptimConfig(learning_rate=1e-2, warmup_steps=0), update_cfg=UpdateConfig())
    _, metrics, _ = _iteration()(state, toks, msk, np.arange(3, dtype=np.int32), jax.random.key(1), images=images)
    metrics = jax.device_get(metrics)
    assert metrics["loss/kl"] < 1e-6, metrics["loss/kl"]
    assert metrics["update/logp_diff_max"] < 1e-5, metrics["update/logp_diff_max"]


def test_unsupported_update_features_are_one_line(vl, prompts):
    """A critic (not yet scored with images) is refused in one line naming the fix."""
    examples, tokens, mask = prompts
    toks, msk, images = vl_prompts(vl, examples, tokens, mask, CONTROLS, train_vision=True)
    params = init_vl_params(vl, jax.random.key(0), std=0.2)
    state = init_train_state(vl.text, params, AlgorithmConfig(algorithm="ppo", kl_coef=0.0), OptimConfig(),
                             update_cfg=UpdateConfig())
    with pytest.raises(ConfigError, match="critic-free"):
        make_iteration(CONTROLS, reward_callback, num_groups=3)(state, toks, msk, np.arange(3, dtype=np.int32),
                                                                jax.random.key(1), images=images)


def test_dynamic_sampling_keeps_each_prompts_images(vl, prompts):
    """DAPO's dynamic sampling over a pool of 3 image prompts for 2 groups: prompt 0's rewards
    are all equal (dropped), prompts 1 and 2 alternate 0/1 (kept), so the batch is groups [1, 2]
    and its rows must carry prompts 1 and 2's images, slots and M-RoPE tables. The update's first
    mini-batch scores each sampled token as the sampler did (< 1e-5, f32). Catches images taken
    for the first G prompts instead of the kept ones (`rows_for(arange(G))`: the rows of prompt 2
    get prompt 1's pixels and image slots, whose prompt is shorter, so the diff is O(1)), and a
    filter that drops nothing (the counts)."""
    def first_prompt_all_equal(tokens_bt, mask_bt, index_b):
        del mask_bt
        alternate = (jnp.arange(tokens_bt.shape[0]) % 2).astype(jnp.float32)
        total = jnp.where(index_b == 0, 0.0, alternate)
        return Rewards(total, {"correct": total}, jnp.zeros(total.shape, bool))

    examples, tokens, mask = prompts
    toks, msk, images = vl_prompts(vl, examples, tokens, mask, CONTROLS, train_vision=True)
    iteration = make_iteration(CONTROLS, first_prompt_all_equal, num_groups=2, dynamic_sampling=True)
    _, metrics, _ = iteration(_state(vl), toks, msk, np.arange(3, dtype=np.int32), jax.random.key(1), images=images)
    metrics = jax.device_get(metrics)
    assert (metrics["rollout/dynamic_kept"], metrics["rollout/dynamic_dropped"], metrics["rollout/dynamic_padded"]) \
        == (2, 1, 0)
    assert metrics["update/logp_diff_max"] < 1e-5, metrics["update/logp_diff_max"]
