"""Tiny random-init Hugging Face checkpoints, built in the test process (no download)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 128}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=24,
                                              tie_word_embeddings=False),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, num_key_value_heads=1, head_dim=16),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16,
                                                sliding_window=4, query_pre_attn_scalar=24,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
}


def make_checkpoint(family: str, path, seed: int = 0):
    """Saves a random-init model of `family` to `path`; biases and norms are randomised too."""
    torch.manual_seed(seed)
    return save_random_model(FAMILIES[family](), path)


def save_random_model(cfg, path, adjust=None):
    """A random-init causal LM of HF config `cfg` (eager attention) with norms and biases
    randomised too, then `adjust(name, param)` per parameter when given, saved to `path`."""
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if adjust is not None:
                adjust(name, p)
    model.save_pretrained(path)
    return model
