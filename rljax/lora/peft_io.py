"""PEFT adapter directories in and out: `adapter_config.json` + `adapter_model.safetensors`.

What `peft.PeftModel.from_pretrained(hf_model, directory)` loads onto the Hugging Face base model,
and what `peft_model.save_pretrained(directory)` writes. Tensor names are PEFT's for a causal LM:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight    [r, in]      (our A^T)
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight    [out, r]     (our B^T)
    base_model.model.model.embed_tokens.lora_embedding_A                [r, V]
    base_model.model.model.embed_tokens.lora_embedding_B                [D, r]
    base_model.model.lm_head.lora_A.weight / lora_B.weight              [r, D] / [V, r]

Ours are the transposes with the per-head axes unflattened (`rljax.lora.weight`): one rule,
A_peft = A.reshape(-1, r).T and B_peft = B.reshape(r, -1).T, covers every kind, per layer.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rljax.errors import CheckpointError
from rljax.lora.adapters import Adapters, _get, _set, adapter_shapes, targets_of
from rljax.lora.config import TARGETS, LoraConfig, Target
from rljax.models.config import ModelConfig
from rljax.models.hf_io import written_into_place

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT features whose weights or math this loader does not reproduce: config key -> "off" value.
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "fan_in_fan_out": False, "rank_pattern": {},
                "alpha_pattern": {}, "modules_to_save": None, "trainable_token_indices": None,
                "layer_replication": None, "use_qalora": False}


def _module(t: Target, layer: int | None) -> str:
    return f"model.layers.{layer}.{t.hf_module}" if t.stacked else t.hf_module


def _names(t: Target, layer: int | None) -> tuple[str, str]:
    """PEFT's (A, B) tensor names of target `t` in `layer` (None: not stacked)."""
    base = _PREFIX + _module(t, layer)
    if t.kind == "embedding":
        return f"{base}.lora_embedding_A", f"{base}.lora_embedding_B"
    return f"{base}.lora_A.weight", f"{base}.lora_B.weight"


def _layers(t: Target, cfg: ModelConfig):
    return range(cfg.num_layers) if t.stacked else (None,)


def peft_tensors(cfg: ModelConfig, adapters: Adapters) -> dict[str, np.ndarray]:
    """PEFT name -> host array ([r, in] A and [out, r] B per layer) for every adapter."""
    out = {}
    for t in targets_of(adapters):
        ab = jax.device_get(_get(adapters, t.path))
        for layer in _layers(t, cfg):
            a, b = (ab[k] if layer is None else ab[k][layer] for k in ("lora_a", "lora_b"))
            r = a.shape[-1]
            name_a, name_b = _names(t, layer)
            out[name_a] = np.ascontiguousarray(np.asarray(a).reshape(-1, r).T)
            out[name_b] = np.ascontiguousarray(np.asarray(b).reshape(r, -1).T)
    return out


def peft_config(lora: LoraConfig, adapters: Adapters, base_model: str | None = None) -> dict:
    """The adapter_config.json PEFT reads: rank, alpha, dropout, rsLoRA and the HF module names."""
    modules = sorted({t.hf_module.split(".")[-1] for t in targets_of(adapters)})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "use_rslora": lora.rslora, "target_modules": modules,
            "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model, "modules_to_save": None}


def save_peft(cfg: ModelConfig, adapters: Adapters, lora: LoraConfig, path: str | os.PathLike, *,
              base_model: str | None = None) -> Path:
    """Writes `adapters` as a PEFT adapter directory that `PeftModel.from_pretrained` loads onto
    the HF export of the base model. Written next to `path` and renamed into place."""
    path = Path(path)
    with written_into_place(path) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_config(lora, adapters, base_model), indent=2))
        save_file(peft_tensors(cfg, adapters), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def read_peft_config(path: str | os.PathLike) -> dict:
    """adapter_config.json, checked: a LoRA adapter without PEFT features this loader lacks."""
    path = Path(path)
    file = path / CONFIG_FILE
    if not file.exists():
        raise CheckpointError(f"{path} has no {CONFIG_FILE}; pass a directory written by peft's save_pretrained "
                              "or rljax export --adapter")
    config = json.loads(file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{file} is a {config.get('peft_type')} adapter; rljax loads LORA adapters only")
    for key, off in _UNSUPPORTED.items():
        if config.get(key, off) not in (off, None, {}, False):
            raise CheckpointError(f"{file} sets {key}={config[key]!r}, which rljax's LoRA does not support; "
                                  f"train the adapter without it")
    return config


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _target_of_module(module: str) -> tuple[Target, int | None] | None:
    m = _LAYER.match(module)
    for t in TARGETS:
        if m and t.stacked and m.group(2) == t.hf_module:
            return t, int(m.group(1))
        if not m and not t.stacked and module == t.hf_module:
            return t, None
    return None


def load_peft(path: str | os.PathLike, cfg: ModelConfig, defaults: LoraConfig = LoraConfig()
              ) -> tuple[LoraConfig, Adapters]:
    """(LoRA config, f32 adapters) from a PEFT adapter directory, for the base model `cfg`.

    Rank, alpha, dropout and rsLoRA come from adapter_config.json, the targets from the tensors
    present (a PEFT target_modules regex needs no translation); `defaults` gives the rest
    (`merge_for_sampling`). An adapter on some layers only, a shape that does not fit the model,
    or a tensor of no known target is one CheckpointError line. PEFT's copy of the base embedding
    (`...embed_tokens.base_layer.weight`, saved when the embedding is a target) is not read: the
    base model is the one rljax holds."""
    path = Path(path)
    config = read_peft_config(path)
    file = path / WEIGHTS_FILE
    if not file.exists():
        raise CheckpointError(f"{path} has no {WEIGHTS_FILE}; save the adapter with safe_serialization=True")
    found: dict[str, dict[int | None, dict[str, np.ndarray]]] = {}
    with safe_open(str(file), framework="np") as f:
        for name in f.keys():
            if name.endswith(".base_layer.weight"):
                continue
            m = re.match(rf"^{re.escape(_PREFIX)}(.+?)\.(lora_A\.weight|lora_B\.weight|lora_embedding_A|"
                         r"lora_embedding_B)$", name)
            hit = _target_of_module(m.group(1)) if m else None
            if hit is None:
                raise CheckpointError(f"{file.name} holds {name!r}, which is no LoRA weight of a supported target "
                                      "(q/k/v/o/gate/up/down_proj, embed_tokens, lm_head)")
            t, layer = hit
            part = "lora_a" if m.group(2).startswith(("lora_A", "lora_embedding_A")) else "lora_b"
            found.setdefault(t.name, {}).setdefault(layer, {})[part] = f.get_tensor(name).astype(np.float32)
    if not found:
        raise CheckpointError(f"{file} holds no LoRA weights")
    ranks = {v.shape[0] for layers in found.values() for ab in layers.values() for k, v in ab.items()
             if k == "lora_a"}
    if ranks != {int(config["r"])}:
        raise CheckpointError(f"{file}: lora_A ranks {sorted(ranks)} differ from r={config['r']} in {CONFIG_FILE}")
    lora = defaults.replace(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                            dropout=float(config.get("lora_dropout") or 0.0),
                            rslora=bool(config.get("use_rslora", False)),
                            targets=tuple(t.name for t in TARGETS if t.name in found))
    shapes = adapter_shapes(cfg, lora)
    adapters: Adapters = {}
    for t in (t for t in TARGETS if t.name in found):
        (a_shape, b_shape), layers = shapes[t.name], found[t.name]
        want = set(_layers(t, cfg))
        if set(layers) != want:
            raise CheckpointError(f"{file}: {t.hf_module} is adapted in layers {sorted(layers)}, not in all "
                                  f"{cfg.num_layers}; rljax adapts a target in every layer")
        per_a, per_b = (a_shape[1:], b_shape[1:]) if t.stacked else (a_shape, b_shape)
        stack_a, stack_b = [], []
        for layer in _layers(t, cfg):
            ab = layers[layer]
            if set(ab) != {"lora_a", "lora_b"}:
                raise CheckpointError(f"{file}: {_module(t, layer)} has lora_A or lora_B but not both")
            a, b = ab["lora_a"].T, ab["lora_b"].T
            if a.shape != (math.prod(per_a[:-1]), lora.rank) or b.shape != (lora.rank, math.prod(per_b[1:])):
                raise CheckpointError(f"{file}: {_module(t, layer)} has A {list(ab['lora_a'].shape)}, "
                                      f"B {list(ab['lora_b'].shape)}, which do not fit this model's "
                                      f"{t.hf_module} at r={lora.rank}")
            stack_a.append(a.reshape(per_a))
            stack_b.append(b.reshape(per_b))
        a, b = (np.stack(s) if t.stacked else s[0] for s in (stack_a, stack_b))
        adapters = _set(adapters, t.path, {"lora_a": jax.numpy.asarray(a), "lora_b": jax.numpy.asarray(b)})
    return lora, adapters
