"""Real model shapes by name, for planning without weights: their published HF `config.json`s.

Each entry is the architecture part of the model's `config.json` on the Hugging Face Hub
(Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B, Qwen/Qwen2.5-7B, Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B,
google/gemma-2-9b), read by the same `rljax.models.from_hf_dict` that reads a checkpoint, so a
named shape and its downloaded checkpoint plan identically. Instruct variants share their base
model's shapes. Parameter counts (embeddings included): 494,032,768; 1,543,714,304;
7,615,616,512; 8,190,735,360; 8,030,261,248; 9,241,705,984.
"""

from __future__ import annotations

from pathlib import Path

from rljax.errors import ConfigError
from rljax.models import ModelConfig, from_hf_dict, read_hf_config

_QWEN2 = dict(model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0,
              bos_token_id=151643, eos_token_id=151643, use_sliding_window=False)
_QWEN3 = dict(model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000, attention_bias=False,
              bos_token_id=151643, eos_token_id=151645, use_sliding_window=False, rope_scaling=None)

NAMED_SHAPES: dict[str, dict] = {
    "Qwen2.5-0.5B": dict(_QWEN2, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(_QWEN2, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                         tie_word_embeddings=True),
    "Qwen2.5-7B": dict(_QWEN2, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                       tie_word_embeddings=False),
    "Qwen3-8B": dict(_QWEN3, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     tie_word_embeddings=False),
    "Llama-3.1-8B": dict(model_type="llama", hidden_act="silu", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192, rope_type="llama3"),
                         attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000,
                         eos_token_id=128001),
    "Gemma-2-9B": dict(model_type="gemma2", hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                       vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=8192,
                       rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, sliding_window=4096, attention_bias=False, bos_token_id=2,
                       eos_token_id=1, pad_token_id=0),
}


def shape_names() -> tuple[str, ...]:
    return tuple(NAMED_SHAPES)


def model_config(model: str, **overrides) -> ModelConfig:
    """A named shape (any case: `qwen2.5-0.5b`) or a HF checkpoint directory (its config.json)
    as a ModelConfig; `overrides` set fields such as the dtypes."""
    by_lower = {name.lower(): name for name in NAMED_SHAPES}
    if model.lower() in by_lower:
        return from_hf_dict(NAMED_SHAPES[by_lower[model.lower()]], **overrides)
    if Path(model).is_dir():
        return read_hf_config(model, **overrides)
    raise ConfigError(f"--model {model!r} is neither a named shape ({', '.join(NAMED_SHAPES)}) nor a directory "
                      "with a config.json")
