"""The mixture-of-experts part of a model's architecture, and how it reads and writes HF config.json.

A `MoEConfig` on `ModelConfig.moe` turns every decoder layer's MLP into a sparse MoE block
(`rljax.models.moe`): a router picks `top_k` of `num_experts` SwiGLU experts per token (Shazeer
et al., 2017; Switch/GShard-style token-choice routing), optionally with Qwen2-MoE's shared
expert. The families differ only in these switches:

    family      experts key          scoring                      norm_topk_prob   shared expert
    qwen3_moe   num_experts          softmax over E, then top-k   config            no
    qwen2_moe   num_experts          softmax over E, then top-k   config            yes (sigmoid-gated)
    mixtral     num_local_experts    softmax over E, then top-k   always            no

`scoring="topk_softmax"` (top-k of the logits, then a softmax over the k; gpt-oss, and Mixtral's
original reference code) is the same routing as softmax-then-top-k with `norm_topk_prob`, in a
different rounding order; it is kept for families that define it that way.

How the experts are computed (`impl`) is not architecture and is never written to config.json.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljax.errors import CheckpointError, ConfigError

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
MOE_IMPLEMENTATIONS = ("auto", "grouped", "dense")
SCORINGS = ("softmax", "topk_softmax")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A sparse MoE MLP: `num_experts` SwiGLU experts of width `expert_size`, `top_k` per token.

    `norm_topk_prob`: the k chosen probabilities are renormalised to sum to 1 (Mixtral always;
    Qwen by config). `shared_expert_size` > 0 adds Qwen2-MoE's always-on expert, scaled by
    sigmoid(x . w_gate). `impl`: "dense" runs every expert on every token (the reference),
    "grouped" only the chosen ones (`rljax.models.experts`), "auto" = grouped."""

    num_experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool = False
    scoring: str = "softmax"
    shared_expert_size: int = 0
    impl: str = "auto"
    # Layers whose MLP stays the dense SwiGLU of width `intermediate_size` (Qwen's `mlp_only_layers`
    # and `decoder_sparse_step`, resolved): `rljax.models.mlp_kinds`. Empty: every layer is sparse.
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if tuple(sorted(set(self.dense_layers))) != tuple(self.dense_layers) or any(i < 0 for i in self.dense_layers):
            raise ConfigError(f"moe dense_layers={self.dense_layers} must be distinct layer indices in increasing order")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"moe top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.expert_size <= 0:
            raise ConfigError(f"moe expert_size={self.expert_size} must be positive")
        if self.scoring not in SCORINGS:
            raise ConfigError(f"moe scoring={self.scoring!r}; choose one of {SCORINGS}")
        if self.impl not in MOE_IMPLEMENTATIONS:
            raise ConfigError(f"model.moe_impl={self.impl!r}; choose one of {MOE_IMPLEMENTATIONS}")

    def replace(self, **changes) -> MoEConfig:
        return dataclasses.replace(self, **changes)

    def params_per_layer(self, hidden: int) -> tuple[int, int]:
        """(total, active) MLP parameters of one layer: router, experts, shared expert."""
        expert = 3 * hidden * self.expert_size
        shared = (3 * hidden * self.shared_expert_size + hidden) if self.shared_expert_size else 0
        router = hidden * self.num_experts
        return router + self.num_experts * expert + shared, router + self.top_k * expert + shared


def dense_layers_from_hf(hf: dict[str, Any]) -> tuple[int, ...]:
    """The dense layers of a Qwen MoE config.json, by transformers' rule: layer i is sparse iff
    i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    step = int(hf.get("decoder_sparse_step") or 1)
    only = set(hf.get("mlp_only_layers") or ())
    return tuple(i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step)


def moe_from_hf(hf: dict[str, Any]) -> MoEConfig:
    """The MoE switches of a qwen3_moe / qwen2_moe / mixtral `config.json`, Qwen's dense layers
    (`mlp_only_layers`, `decoder_sparse_step`) included."""
    model_type = hf["model_type"]
    if model_type == "mixtral":
        if hf.get("sliding_window"):
            raise CheckpointError("mixtral with sliding_window set is not supported; set it to null")
        return MoEConfig(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                         expert_size=hf["intermediate_size"], norm_topk_prob=True)
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{model_type} with use_sliding_window=True is not supported; set it to false")
    dense = dense_layers_from_hf(hf)
    if len(dense) == hf["num_hidden_layers"]:
        raise CheckpointError(f"{model_type} with every layer dense (mlp_only_layers / decoder_sparse_step) "
                              f"has no MoE layer; load it as {model_type.split('_')[0]}")
    # transformers 5 writes Qwen's num_experts as num_local_experts (its attribute map)
    return MoEConfig(num_experts=hf.get("num_experts") or hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                     expert_size=hf["moe_intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                     shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0)
                     if model_type == "qwen2_moe" else 0, dense_layers=dense)


def moe_to_hf(model_type: str, moe: MoEConfig) -> dict[str, Any]:
    """The config.json fields of `moe` for `model_type` (the inverse of `moe_from_hf`)."""
    if moe.scoring != "softmax":
        raise CheckpointError(f"{model_type} export needs moe scoring='softmax' (its HF model's routing)")
    if model_type == "mixtral":
        if not moe.norm_topk_prob or moe.shared_expert_size or moe.dense_layers:
            raise CheckpointError("mixtral export needs norm_topk_prob=True, no shared expert and no dense layers")
        return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "intermediate_size": moe.expert_size, "router_aux_loss_coef": 0.0, "output_router_logits": False}
    if model_type == "qwen3_moe" and moe.shared_expert_size:
        raise CheckpointError("qwen3_moe has no shared expert; export as qwen2_moe")
    out = {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_size,
           "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
           "mlp_only_layers": list(moe.dense_layers),
           "router_aux_loss_coef": 0.0, "output_router_logits": False}
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = moe.shared_expert_size
    return out
