"""Hugging Face checkpoint I/O: `config.json` + `*.safetensors` (sharded index included).

Loading streams tensor by tensor into preallocated host arrays, so peak host memory is about one
copy of the model plus one tensor. Export writes a directory that transformers loads as is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rljax.errors import CheckpointError
from rljax.models.config import ModelConfig, from_hf_dict, to_hf_dict
from rljax.models.transformer import Params, init_params

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _hf_layer_map(cfg: ModelConfig) -> dict[str, tuple[str, Callable, Callable]]:
    """HF per-layer suffix -> (our key, hf->ours, ours->hf). Ours are [in, out...] layouts."""
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = (lambda w: w, lambda w: w)
    def proj(heads):  # torch Linear [heads*H, D] <-> ours [D, heads, H]
        return (lambda w: w.T.reshape(D, heads, H), lambda w: w.reshape(D, heads * H).T)
    def bias(heads):
        return (lambda b: b.reshape(heads, H), lambda b: b.reshape(heads * H))
    m = {
        "input_layernorm.weight": ("attn_norm", *ident),
        "self_attn.q_proj.weight": ("q", *proj(N)),
        "self_attn.k_proj.weight": ("k", *proj(K)),
        "self_attn.v_proj.weight": ("v", *proj(K)),
        "self_attn.o_proj.weight": ("o", lambda w: w.T.reshape(N, H, D), lambda w: w.reshape(N * H, D).T),
        "mlp.gate_proj.weight": ("gate", lambda w: w.T, lambda w: w.T),
        "mlp.up_proj.weight": ("up", lambda w: w.T, lambda w: w.T),
        "mlp.down_proj.weight": ("down", lambda w: w.T, lambda w: w.T),
    }
    if cfg.sandwich_norm:
        m["post_attention_layernorm.weight"] = ("attn_post_norm", *ident)
        m["pre_feedforward_layernorm.weight"] = ("mlp_norm", *ident)
        m["post_feedforward_layernorm.weight"] = ("mlp_post_norm", *ident)
    else:
        m["post_attention_layernorm.weight"] = ("mlp_norm", *ident)
    if cfg.qkv_bias:
        m["self_attn.q_proj.bias"] = ("q_bias", *bias(N))
        m["self_attn.k_proj.bias"] = ("k_bias", *bias(K))
        m["self_attn.v_proj.bias"] = ("v_bias", *bias(K))
    if cfg.o_bias:
        m["self_attn.o_proj.bias"] = ("o_bias", *ident)
    if cfg.qk_norm:
        m["self_attn.q_norm.weight"] = ("q_norm", *ident)
        m["self_attn.k_norm.weight"] = ("k_norm", *ident)
    return m


_TOP_LEVEL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {path}; export the model with save_pretrained(safe_serialization=True)")
    return files


def read_hf_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """Reads `config.json` from a HF checkpoint directory into a ModelConfig."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path} has no config.json; pass a Hugging Face checkpoint directory")
    return from_hf_dict(json.loads(cfg_file.read_text()), **overrides)


def load_hf(path: str | os.PathLike, *, param_dtype: str = "float32", compute_dtype: str = "float32",
            **overrides) -> tuple[ModelConfig, Params]:
    """Loads a HF checkpoint directory into (config, params), streaming one tensor at a time."""
    path = Path(path)
    cfg = read_hf_config(path, param_dtype=param_dtype, compute_dtype=compute_dtype, **overrides)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    np_dtype = _NP_DTYPES[param_dtype]
    host = jax.tree.map(lambda s: np.empty(s.shape, np_dtype), shapes)
    filled: set[tuple[str, int]] = set()
    layer_map = _hf_layer_map(cfg)
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                if _IGNORED.match(name):
                    continue
                if name in _TOP_LEVEL:
                    ours, layer, to_ours = _TOP_LEVEL[name], -1, (lambda w: w)
                    if ours == "lm_head" and cfg.tie_embeddings:
                        continue  # some exporters also write the tied head; the embedding wins
                    target = host.get(ours)
                else:
                    m = _LAYER_KEY.match(name)
                    if not m or m.group(2) not in layer_map:
                        raise CheckpointError(f"unexpected tensor {name!r} in {file.name} for model_type "
                                              f"{cfg.model_type!r}; the checkpoint does not fit this architecture")
                    layer = int(m.group(1))
                    ours, to_ours, _ = layer_map[m.group(2)]
                    if layer >= cfg.num_layers:
                        raise CheckpointError(f"tensor {name!r} is past num_hidden_layers={cfg.num_layers}")
                    target = host["layers"][ours]
                value = to_ours(f.get_tensor(name))
                want = target.shape if layer < 0 else target.shape[1:]
                if value.shape != want:
                    raise CheckpointError(f"tensor {name!r} has shape {f.get_slice(name).get_shape()}, "
                                          f"which does not fit config.json (expected {want} in our layout)")
                if layer < 0:
                    target[...] = value.astype(np_dtype)
                else:
                    target[layer] = value.astype(np_dtype)
                filled.add((ours, layer))
    expected = {(k, -1) for k in host if k != "layers"}
    expected |= {(k, i) for k in host["layers"] for i in range(cfg.num_layers)}
    missing = sorted(expected - filled)
    if missing:
        key, layer = missing[0]
        where = f"layer {layer} " if layer >= 0 else ""
        raise CheckpointError(f"checkpoint {path} lacks {where}{key!r} ({len(missing)} tensors missing)")
    params = jax.tree.map(lambda a: jnp.asarray(a), host)
    return cfg, params


def _hf_tensors(cfg: ModelConfig, params: Params):
    """Yields (hf_name, host array) pairs in the HF layout."""
    yield "model.embed_tokens.weight", np.asarray(params["embed"])
    for suffix, (ours, _, to_hf) in _hf_layer_map(cfg).items():
        stacked = params["layers"][ours]
        for i in range(cfg.num_layers):
            yield f"model.layers.{i}.{suffix}", np.ascontiguousarray(to_hf(np.asarray(stacked[i])))
    yield "model.norm.weight", np.asarray(params["final_norm"])
    if not cfg.tie_embeddings:
        yield "lm_head.weight", np.asarray(params["lm_head"])


def save_hf(cfg: ModelConfig, params: Params, path: str | os.PathLike, *,
            max_shard_bytes: int = 2 * 1024**3, extra_config: dict[str, Any] | None = None) -> Path:
    """Writes params as a HF checkpoint directory (config.json + safetensors, sharded if large).

    The directory is written next to `path` and renamed into place, so a crash leaves no
    half-written checkpoint.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        hf_cfg = to_hf_dict(cfg)
        hf_cfg.update(extra_config or {})
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name, arr in _hf_tensors(cfg, params):
            if size and size + arr.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = arr
            size += arr.nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(a.nbytes for s in shards for a in s.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
