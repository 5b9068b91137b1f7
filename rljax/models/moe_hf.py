"""HF tensor names and layouts of an MoE layer's weights (for `rljax.models.hf_io`).

Two expert layouts exist on disk, and both load:

- per expert (the Hub's, and what transformers 5's `save_pretrained` writes back):
  `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` (Qwen), or Mixtral's
  `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (w1 gate, w3 up, w2 down), each a torch Linear
  [out, in];
- fused (transformers 5's in-memory parameters): `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows
  first, then up) and `mlp.experts.down_proj` [E, D, F].

Mixtral's router and experts live under `block_sparse_moe.` on the Hub and under `mlp.` in
transformers 5; both prefixes are read, and export writes the Hub's.
"""

from __future__ import annotations

import re
from typing import Callable, Iterator

import numpy as np

from rljax.models.config import ModelConfig

EXPERT_LAYOUTS = ("per_expert", "fused")
_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_OURS = {"gate_proj": "expert_gate", "w1": "expert_gate", "up_proj": "expert_up", "w3": "expert_up",
         "down_proj": "expert_down", "w2": "expert_down"}
_T = (lambda w: w.T, lambda w: w.T)


def canonical_suffix(suffix: str) -> str:
    """A layer tensor's suffix with Mixtral's Hub prefix `block_sparse_moe.` read as `mlp.`."""
    return "mlp." + suffix[len("block_sparse_moe."):] if suffix.startswith("block_sparse_moe.") else suffix


def hub_suffix(cfg: ModelConfig, suffix: str) -> str:
    """The suffix export writes: Mixtral's MoE tensors under `block_sparse_moe.`, as on the Hub."""
    if cfg.model_type == "mixtral" and suffix.startswith("mlp."):
        return "block_sparse_moe." + suffix[len("mlp."):]
    return suffix


def moe_layer_map(cfg: ModelConfig) -> dict[str, tuple[str, Callable, Callable]]:
    """HF suffix -> (our key, hf->ours, ours->hf) for the router and the shared expert (one tensor
    each per layer; the experts are `expert_parts`)."""
    m = {"mlp.gate.weight": ("router", *_T)}  # [E, D] <-> ours [D, E]
    if cfg.moe.shared_expert_size:
        m.update({
            "mlp.shared_expert.gate_proj.weight": ("shared_gate", *_T),
            "mlp.shared_expert.up_proj.weight": ("shared_up", *_T),
            "mlp.shared_expert.down_proj.weight": ("shared_down", *_T),
            "mlp.shared_expert_gate.weight": ("shared_router", lambda w: w[0], lambda w: w[None]),  # [1, D]
        })
    return m


def expert_parts(cfg: ModelConfig, suffix: str) -> list[tuple[str, int | None, Callable]] | None:
    """What an expert tensor holds: [(our key, expert index or None for all experts, hf->ours)];
    None when `suffix` is no expert tensor."""
    m = _PER_EXPERT.match(suffix)
    if m:
        return [(_OURS[m.group(2)], int(m.group(1)), lambda w: w.T)]
    f = cfg.moe.expert_size
    if suffix == "mlp.experts.gate_up_proj":
        return [("expert_gate", None, lambda w: w[:, :f].transpose(0, 2, 1)),
                ("expert_up", None, lambda w: w[:, f:].transpose(0, 2, 1))]
    if suffix == "mlp.experts.down_proj":
        return [("expert_down", None, lambda w: w.transpose(0, 2, 1))]
    return None


def expert_tensors(cfg: ModelConfig, layer: dict[str, np.ndarray], layout: str) -> Iterator[tuple[str, np.ndarray]]:
    """(suffix, array) of one layer's experts in the HF `layout` ("per_expert" or "fused")."""
    gate, up, down = (np.asarray(layer[k]) for k in ("expert_gate", "expert_up", "expert_down"))
    if layout == "fused":
        yield "mlp.experts.gate_up_proj", np.ascontiguousarray(np.concatenate([gate, up], axis=2).transpose(0, 2, 1))
        yield "mlp.experts.down_proj", np.ascontiguousarray(down.transpose(0, 2, 1))
        return
    names = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for e in range(gate.shape[0]):
        for name, w in zip(names, (gate, up, down)):
            yield f"mlp.experts.{e}.{name}.weight", np.ascontiguousarray(w[e].T)
