"""The sparse mixture-of-experts MLP (Shazeer et al., 2017; Mixtral, Jiang et al., 2024; Qwen3-MoE),
one more MLP kind a layer can have: `layer_mlp(cfg)` picks it for every layer of a model whose
`cfg.moe` is set (or `mlp_of_kind` per layer where some stay dense: `rljax.models.mlp_kinds`),
and the block calls it where a dense model calls its SwiGLU.

    logits_te = x_td @ router_de                      (f32 accumulate)
    scoring "softmax":       p = softmax(logits); ids, g = top_k(p); g /= sum(g) if norm_topk_prob
    scoring "topk_softmax":  ids, l = top_k(logits); g = softmax(l)
    y_td = experts_apply(x, ids, g, experts)  [+ sigmoid(x . shared_router) * SwiGLU_shared(x)]

Params of one layer (stacked on the leading L axis like every layer weight):

    router        [D, E]
    expert_gate   [E, D, F]    expert_up [E, D, F]    expert_down [E, F, D]
    shared_gate   [D, Fs]      shared_up [D, Fs]      shared_down [Fs, D]    shared_router [D]
                                                       (Qwen2-MoE's shared expert only)

Routing replay (`routes_btk`): the experts are the given ones instead of the router's own top-k,
and the gates are the router's probabilities AT those experts (renormalised as the family does),
so the router's weights still get gradients through the gates while every token's expert choice
is the one the sampler made (R3, "routing replay"; verl, slime). A record entry of -1 (a token
the sampler never fed back, or padding) routes that token by the router's own top-k. Dropless:
every routed token is computed; nothing is capacity-dropped, as in the HF models.

Contract of `moe_mlp` (for expert parallelism and the trainer):

    moe_mlp(x_btd, lp, cfg, routes_btk=None) -> (y_btd f32, MoEAux)

`MoEAux` holds, per token, the experts used (`routes_btk` int32 [B, T, k]), the router's own
top-k (`own_routes_btk`, equal to `routes_btk` without replay) and the router logits
(`router_logits_bte` f32), from which the aux losses (`rljax.models.moe_losses`) and the
route-agreement metric are computed. The expert computation is `rljax.models.experts.experts_apply`,
the one function expert parallelism wraps.

Shape letters: B batch, T time, D hidden, E experts, k experts per token, F expert width,
Fs shared-expert width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax.models.config import ModelConfig
from rljax.models.expert_parallel import sharded_experts_apply
from rljax.models.experts import ExpertWeights, resolve_experts_impl
from rljax.models.layers import dense_mlp, project
from rljax.models.mlp_kinds import num_moe_layers


class MoEAux(NamedTuple):
    """One MoE layer's routing (stacked to [L, B, T, ...] by the layer scan)."""

    routes_btk: jax.Array  # int32: the experts each token was computed with
    own_routes_btk: jax.Array  # int32: the router's own top-k (== routes_btk without replay)
    router_logits_bte: jax.Array  # f32


def route(x_btd, router_de, cfg: ModelConfig, routes_btk=None):
    """(gates_btk f32, experts_btk int32 used, own top-k int32, logits_bte f32); see the module
    docstring. With `routes_btk` the experts are those and the gates come from the router's
    probabilities at them."""
    moe = cfg.moe
    logits = project(x_btd, router_de, dtype=cfg.compute_jnp_dtype)
    scores = jax.nn.softmax(logits, axis=-1) if moe.scoring == "softmax" else logits
    top, own = jax.lax.top_k(scores, moe.top_k)
    used = own
    if routes_btk is not None:  # a record; -1 marks a token it does not cover (routed by its own top-k)
        used = jnp.where(routes_btk >= 0, routes_btk.astype(own.dtype), own)
        top = jnp.take_along_axis(scores, used, axis=-1)
    if moe.scoring == "softmax":
        gates = top / jnp.sum(top, axis=-1, keepdims=True) if moe.norm_topk_prob else top
    else:
        gates = jax.nn.softmax(top, axis=-1)
    return gates, used.astype(jnp.int32), own.astype(jnp.int32), logits


def moe_mlp(x_btd, lp, cfg: ModelConfig, routes_btk=None):
    """The MoE MLP of one layer: (y_btd f32, MoEAux). See the module docstring."""
    moe, dt = cfg.moe, cfg.compute_jnp_dtype
    b, t, d = x_btd.shape
    gates, used, own, logits = route(x_btd, lp["router"], cfg, routes_btk)
    weights = ExpertWeights(lp["expert_gate"], lp["expert_up"], lp["expert_down"])
    # experts_apply, or its all-to-all expert-parallel form inside an expert mesh (rljax.models.expert_parallel)
    y = sharded_experts_apply(x_btd.reshape(b * t, d), used.reshape(b * t, -1), gates.reshape(b * t, -1), weights,
                              impl=resolve_experts_impl(moe.impl, every_expert=moe.top_k == moe.num_experts), activation=cfg.activation,
                              dtype=dt).reshape(b, t, d)
    if moe.shared_expert_size:
        shared = dense_mlp(x_btd, {"gate": lp["shared_gate"], "up": lp["shared_up"], "down": lp["shared_down"]}, cfg)
        scale = jax.nn.sigmoid(project(x_btd, lp["shared_router"][:, None], dtype=dt))
        y = y + scale * shared
    return y, MoEAux(used, own, logits)


def dense_layer_mlp(x_btd, lp, cfg: ModelConfig, routes_btk=None):
    """The dense SwiGLU MLP in the MLP-kind signature: (y_btd f32, None)."""
    return dense_mlp(x_btd, lp, cfg), None


def layer_mlp(cfg: ModelConfig):
    """The MLP kind of `cfg`'s layers: fn(x_btd, lp, cfg, routes_btk=None) -> (y_btd, aux or None).
    For a stack mixing dense and MoE layers, `mlp_of_kind` per layer (`rljax.models.mlp_kinds`)."""
    return moe_mlp if cfg.moe is not None else dense_layer_mlp


def mlp_of_kind(kind: str):
    """The MLP function of a `rljax.models.mlp_kinds` kind ("moe" or "dense")."""
    return moe_mlp if kind == "moe" else dense_layer_mlp


def init_moe_layers(cfg: ModelConfig, normal) -> dict:
    """Random stacked MoE weights for every sparse layer (and dense SwiGLU weights for the dense
    layers of a mixed stack: `rljax.models.mlp_kinds`), `normal(*shape)` drawing each."""
    D, moe = cfg.hidden_size, cfg.moe
    L = cfg.num_layers - len(moe.dense_layers)
    E, F = moe.num_experts, moe.expert_size
    out = {"router": normal(L, D, E), "expert_gate": normal(L, E, D, F), "expert_up": normal(L, E, D, F),
           "expert_down": normal(L, E, F, D)}
    if moe.dense_layers:
        Ld, Fd = len(moe.dense_layers), cfg.intermediate_size
        out.update(gate=normal(Ld, D, Fd), up=normal(Ld, D, Fd), down=normal(Ld, Fd, D))
    if moe.shared_expert_size:
        Fs = moe.shared_expert_size
        out.update(shared_gate=normal(L, D, Fs), shared_up=normal(L, D, Fs), shared_down=normal(L, Fs, D),
                   shared_router=normal(L, D))
    return out


def route_layers(cfg: ModelConfig) -> tuple[int, int]:
    """The trailing (L, k) of a routing record: L the sparse layers, in depth order (a mixed
    stack's dense layers route nothing: `rljax.models.mlp_kinds`), k the experts per token."""
    return num_moe_layers(cfg), cfg.moe.top_k


def route_dtype(cfg: ModelConfig):
    """The integer type of a routing record (`rljax.sampling` records, `RolloutBatch.routes_btlk`):
    int8 when every expert id and the -1 of an unrecorded token fit (E <= 127), else int16."""
    return jnp.int8 if cfg.moe.num_experts <= 127 else jnp.int16
