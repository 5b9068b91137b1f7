"""LoRA (Hu et al., 2021): low-rank adapters trained beside a frozen base model.

    lora = LoraConfig(rank=16, alpha=32)                   # the TOML [lora] section
    adapters = init_adapters(cfg, lora, key)               # a pytree of its own (A, B per target)
    logits, _ = forward(cfg, attach(params, adapters, lora), tokens)   # W + s A B, never merged
    sampler_params = merge(params, adapters, lora)         # plain weights, for decoding
    save_peft(cfg, adapters, lora, "adapter/")             # PEFT's adapter directory; load_peft reads one

For RL the base model is the free reference policy: the KL term scores the params without the
adapters, so no second copy of the weights is held (`rljax.update.TrainState`).
"""

from rljax.lora.adapters import (Adapters, adapter_shapes, attach, attach_value, init_adapters, init_value_adapters,
                                 merge, merged_model, num_params, targets_of)
from rljax.lora.config import ATTENTION_AND_MLP, TARGETS, LoraConfig, Target, model_targets, resolve_targets
from rljax.lora.peft_io import load_peft, peft_config, peft_tensors, read_peft_config, save_peft
from rljax.lora.weight import LoraWeight

__all__ = [
    "LoraConfig", "Target", "TARGETS", "ATTENTION_AND_MLP", "model_targets", "resolve_targets", "LoraWeight",
    "Adapters", "adapter_shapes", "init_adapters", "attach", "merge", "merged_model", "targets_of", "num_params",
    "init_value_adapters", "attach_value", "save_peft", "load_peft", "peft_config", "peft_tensors",
    "read_peft_config",
]
