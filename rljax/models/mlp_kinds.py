"""Which MLP each decoder layer has, and how a stack that mixes dense and MoE layers is laid out.

Qwen3-MoE and Qwen2-MoE may keep some layers dense: in transformers' decoder layer, layer i is
sparse iff `i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0`,
and a dense layer's SwiGLU has width `intermediate_size` (the experts `moe_intermediate_size`).
`MoEConfig.dense_layers` holds that set; `layer_kinds(cfg)` is the per-layer result.

Layout of a mixed stack (the design, and why). Every per-layer weight stays stacked in
`params["layers"]`, but each MLP kind's weights are stacked over the layers of that kind only:

    attention and norm weights   [L, ...]     rows: every layer, in depth order
    gate / up / down             [Ld, ...]    rows: the dense layers, in depth order
    router / expert_* / shared_* [Ls, ...]    rows: the sparse layers, in depth order

so no layer holds weights it does not use (an expert stack per dense layer would cost E times
its MLP). The full-sequence forward splits the depth into `segments`: maximal runs of
consecutive layers of one kind, each one `lax.scan` over its own slice of the stacks with that
kind's MLP as the scan body's block. The hot path has no per-layer branch (a `lax.cond` per
layer would compile both MLPs into every step and trace a dummy routing for dense layers); a
model whose layers are all one kind is one segment, exactly the single scan it always was.
A stack of the pattern [dense, moe, dense, moe] compiles one scan body per segment (four here).

An MoE model's routing (`MoEAux`, the sampler's routes record, `RolloutBatch.routes_btlk`)
has one layer row per SPARSE layer, in depth order (`num_moe_layers(cfg)` of them): dense
layers route nothing. Router losses are therefore over the sparse layers only, as transformers'
`load_balancing_loss_func` sees only the routers' logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

DENSE_KEYS = frozenset({"gate", "up", "down"})
MOE_KEYS = frozenset({"router", "expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up",
                      "shared_down", "shared_router"})


def key_kind(key: str) -> str | None:
    """The MLP kind whose layers a `params["layers"]` key is stacked over; None: every layer."""
    return "dense" if key in DENSE_KEYS else "moe" if key in MOE_KEYS else None


def layer_kinds(cfg) -> tuple[str, ...]:
    """Per-layer MLP kind, "dense" or "moe" (HF's rule, through `MoEConfig.dense_layers`)."""
    if cfg.moe is None:
        return ("dense",) * cfg.num_layers
    dense = set(cfg.moe.dense_layers)
    return tuple("dense" if i in dense else "moe" for i in range(cfg.num_layers))


def is_mixed(cfg) -> bool:
    return len(set(layer_kinds(cfg))) > 1


def moe_layers(cfg) -> tuple[int, ...]:
    """The sparse layers' indices: the layer axis of an MoE model's routing arrays."""
    return tuple(i for i, k in enumerate(layer_kinds(cfg)) if k == "moe")


def num_moe_layers(cfg) -> int:
    return len(moe_layers(cfg))


def stack_rows(cfg, key: str) -> tuple[int, ...]:
    """The layer index of each row of `params["layers"][key]` (what HF I/O reads and writes)."""
    kind = key_kind(key)
    return tuple(i for i, k in enumerate(layer_kinds(cfg)) if kind is None or k == kind)


class Segment(NamedTuple):
    """Layers [start, stop), all of MLP `kind`; their MLP weights are rows [row, row + stop - start)
    of that kind's stacks."""

    start: int
    stop: int
    kind: str
    row: int


def segments(cfg) -> tuple[Segment, ...]:
    """The maximal runs of consecutive layers of one MLP kind, in depth order."""
    kinds, out, count = layer_kinds(cfg), [], {"dense": 0, "moe": 0}
    for i, kind in enumerate(kinds):
        if out and out[-1].kind == kind:
            out[-1] = out[-1]._replace(stop=i + 1)
        else:
            out.append(Segment(i, i + 1, kind, count[kind]))
        count[kind] += 1
    return tuple(out)


def segment_layers(layers: dict, seg: Segment) -> dict:
    """The stacked weights of `seg`'s layers: shared keys sliced by depth, its MLP kind's by row;
    the other kind's keys left out."""
    n = seg.stop - seg.start
    out = {}
    for key, w in layers.items():
        kind = key_kind(key)
        if kind is None:
            out[key] = jax.tree.map(lambda x: x[seg.start:seg.stop], w)
        elif kind == seg.kind:
            out[key] = jax.tree.map(lambda x: x[seg.row:seg.row + n], w)
    return out


def split_layers(cfg, layers: dict) -> tuple[dict, ...]:
    """Per-layer dicts of a mixed stack (for the unrolled decode loop): layer i gets its shared
    weights and its own MLP kind's row."""
    out = []
    for seg in segments(cfg):
        stacked = segment_layers(layers, seg)
        out += [jax.tree.map(lambda w, j=j: w[j], stacked) for j in range(seg.stop - seg.start)]
    return tuple(out)


def stack_layer_list(cfg, per_layer) -> dict:
    """The inverse of `split_layers` (or of a uniform stack's per-layer split)."""
    if not is_mixed(cfg):
        return jax.tree.map(lambda *ws: jnp.stack(ws), *per_layer)
    kinds = layer_kinds(cfg)
    out = {}
    for key in sorted(set().union(*(lp.keys() for lp in per_layer))):
        kind = key_kind(key)
        rows = [lp[key] for lp, k in zip(per_layer, kinds) if kind is None or k == kind]
        out[key] = jax.tree.map(lambda *ws: jnp.stack(ws), *rows)
    return out
