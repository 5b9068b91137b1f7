"""Pure-functional policy and value models: Llama, Qwen2/3 and Gemma 1/2 as params pytrees."""

from rljax.models.auxiliary import FrozenModel
from rljax.models.config import ModelConfig, from_hf_dict, preset, to_hf_dict
from rljax.models.gguf import is_gguf, load_gguf, read_gguf_config
from rljax.models.hf_io import load_hf, read_hf_config, save_hf
from rljax.models.layers import rope_table
from rljax.models.packaged import PACKAGED_MODELS, resolve_checkpoint
from rljax.models.scoring import (LOGITS_BUDGET_BYTES, LogprobChunks, auto_chunk_size, fused_logprobs,
                                  init_value_params, logprobs_from_logits, token_logprobs, values)
from rljax.models.transformer import (cache_slot_axes, default_positions, forward, hidden_states, init_cache,
                                     init_params, logits_from_hidden, output_embedding, prefill_cache,
                                     to_cache_layout, unstack_layers)

__all__ = [
    "ModelConfig", "FrozenModel", "preset", "from_hf_dict", "to_hf_dict", "load_hf", "save_hf", "read_hf_config",
    "forward", "hidden_states", "logits_from_hidden", "init_params", "init_cache", "cache_slot_axes",
    "unstack_layers", "rope_table", "prefill_cache", "to_cache_layout",
    "default_positions", "token_logprobs", "fused_logprobs", "output_embedding", "auto_chunk_size", "LogprobChunks",
    "LOGITS_BUDGET_BYTES", "logprobs_from_logits", "init_value_params", "values",
    "load_gguf", "read_gguf_config", "is_gguf", "resolve_checkpoint", "PACKAGED_MODELS",
]
