"""`rljax.checkpoint.export.export_vl` (what `rljax export` runs on a vision-language run) of a
LoRA checkpoint: the decoder's adapters merged, the tower and merger written, and transformers'
Qwen2_5_VLForConditionalGeneration reloads it with the adapted policy's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rljax.checkpoint import Checkpointer
from rljax.checkpoint.export import export_vl
from rljax.errors import CheckpointError
from rljax.lora import LoraConfig, attach, init_adapters
from rljax.models import preset
from rljax.models.vision import VisionConfig
from rljax.models.vlm import VLConfig, init_vl_params, prepare_inputs, vl_forward

from vl_factory import END, IMAGE, START, image_batch


def test_a_lora_vl_checkpoint_exports_merged_and_reloads_in_transformers(tmp_path):
    """A tied-embedding VLM with adapters on q, v, down and the embedding, saved as a run saves
    it (frozen params with `visual`, adapters, the LoRA config): the export's logits in
    transformers equal our forward with the adapters attached (not merged: an independent path)
    within 1e-4 on left-padded image rows, and differ from the base's. Catches an export that drops
    the adapters, keeps the embedding tied once it was adapted (HF's LM head would move with it),
    or loses the tower. A `--adapter`-style text export of it is refused in one line."""
    cfg = VLConfig(text=preset("qwen2-test", vocab_size=128, tie_embeddings=True),
                   vision=VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                                       window_size=56, fullatt_block_indexes=(1,)),
                   image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=121,
                   mrope_section=(2, 3, 3))
    params = init_vl_params(cfg, jax.random.key(0), std=0.2)
    lora = LoraConfig(rank=4, targets=("q", "v", "down", "embed"))
    adapters = init_adapters(cfg.text, lora, jax.random.key(3))
    rng = np.random.default_rng(4)  # NumPy noise: no compile per adapter shape
    adapters = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(np.float32), adapters)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, params=params, model_config=cfg.text, adapters=adapters, lora=lora)
    ckpt.wait()
    ckpt.close()

    written = export_vl(tmp_path / "ckpt", tmp_path / "hf", 1, cfg, params_template=jax.eval_shape(lambda: params))
    assert not written.text.tie_embeddings  # the adapted embedding untied the LM head
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    tokens, mask, pixels, grids = image_batch()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                 image_grid_thw=torch.tensor(grids),
                 mm_token_type_ids=torch.tensor((tokens == IMAGE).astype(np.int64))).logits.numpy()
    inputs = prepare_inputs(cfg, tokens, mask.astype(bool), pixels, grids, num_positions=tokens.shape[1])
    forward = jax.jit(lambda p: vl_forward(cfg, p, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool), inputs))
    real = mask.astype(bool)
    np.testing.assert_allclose(ref[real], np.asarray(forward(attach(params, adapters, lora)))[real], atol=1e-4, rtol=0)
    assert np.abs(ref - np.asarray(forward(params)))[real].max() > 1e-3  # the adapters act


def test_a_text_checkpoint_is_not_exported_as_a_vl_model(tmp_path):
    """A checkpoint whose params hold no tower: one line, not a directory transformers cannot load."""
    from rljax.models import init_params

    text = preset("qwen2-test", vocab_size=128)
    params = init_params(text, jax.random.key(0))
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, params=params, model_config=text)
    ckpt.wait()
    ckpt.close()
    cfg = VLConfig(text=text, vision=VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=48,
                                                  out_hidden_size=64),
                   image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=121,
                   mrope_section=(2, 3, 3))
    with pytest.raises(CheckpointError, match="no vision tower"):
        export_vl(tmp_path / "ckpt", tmp_path / "hf", 1, cfg, params_template=jax.eval_shape(lambda: params))
