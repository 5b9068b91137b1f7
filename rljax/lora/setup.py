"""The run's LoRA: the `[lora]` section checked against the model, and the adapters to start from."""

from __future__ import annotations

from typing import Any

from rljax.lora.adapters import adapter_shapes
from rljax.lora.config import LoraConfig
from rljax.lora.peft_io import load_peft
from rljax.models import ModelConfig


def build_lora(section: LoraConfig, cfg: ModelConfig) -> tuple[LoraConfig | None, Any]:
    """(LoRA config, starting adapters): (None, None) without LoRA; fresh adapters are made with
    the train state (None here); `lora.adapter` loads a PEFT adapter to continue, whose
    adapter_config.json sets rank, alpha, dropout, rsLoRA and targets."""
    if not section.enabled:
        return None, None
    if section.adapter is None:
        adapter_shapes(cfg, section)  # a target this model lacks is a ConfigError before anything is built
        return section, None
    return load_peft(section.adapter, cfg, defaults=section)
