"""YaRN RoPE scaling (Peng et al., 2023) against transformers, past the pretrained window."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import rljax.models as M
from hf_factory import save_random_model
from rljax.models.config import from_hf_dict, rope_attention_scale, rope_inv_freq, to_hf_dict

ORIGINAL = 16  # the "pretrained" window; the test sequences run to 3x past it


def _yarn_qwen2(tmp_path, **rope):
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4 * ORIGINAL, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": ORIGINAL, **rope})
    return save_random_model(hf_cfg, tmp_path)


@pytest.mark.parametrize("rope", [{}, {"beta_fast": 8.0, "beta_slow": 2.0, "attention_factor": 1.3}],
                         ids=["qwen2.5-defaults", "explicit"])
def test_yarn_logits_match_transformers_past_the_window(tmp_path, rope):
    """f32 logits over 3 x the original window (left-padded rows too) equal transformers' within
    1e-4: the blended frequencies and the cos/sin scale are HF's. Plain RoPE, or YaRN without its
    attention factor, misses by over 10x the tolerance (checked: the test can fail)."""
    model = _yarn_qwen2(tmp_path, **rope)
    cfg, params = M.load_hf(tmp_path)
    assert cfg.rope_type == "yarn" and cfg.rope_original_max_positions == ORIGINAL
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.vocab_size, (2, 3 * ORIGINAL))
    mask = np.ones(tokens.shape, bool)
    mask[1, :5] = False
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        ref = model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                    position_ids=torch.tensor(positions)).logits.float().numpy()
    ours = np.asarray(M.forward(cfg, params, jnp.asarray(tokens), attn_mask_bt=jnp.asarray(mask))[0])
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=0)
    for wrong in (cfg.replace(rope_type="default"), cfg.replace(rope_attention_factor=1.0)):
        off = np.asarray(M.forward(wrong, params, jnp.asarray(tokens), attn_mask_bt=jnp.asarray(mask))[0])
        assert np.abs(off[mask] - ref[mask]).max() > 1e-3  # 10x the tolerance (random init: small logits)


def test_yarn_frequencies_and_scale_follow_the_paper():
    """NumPy from the paper: dims rotating > beta_fast times over the window keep theta^(-2i/D),
    dims rotating < beta_slow times are divided by s, and the cos/sin scale is 0.1 ln s + 1."""
    cfg = M.ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                        head_dim=64, rope_type="yarn", rope_factor=4.0, rope_original_max_positions=4096,
                        rope_theta=10000.0)
    base = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    rotations = 4096 * base / (2 * np.pi)
    got = rope_inv_freq(cfg)
    fast, slow = rotations > 32 + 1, rotations < 1 - 1e-9
    assert fast.any() and slow.any()
    np.testing.assert_allclose(got[fast], base[fast], rtol=1e-6)
    np.testing.assert_allclose(got[slow], base[slow] / 4.0, rtol=1e-6)
    assert rope_attention_scale(cfg) == pytest.approx(0.1 * np.log(4.0) + 1.0)
    assert rope_attention_scale(cfg.replace(rope_type="linear")) == 1.0


def test_yarn_config_reads_qwen25_legacy_form_and_round_trips():
    """Qwen2.5's long-context `rope_scaling` (v4 form, `type`) reads as YaRN, and `to_hf_dict`
    writes a config that reads back to the same ModelConfig."""
    hf = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32768, rope_theta=1e6,
              rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"})
    cfg = from_hf_dict(hf)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_positions) == ("yarn", 4.0, 32768)
    assert (cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_attention_factor) == (32.0, 1.0, None)
    assert from_hf_dict(to_hf_dict(cfg)) == cfg
