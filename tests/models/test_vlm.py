"""Qwen2.5-VL in the functional model against transformers' Qwen2_5_VLForConditionalGeneration.

Two tiny random checkpoints (`vl_factory`): one with window attention in blocks 0 and 2, one
with full attention everywhere. Two images of different sizes, each spanning several windows
per side on a grid the window does not divide, in one left-padded batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.vision_utils import get_vision_window_index

import jax
import jax.numpy as jnp

from rljax.errors import DataError
from rljax.models.mrope import rope_index
from rljax.models.vision import patch_layout
from rljax.models.vl_io import load_vl, save_vl
from rljax.models.vlm import greedy_generate, prepare_inputs, vl_forward, vl_token_logprobs
from vl_factory import END, GRIDS, IMAGE, START, image_batch, left_pad, make_vl_checkpoint, placeholder


@pytest.fixture(scope="module", params=["windowed", "full"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_vl_checkpoint(path, windowed=request.param == "windowed")
    cfg, params = load_vl(path)
    return hf, cfg, params


def _hf_inputs(tokens, mask, pixels, grids):
    return dict(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                image_grid_thw=torch.tensor(grids), mm_token_type_ids=torch.tensor((tokens == IMAGE).astype(np.int64)))


def _ours(cfg, params, tokens, mask, pixels, grids):
    inputs = prepare_inputs(cfg, tokens, mask.astype(bool), pixels, grids, num_positions=tokens.shape[1])
    return np.asarray(vl_forward(cfg, params, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool), inputs))


def test_logits_match_transformers(checkpoint):
    """Logits on the real tokens of a left-padded two-image batch are HF's within 1e-4 (f32). A
    window index that ignores the cut-short edge windows, or one window per image, moves them by
    ~3e-2; so do M-RoPE positions off by one section or an image token given the wrong row."""
    hf, cfg, params = checkpoint
    tokens, mask, pixels, grids = image_batch()
    with torch.no_grad():
        ref = hf(**_hf_inputs(tokens, mask, pixels, grids)).logits.numpy()
    ours = _ours(cfg, params, tokens, mask, pixels, grids)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(checkpoint):
    """Greedy tokens with a KV cache (tower + prompt prefill, decode rotated by position + delta)
    are HF generate's, token for token."""
    hf, cfg, params = checkpoint
    tokens, mask, pixels, grids = image_batch()
    with torch.no_grad():
        ref = hf.generate(**_hf_inputs(tokens, mask, pixels, grids), max_new_tokens=6, do_sample=False)
    ours = greedy_generate(cfg, params, tokens, mask, pixels, grids, 6)
    np.testing.assert_array_equal(ours, ref[:, tokens.shape[1]:].numpy())


def test_export_reloads_in_transformers(checkpoint, tmp_path):
    """`save_vl` writes a directory transformers loads into the same model: its logits equal ours."""
    _, cfg, params = checkpoint
    save_vl(cfg, params, tmp_path / "out")
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    tokens, mask, pixels, grids = image_batch(seed=1)
    with torch.no_grad():
        ref = reloaded(**_hf_inputs(tokens, mask, pixels, grids)).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(_ours(cfg, params, tokens, mask, pixels, grids)[real], ref[real], atol=1e-4, rtol=0)
    cfg2, params2 = load_vl(tmp_path / "out")
    assert cfg2 == cfg


@pytest.mark.parametrize("images_per_row", [(0, 0), (1, 0), (2, 1), (0, 2)])
def test_rope_index_matches_get_rope_index(checkpoint, images_per_row):
    """M-RoPE positions and deltas equal transformers' get_rope_index on left-padded rows with zero,
    one and two images (images consumed in row-major order)."""
    hf, cfg, _ = checkpoint
    grids, rows, k = [], [], 0
    for row, n in enumerate(images_per_row):
        toks = [7 + row] * (3 + 2 * row)
        for _ in range(n):
            grid = GRIDS[k % 2]
            grids.append(grid)
            toks += placeholder(grid) + [20 + k] * (k + 1)
            k += 1
        rows.append(toks)
    tokens, mask = left_pad(rows)
    grid_arr = np.array(grids).reshape(-1, 3)
    ref_pos, ref_delta = hf.model.get_rope_index(
        torch.tensor(tokens), mm_token_type_ids=torch.tensor((tokens == IMAGE).astype(np.int64)),
        image_grid_thw=torch.tensor(grid_arr) if len(grids) else None, attention_mask=torch.tensor(mask))
    pos, delta = rope_index(tokens, mask, grid_arr, IMAGE, cfg.vision.spatial_merge_size)
    np.testing.assert_array_equal(pos, ref_pos.numpy())
    np.testing.assert_array_equal(delta, ref_delta.numpy()[:, 0])


def test_window_segments_match_hf_window_index(checkpoint):
    """Our window segments partition each image's merge blocks exactly as HF's window index and
    cumulative window lengths do (the permutation HF attends in, read back as a partition)."""
    _, cfg, _ = checkpoint
    index, cu = get_vision_window_index(torch.tensor(GRIDS), 2, cfg.vision.window_size, 14)
    hf_window = np.empty(len(index), np.int64)
    for w, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        hf_window[index.numpy()[a // 4:b // 4]] = w
    ours = patch_layout(cfg.vision, GRIDS).window_n.reshape(-1, 4)
    assert (ours == ours[:, :1]).all()
    np.testing.assert_array_equal(ours[:, 0], hf_window)


def test_placeholder_count_mismatch_is_one_line(checkpoint):
    """A prompt whose image placeholder does not fit its image's grid is refused in one line."""
    _, cfg, _ = checkpoint
    tokens, mask = left_pad([[5, START] + [IMAGE] * 3 + [END]])
    with pytest.raises(DataError, match="image tokens but the images make") as err:
        prepare_inputs(cfg, tokens, mask, np.zeros((int(GRIDS[1].prod()), 1176), np.float32), GRIDS[1:],
                       num_positions=8)
    assert "\n" not in str(err.value)


def test_packed_rows_equal_padded_rows():
    """Two image sequences packed into one row (segment ids, positions running on, each
    segment's M-RoPE restarting) get the log-probs they get as two left-padded rows, within 1e-5
    (f32), except each segment's first token (scored from the previous segment: masked in
    training). Indexing the table by positions that restart per segment (segment b reading segment
    a's angles) moves segment b's log-probs by ~3 nats."""
    cfg, params = _random_vl()
    a = [5, 9] + placeholder(GRIDS[0]) + [33, 7, 40, 41]
    b = [11] + placeholder(GRIDS[1]) + [3, 8, 60, 61, 62, 4, 12]
    pixels = np.random.default_rng(0).standard_normal((int(GRIDS.prod(axis=1).sum()), 1176)).astype(np.float32)
    score = jax.jit(lambda p, t, m, i, s: vl_token_logprobs(cfg, p, t, m, i, segment_ids_bt=s)[0])

    tokens, mask = left_pad([a, b])
    inputs = prepare_inputs(cfg, tokens, mask.astype(bool), pixels, GRIDS, num_positions=tokens.shape[1])
    padded = np.asarray(score(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool), inputs, None))

    packed_tokens = np.array([a + b + [0, 0]])
    packed_mask = np.array([[1] * (len(a) + len(b)) + [0, 0]], bool)
    segments = np.array([[0] * len(a) + [1] * len(b) + [0, 0]])
    inputs = prepare_inputs(cfg, packed_tokens, packed_mask, pixels, GRIDS, num_positions=packed_tokens.shape[1],
                            segment_ids_bt=segments)
    packed = np.asarray(score(params, jnp.asarray(packed_tokens, jnp.int32), jnp.asarray(packed_mask), inputs,
                              jnp.asarray(segments)))[0]
    np.testing.assert_allclose(packed[1:len(a)], padded[0, -len(a) + 1:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[len(a) + 1:len(a) + len(b)], padded[1, -len(b) + 1:], atol=1e-5, rtol=0)


def _random_vl():
    """A tiny random-init Qwen2.5-VL-shaped model (no torch)."""
    from rljax.models import preset
    from rljax.models.vision import VisionConfig
    from rljax.models.vlm import VLConfig, init_vl_params

    cfg = VLConfig(text=preset("qwen2-test", vocab_size=128, tie_embeddings=False),
                   vision=VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                                       window_size=56, fullatt_block_indexes=(1,)),
                   image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=121,
                   mrope_section=(2, 3, 3))
    return cfg, init_vl_params(cfg, jax.random.key(0), std=0.2)


def test_lora_on_the_language_model():
    """LoRA adapters on the decoder of a VLM (the tower untouched): the attached forward equals
    the merged one within 1e-5 on image rows, and differs from the base (the adapters act)."""
    from rljax.lora import LoraConfig, attach, init_adapters, merge

    cfg, params = _random_vl()
    lora = LoraConfig(rank=4, targets=("q", "v", "down"))
    adapters = init_adapters(cfg.text, lora, jax.random.key(3))
    rng = np.random.default_rng(4)  # NumPy noise: no compile per adapter shape
    adapters = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(np.float32), adapters)
    tokens, mask, pixels, grids = image_batch()
    inputs = prepare_inputs(cfg, tokens, mask.astype(bool), pixels, grids, num_positions=tokens.shape[1])
    score = jax.jit(lambda p: vl_token_logprobs(cfg, p, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool),
                                                inputs)[0])
    attached, merged, base = (np.asarray(score(p)) for p in (attach(params, adapters, lora),
                                                              merge(params, adapters, lora), params))
    real = mask.astype(bool)
    np.testing.assert_allclose(attached[real], merged[real], atol=1e-5, rtol=0)
    assert np.abs(attached - base)[real].max() > 1e-3
