"""Qwen2.5-VL checkpoints: `config.json` (text_config + vision_config) and safetensors.

The language model's tensors are a Qwen2 decoder's (`model.*`, `lm_head.weight`; the layout of
`rljax.models.hf_io`), the tower's are `visual.*`. Checkpoints written by transformers 4.5x name
them `model.language_model.*` and `model.visual.*`; both spellings load. Loading reads each
tensor once on the host (no sharded streaming yet: VLMs up to a few billion parameters).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rljax.errors import CheckpointError
from rljax.models.config import from_hf_dict, to_hf_dict
from rljax.models.hf_io import hf_layer_map, hf_tensors, not_hf_dir_message, written_into_place
from rljax.models.vision import VisionConfig
from rljax.models.vlm import VLConfig

VL_MODEL_TYPES = ("qwen2_5_vl",)
_VISION_FIELDS = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                  "temporal_patch_size", "spatial_merge_size", "in_channels", "window_size", "fullatt_block_indexes",
                  "tokens_per_second")


def is_vl_checkpoint(path: str | os.PathLike) -> bool:
    cfg_file = Path(path) / "config.json"
    return cfg_file.exists() and json.loads(cfg_file.read_text()).get("model_type") in VL_MODEL_TYPES


def vl_from_hf_dict(hf: dict[str, Any], **text_overrides) -> VLConfig:
    """A VLConfig from a Qwen2.5-VL `config.json` dict (text fields nested or flat)."""
    if hf.get("model_type") not in VL_MODEL_TYPES:
        raise CheckpointError(f"model_type {hf.get('model_type')!r} is no vision-language model; supported: "
                              f"{', '.join(VL_MODEL_TYPES)}")
    text = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k not in ("vision_config", "model_type")})
    vision = dict(hf["vision_config"])
    if vision.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"vision hidden_act {vision['hidden_act']!r} is not supported; Qwen2.5-VL uses silu")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = tuple(rope.get("mrope_section", (16, 24, 24)))
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    rope_type = rope.get("rope_type", rope.get("type"))
    text_rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "type")}
    text_rope["rope_type"] = "default" if rope_type in (None, "mrope") else rope_type  # M-RoPE is default RoPE x 3
    text_cfg = from_hf_dict({**text, "model_type": "qwen2", "use_sliding_window": False, "tie_word_embeddings": tied,
                             "rope_parameters": text_rope}, **text_overrides)
    vrope = vision.get("rope_parameters") or {}
    vcfg = VisionConfig(**{k: vision[k] for k in _VISION_FIELDS if k in vision},
                        rope_theta=float(vrope.get("rope_theta", 10000.0)))
    return VLConfig(text=text_cfg, vision=vcfg, image_token_id=hf["image_token_id"],
                    vision_start_token_id=hf["vision_start_token_id"], vision_end_token_id=hf["vision_end_token_id"],
                    video_token_id=hf["video_token_id"], mrope_section=section)


def vl_to_hf_dict(cfg: VLConfig) -> dict[str, Any]:
    """A `config.json` dict that transformers loads as Qwen2_5_VLForConditionalGeneration."""
    text = to_hf_dict(cfg.text.replace(model_type="qwen2"))
    for key in ("architectures", "torch_dtype", "tie_word_embeddings"):
        text.pop(key, None)
    text.update(model_type="qwen2_5_vl_text", use_sliding_window=False,
                rope_parameters={**text["rope_parameters"], "mrope_section": list(cfg.mrope_section)})
    v = cfg.vision
    vision = {k: getattr(v, k) for k in _VISION_FIELDS}
    vision.update(model_type="qwen2_5_vl_vision", hidden_act="silu",
                  fullatt_block_indexes=list(v.fullatt_block_indexes),
                  rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": cfg.model_type,
            "text_config": text, "vision_config": vision, "image_token_id": cfg.image_token_id,
            "video_token_id": cfg.video_token_id, "vision_start_token_id": cfg.vision_start_token_id,
            "vision_end_token_id": cfg.vision_end_token_id, "tie_word_embeddings": cfg.text.tie_embeddings,
            "torch_dtype": cfg.text.param_dtype}


def _vision_map(v: VisionConfig) -> dict[str, tuple[str, Any, Any]]:
    """HF block suffix -> (our key, hf->ours, ours->hf)."""
    D, N, H = v.hidden_size, v.num_heads, v.head_dim
    t = (lambda w: w.T, lambda w: w.T)
    ident = (lambda w: w, lambda w: w)
    return {
        "norm1.weight": ("norm1", *ident), "norm2.weight": ("norm2", *ident),
        "attn.qkv.weight": ("qkv", lambda w: w.T.reshape(D, 3, N, H), lambda w: w.reshape(D, 3 * D).T),
        "attn.qkv.bias": ("qkv_bias", lambda b: b.reshape(3, N, H), lambda b: b.reshape(3 * D)),
        "attn.proj.weight": ("proj", lambda w: w.T.reshape(N, H, D), lambda w: w.reshape(D, D).T),
        "attn.proj.bias": ("proj_bias", *ident),
        "mlp.gate_proj.weight": ("gate", *t), "mlp.gate_proj.bias": ("gate_bias", *ident),
        "mlp.up_proj.weight": ("up", *t), "mlp.up_proj.bias": ("up_bias", *ident),
        "mlp.down_proj.weight": ("down", *t), "mlp.down_proj.bias": ("down_bias", *ident),
    }


_MERGER = {"merger.ln_q.weight": ("ln_q", False), "merger.mlp.0.weight": ("fc1", True),
           "merger.mlp.0.bias": ("fc1_bias", False), "merger.mlp.2.weight": ("fc2", True),
           "merger.mlp.2.bias": ("fc2_bias", False)}


def _canonical(name: str) -> str:
    """transformers 4.5x's `model.language_model.*` / `model.visual.*` as the hub's `model.*` / `visual.*`."""
    return re.sub(r"^model\.visual\.", "visual.", re.sub(r"^model\.language_model\.", "model.", name))


def load_vl(path: str | os.PathLike, *, param_dtype: str = "float32", compute_dtype: str = "float32"):
    """(VLConfig, params) from a Qwen2.5-VL checkpoint directory."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(not_hf_dir_message(path))
    cfg = vl_from_hf_dict(json.loads((path / "config.json").read_text()), param_dtype=param_dtype,
                          compute_dtype=compute_dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {path}; export the model with "
                              "save_pretrained(safe_serialization=True)")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        with safe_open(str(file), framework="np") as f:
            tensors.update({_canonical(k): f.get_tensor(k) for k in f.keys()})
    dt = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}[param_dtype]
    take = lambda name: tensors.pop(name) if name in tensors else _missing(path, name)
    text, v = cfg.text, cfg.vision
    layers = {ours: np.stack([to_ours(take(f"model.layers.{i}.{suffix}")) for i in range(text.num_layers)])
              for suffix, (ours, to_ours, _) in hf_layer_map(text).items()}
    params = {"embed": take("model.embed_tokens.weight"), "layers": layers, "final_norm": take("model.norm.weight")}
    if not text.tie_embeddings:
        params["lm_head"] = take("lm_head.weight")
    tensors.pop("lm_head.weight", None)
    blocks = {ours: np.stack([to_ours(take(f"visual.blocks.{i}.{suffix}")) for i in range(v.depth)])
              for suffix, (ours, to_ours, _) in _vision_map(v).items()}
    merger = {ours: take(f"visual.{name}").T if transpose else take(f"visual.{name}")
              for name, (ours, transpose) in _MERGER.items()}
    patch = take("visual.patch_embed.proj.weight")
    params["visual"] = {"patch_embed": patch.reshape(patch.shape[0], -1).T, "blocks": blocks, "merger": merger}
    if tensors:
        raise CheckpointError(f"unexpected tensor {sorted(tensors)[0]!r} in {path} ({len(tensors)} unused); the "
                              "checkpoint does not fit Qwen2.5-VL")
    return cfg, _place(params, dt)


def _missing(path: Path, name: str):
    raise CheckpointError(f"checkpoint {path} lacks {name!r}; it does not fit its config.json")


def _place(tree, dt):
    if isinstance(tree, dict):
        return {k: _place(v, dt) for k, v in tree.items()}
    return jnp.asarray(np.ascontiguousarray(tree).astype(dt))


def save_vl(cfg: VLConfig, params, path: str | os.PathLike) -> Path:
    """Writes a Qwen2.5-VL checkpoint directory transformers loads (one safetensors file)."""
    path = Path(path)
    v = cfg.vision
    out = {name: arr for name, arr in hf_tensors(cfg.text, {k: x for k, x in params.items() if k != "visual"})}
    vp = params["visual"]
    for suffix, (ours, _, to_hf) in _vision_map(v).items():
        for i in range(v.depth):
            out[f"visual.blocks.{i}.{suffix}"] = np.asarray(to_hf(np.asarray(vp["blocks"][ours][i])))
    for name, (ours, transpose) in _MERGER.items():
        w = np.asarray(vp["merger"][ours])
        out[f"visual.{name}"] = w.T if transpose else w
    shape = (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    out["visual.patch_embed.proj.weight"] = np.asarray(vp["patch_embed"]).T.reshape(shape)
    with written_into_place(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(vl_to_hf_dict(cfg), indent=2))
        save_file({k: np.ascontiguousarray(a) for k, a in out.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
    return path
