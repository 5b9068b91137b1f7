"""Hugging Face checkpoint I/O: `config.json` + `*.safetensors` (sharded index included).

Loading streams tensor by tensor: each of our leaves is filled from its HF tensors into
shard-sized host buffers and placed (`load_hf`), so peak host memory is one leaf's shards plus
one tensor, and with a sharding nothing is ever whole on a device. Export writes a directory
that transformers loads as is.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from rljax.models.mlp_kinds import stack_rows
from rljax.models.moe_hf import EXPERT_LAYOUTS, canonical_suffix, expert_parts, expert_tensors, hub_suffix, moe_layer_map
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
    if cfg.moe is not None:  # the MoE MLP's router and shared expert; its experts: `moe_hf.expert_parts`
        if not cfg.moe.dense_layers:  # dense layers keep their SwiGLU (`rljax.models.mlp_kinds`)
            for name in ("gate", "up", "down"):
                del m[f"mlp.{name}_proj.weight"]
        m.update(moe_layer_map(cfg))
    return m


def hf_layer_map(cfg: ModelConfig) -> dict[str, tuple[str, Callable, Callable]]:
    """HF decoder-layer suffix -> (our key, hf->ours, ours->hf), for loaders of models that embed
    this decoder (a VLM's language model: `rljax.models.vl_io`)."""
    return _hf_layer_map(cfg)


_TOP_LEVEL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head",
              "score.weight": "score", "score.bias": "score_bias"}
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


def not_hf_dir_message(path: str | os.PathLike) -> str:
    """Why `path` is no HF checkpoint directory, in one line; a training run's directory (it holds
    `checkpoints/`) gets the command that turns it into one."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return (f"{path} is an rljax run directory, not a Hugging Face one; write its best checkpoint as one "
                f"with: rljax export {path} OUT_DIR")
    return f"{path} has no config.json; pass a Hugging Face checkpoint directory"


def read_hf_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """Reads `config.json` from a HF checkpoint directory into a ModelConfig."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(not_hf_dir_message(path))
    return from_hf_dict(json.loads(cfg_file.read_text()), **overrides)


def head_shapes(cfg: ModelConfig, num_labels: int | None, bias: bool = False):
    """Our params' shapes for a model with a causal LM head (`num_labels` None) or, instead of
    it, a classification head `score` [D, num_labels] and, with `bias`, `score_bias` [L] (HF's
    *ForSequenceClassification: the backbone plus a bias-free `score` Linear;
    *ForTokenClassification: the same Linear with a bias)."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    if num_labels is None:
        return shapes
    dtype = shapes["embed"].dtype
    shapes = {k: v for k, v in shapes.items() if k != "lm_head"}
    shapes["score"] = jax.ShapeDtypeStruct((cfg.hidden_size, num_labels), dtype)
    if bias:
        shapes["score_bias"] = jax.ShapeDtypeStruct((num_labels,), dtype)
    return shapes


def has_head_bias(path: str | os.PathLike) -> bool:
    """Whether a classification checkpoint's head has a bias (`score.bias`), from its headers."""
    for file in _checkpoint_files(Path(path)):
        with safe_open(str(file), framework="np") as f:
            if "score.bias" in f.keys():
                return True
    return False


def load_hf(path: str | os.PathLike, *, param_dtype: str = "float32", compute_dtype: str = "float32",
            shardings=None, num_labels: int | None = None, **overrides) -> tuple[ModelConfig, Params]:
    """Loads a HF checkpoint directory into (config, params), streaming one tensor at a time.

    Every tensor is checked against config.json from its header first (a wrong shape is named by
    its HF key, a missing or unexpected tensor before anything is read). Then each of our leaves
    is built on its own: every HF tensor it needs is read once, converted to our layout
    (`_hf_layer_map`), and only the slices this process's devices hold are copied into
    shard-sized host buffers (a stacked [L, ...] leaf layer by layer), which become the global
    array through `jax.make_array_from_callback`. So with `shardings` (a params-shaped tree of
    NamedShardings, e.g. `Layout.params` of the abstract params) the params are born sharded:
    no device and no host buffer holds more than its shards plus the one tensor being read, and
    each process of a multi-process run reads only what its own devices hold. Without
    `shardings` the params land on the default device, one leaf at a time.

    `num_labels` loads a classification checkpoint instead (a reward model:
    `rljax.models.heads`): the backbone and its `score.weight` head, as params["score"] [D, L]
    (and its `score.bias`, when it has one, as params["score_bias"] [L]).
    """
    path = Path(path)
    cfg = read_hf_config(path, param_dtype=param_dtype, compute_dtype=compute_dtype, **overrides)
    shapes = head_shapes(cfg, num_labels, bias=num_labels is not None and has_head_bias(path))
    sources = _tensor_sources(path, cfg, shapes)
    np_dtype = _NP_DTYPES[param_dtype]
    if shardings is None:
        shardings = jax.tree.map(lambda _: None, shapes)
    with _TensorReader() as reader:
        def leaf(key_path, shape, sharding):
            ours = key_path[-1].key
            layers = stack_rows(cfg, ours) if key_path[0].key == "layers" else None
            return _load_leaf(shape.shape, np_dtype, sharding, reader, sources, ours, layers)
        params = jax.tree_util.tree_map_with_path(leaf, shapes, shardings, is_leaf=lambda x: x is None)
    return cfg, params


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where one of our (key, layer) pieces lives: its file, its HF name, and HF -> our layout."""

    file: Path
    name: str
    to_ours: Callable


def _tensor_sources(path: Path, cfg: ModelConfig, shapes) -> dict[tuple[str, int], _Source]:
    """(our key, layer or -1) -> source, from the safetensors headers alone (no tensor is read).
    Raises CheckpointError for an unexpected tensor, a shape that does not fit config.json, or a
    missing tensor."""
    layer_map = _hf_layer_map(cfg)
    sources: dict[tuple[str, int], _Source] = {}
    expert_pieces: dict[tuple[str, int], dict[int, _Source]] = {}  # per-expert tensors, stacked below
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                if _IGNORED.match(name):
                    continue
                if name in _TOP_LEVEL:
                    ours, layer = _TOP_LEVEL[name], -1
                    to_ours = (lambda w: w.T) if ours == "score" else (lambda w: w)  # torch Linear [L, D]
                    if ours == "lm_head" and cfg.tie_embeddings:
                        continue  # some exporters also write the tied head; the embedding wins
                    want = shapes[ours].shape if ours in shapes else None
                else:
                    m = _LAYER_KEY.match(name)
                    parts = expert_parts(cfg, canonical_suffix(m.group(2))) if m and cfg.moe is not None else None
                    if parts:
                        _add_expert_parts(parts, name, int(m.group(1)), file, f, cfg, shapes, sources, expert_pieces)
                        continue
                    if m and cfg.moe is not None:
                        m = _LAYER_KEY.match(f"model.layers.{m.group(1)}.{canonical_suffix(m.group(2))}")
                    if not m or m.group(2) not in layer_map:
                        raise CheckpointError(f"unexpected tensor {name!r} in {file.name} for model_type "
                                              f"{cfg.model_type!r}; the checkpoint does not fit this architecture")
                    layer = int(m.group(1))
                    ours, to_ours, _ = layer_map[m.group(2)]
                    if layer >= cfg.num_layers:
                        raise CheckpointError(f"tensor {name!r} is past num_hidden_layers={cfg.num_layers}")
                    _need_kind(cfg, name, ours, layer)
                    want = shapes["layers"][ours].shape[1:]
                hf_shape = tuple(f.get_slice(name).get_shape())
                if want is None or _converted_shape(to_ours, hf_shape) != want:
                    raise CheckpointError(f"tensor {name!r} has shape {list(hf_shape)}, which does not fit "
                                          f"config.json (expected {want} in our layout)")
                sources[(ours, layer)] = _Source(file, name, to_ours)
    for (ours, layer), pieces in expert_pieces.items():
        if sorted(pieces) == list(range(cfg.moe.num_experts)):
            sources[(ours, layer)] = _Stack(tuple(pieces[e] for e in range(cfg.moe.num_experts)))
    expected = {(k, -1) for k in shapes if k != "layers"}
    expected |= {(k, i) for k in shapes["layers"] for i in stack_rows(cfg, k)}
    missing = sorted(expected - set(sources))
    if missing:
        key, layer = missing[0]
        where = f"layer {layer} " if layer >= 0 else ""
        raise CheckpointError(f"checkpoint {path} lacks {where}{key!r} ({len(missing)} tensors missing)")
    return sources


@dataclasses.dataclass(frozen=True)
class _Stack:
    """One layer's experts, each from its own tensor (the per-expert layout), stacked on axis 0."""

    parts: tuple[_Source, ...]


def _add_expert_parts(parts, name: str, layer: int, file: Path, f, cfg: ModelConfig, shapes, sources,
                      expert_pieces) -> None:
    """Registers an expert tensor (`moe_hf.expert_parts`): a whole [E, ...] stack as a source, one
    expert's as a piece of its stack. A shape that does not fit is named by its HF key."""
    if layer >= cfg.num_layers:
        raise CheckpointError(f"tensor {name!r} is past num_hidden_layers={cfg.num_layers}")
    hf_shape = tuple(f.get_slice(name).get_shape())
    for ours, expert, to_ours in parts:
        _need_kind(cfg, name, ours, layer)
        want = shapes["layers"][ours].shape[1 if expert is None else 2:]
        if _converted_shape(to_ours, hf_shape) != want or (expert is not None and expert >= cfg.moe.num_experts):
            raise CheckpointError(f"tensor {name!r} has shape {list(hf_shape)}, which does not fit config.json "
                                  f"(expected {want} in our layout, {cfg.moe.num_experts} experts)")
        if expert is None:
            sources[(ours, layer)] = _Source(file, name, to_ours)
        else:
            expert_pieces.setdefault((ours, layer), {})[expert] = _Source(file, name, to_ours)


def _need_kind(cfg: ModelConfig, name: str, ours: str, layer: int) -> None:
    """Refuses an MLP tensor of the other kind than its layer's (an expert in a dense layer of
    `mlp_only_layers` / `decoder_sparse_step`, or a dense MLP in a sparse one)."""
    if layer not in stack_rows(cfg, ours):
        raise CheckpointError(f"tensor {name!r} does not fit layer {layer}'s MLP kind in config.json "
                              "(mlp_only_layers / decoder_sparse_step); the checkpoint and its config disagree")


def _converted_shape(to_ours: Callable, hf_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape `to_ours` makes of an HF tensor of `hf_shape` (None when it cannot convert it)."""
    try:
        return tuple(jax.eval_shape(to_ours, jax.ShapeDtypeStruct(hf_shape, np.float32)).shape)
    except (TypeError, ValueError):
        return None


class _TensorReader:
    """Reads single HF tensors in our layout, keeping each safetensors file open once."""

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        self._files: dict[Path, Any] = {}
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def read(self, source: _Source | _Stack) -> np.ndarray:
        if isinstance(source, _Stack):
            return np.stack([self.read(part) for part in source.parts])
        if source.file not in self._files:
            self._files[source.file] = self._stack.enter_context(safe_open(str(source.file), framework="np"))
        return source.to_ours(self._files[source.file].get_tensor(source.name))


def _load_leaf(shape: tuple[int, ...], np_dtype, sharding, reader: _TensorReader,
               sources: dict[tuple[str, int], _Source], ours: str, layers: tuple[int, ...] | None) -> jax.Array:
    """One of our leaves: its tensors read once each (per layer for a stacked leaf: row j holds
    layer `layers[j]`, `rljax.models.mlp_kinds.stack_rows`) and sliced into
    one host buffer per distinct shard this process holds; then placed by `sharding` (default
    device when None)."""
    full = tuple(slice(0, n) for n in shape)
    indices = list(sharding.addressable_devices_indices_map(shape).values()) if sharding is not None else [full]
    buffers: dict[tuple, tuple[tuple[slice, ...], np.ndarray]] = {}
    for index in indices:
        key = _index_key(index, shape)
        if key not in buffers:
            bounds = tuple(slice(*k) for k in key)
            buffers[key] = (bounds, np.empty(tuple(b.stop - b.start for b in bounds), np_dtype))
    if layers is None:
        value = reader.read(sources[(ours, -1)])
        for bounds, buf in buffers.values():
            buf[...] = value[bounds]
    else:
        for row, i in enumerate(layers):
            value = reader.read(sources[(ours, i)])
            for bounds, buf in buffers.values():
                if bounds[0].start <= row < bounds[0].stop:
                    buf[row - bounds[0].start] = value[bounds[1:]]
    if sharding is None:
        return jnp.asarray(buffers[_index_key(full, shape)][1])
    return jax.make_array_from_callback(shape, sharding, lambda index: buffers[_index_key(index, shape)][1])


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A hashable (start, stop) per dim of a shard's index (its slices may be open-ended)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _hf_tensors(cfg: ModelConfig, params: Params, expert_layout: str = "per_expert"):
    """Yields (hf_name, host array) pairs in the HF layout (an MoE model's experts in
    `expert_layout`: `rljax.models.moe_hf`)."""
    rename = (lambda s: s) if expert_layout == "fused" else (lambda s: hub_suffix(cfg, s))
    yield "model.embed_tokens.weight", np.asarray(params["embed"])
    for suffix, (ours, _, to_hf) in _hf_layer_map(cfg).items():
        stacked = params["layers"][ours]
        for row, i in enumerate(stack_rows(cfg, ours)):  # row j of a stack is layer i (`rljax.models.mlp_kinds`)
            yield f"model.layers.{i}.{rename(suffix)}", np.ascontiguousarray(to_hf(np.asarray(stacked[row])))
    if cfg.moe is not None:
        experts = {k: np.asarray(params["layers"][k]) for k in ("expert_gate", "expert_up", "expert_down")}
        for row, i in enumerate(stack_rows(cfg, "expert_gate")):
            for suffix, arr in expert_tensors(cfg, {k: w[row] for k, w in experts.items()}, expert_layout):
                yield f"model.layers.{i}.{rename(suffix)}", arr
    yield "model.norm.weight", np.asarray(params["final_norm"])
    if "score" in params:  # a classification head instead of the LM head
        yield "score.weight", np.ascontiguousarray(np.asarray(params["score"]).T)
        if "score_bias" in params:
            yield "score.bias", np.asarray(params["score_bias"])
    elif not cfg.tie_embeddings:
        yield "lm_head.weight", np.asarray(params["lm_head"])


def hf_tensors(cfg: ModelConfig, params: Params):
    """(HF name, host array) pairs of a decoder's params in the HF layout (for exporters of models
    that embed this decoder)."""
    return _hf_tensors(cfg, params)


@contextlib.contextmanager
def written_into_place(path: Path):
    """Yields a fresh directory next to `path`; on a clean exit it replaces `path` (one rename),
    on an error it is removed. A crash never leaves a half-written directory at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_hf(cfg: ModelConfig, params: Params, path: str | os.PathLike, *,
            max_shard_bytes: int = 2 * 1024**3, extra_config: dict[str, Any] | None = None,
            expert_layout: str = "per_expert") -> Path:
    """Writes params as a HF checkpoint directory (config.json + safetensors, sharded if large).
    An MoE model's experts are written per expert (the Hub's layout, which transformers 5 also
    writes) or, with `expert_layout="fused"`, as transformers 5's fused `gate_up_proj`/`down_proj`.

    The directory is written next to `path` and renamed into place, so a crash leaves no
    half-written checkpoint.
    """
    path = Path(path)
    with written_into_place(path) as tmp:
        hf_cfg = to_hf_dict(cfg)
        hf_cfg.update(extra_config or {})
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        if expert_layout not in EXPERT_LAYOUTS:
            raise CheckpointError(f"expert_layout={expert_layout!r}; choose one of {EXPERT_LAYOUTS}")
        for name, arr in _hf_tensors(cfg, params, expert_layout):
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
    return path
