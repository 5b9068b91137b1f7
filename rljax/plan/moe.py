"""What a mixture-of-experts model costs: experts, total and active parameters, and the expert-
parallel all-to-all buffers of the update, for `rljax plan`.

Counts come from the architecture alone (per layer: attention, router, experts, shared expert,
norms), so they can be checked by hand and against the params tree's sizes. Active parameters are
those one token uses: every weight except the E - k experts it is not routed to, the FLOPs that
MFU over active parameters counts (6 N_active per trained token; Kaplan et al., 2020).

The buffers are those of `rljax.models.expert_parallel` (GShard's all-to-all dispatch, Lepikhin
et al., 2020): with n tokens per device in one update micro-batch and k experts per token, each
destination gets a slot of C = n k rows (dropless), so one MoE layer holds 3 buffers of
n_ep x C x D (send, receive, return) on every device while it runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from rljax.models import ModelConfig
from rljax.models.expert_parallel import capacity, dispatch_bytes, token_axes

RunConfig = Any  # a `rljax.train.config.TrainConfig`: read here, never imported (plan sits below train)


@dataclasses.dataclass(frozen=True)
class MoEPlan:
    """An MoE model's counts and one MoE layer's all-to-all buffers per device (bytes).

    `tokens_per_device`: the update micro-batch's tokens on one device of the token split
    (data x fsdp x expert); `capacity`: rows per destination slot; `all_to_all_bytes`: 0 without
    an expert axis (no all-to-all: every device holds every expert)."""

    num_experts: int
    top_k: int
    moe_layers: int
    expert_parallel: int
    experts_per_device: int
    total_params: int
    active_params: int
    tokens_per_device: int
    capacity: int
    all_to_all_bytes: int

    def lines(self) -> list[str]:
        head = (f"experts: {self.num_experts} per layer x {self.moe_layers} MoE layers, top-{self.top_k}, "
                f"{self.experts_per_device} per device (expert={self.expert_parallel}); params "
                f"{self.total_params / 1e6:,.1f}M total, {self.active_params / 1e6:,.1f}M active per token")
        if self.expert_parallel == 1:
            return [head, "all-to-all: none (no expert axis: set mesh.expert to split the experts)"]
        return [head, f"all-to-all per MoE layer: {self.tokens_per_device:,} tokens per device x top-{self.top_k} "
                      f"-> {self.expert_parallel} x {self.capacity:,} slots (dropless), "
                      f"{self.all_to_all_bytes / 2**20:,.1f} MiB per device (send, receive, return)"]


def moe_params(model_cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters, embeddings included, written out from the shapes:
    attention q, k, v, o (+ biases, q/k norms), two norms per layer, the router [D, E], E experts of
    3 D F, a shared expert 3 D F_s and its gate [D]; a mixed stack's dense layers a SwiGLU of 3 D F_d
    instead; the final norm; embed (and lm_head)."""
    c, moe = model_cfg, model_cfg.moe
    d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    attn = d * n * h + 2 * d * k * h + n * h * d
    attn += (n + 2 * k) * h if c.qkv_bias else 0
    attn += d if c.o_bias else 0
    attn += 2 * h if c.qk_norm else 0
    norms = 4 * d if c.sandwich_norm else 2 * d
    expert = 3 * d * moe.expert_size
    shared = 3 * d * moe.shared_expert_size + d if moe.shared_expert_size else 0
    router = d * moe.num_experts + shared
    embed = c.vocab_size * d * (1 if c.tie_embeddings else 2) + d
    sparse, dense = c.num_layers - len(moe.dense_layers), len(moe.dense_layers)
    base = c.num_layers * (attn + norms) + dense * 3 * d * c.intermediate_size + embed
    total = base + sparse * (router + moe.num_experts * expert)
    active = base + sparse * (router + moe.top_k * expert)
    return total, active


def update_tokens(cfg: RunConfig, prompt_width: int) -> int:
    """Tokens of one update micro-batch (rows x width, or a packed micro-batch's buffers)."""
    u = cfg.update
    rows = cfg.rl.prompts_per_iteration * cfg.sampling.num_samples // u.num_minibatches
    width = prompt_width + cfg.sampling.max_new_tokens
    if u.packing:
        buffers, length = u.packed_shape(rows, width)
        return buffers * length
    return rows // u.num_microbatches * width


def moe_plan(cfg: RunConfig, model_cfg: ModelConfig, num_devices: int, prompt_width: int) -> MoEPlan | None:
    """The MoE counts and buffers of `cfg`'s run on `num_devices` (None for a dense model)."""
    moe = model_cfg.moe
    if moe is None:
        return None
    sizes = cfg.mesh.axes(num_devices)
    n_ep = sizes.get("expert", 1)
    total, active = moe_params(model_cfg)
    tokens = update_tokens(cfg, prompt_width)
    axes = token_axes(sizes, tokens) if n_ep > 1 else None
    per_device = tokens // math.prod(sizes[a] for a in axes) if axes else tokens
    itemsize = jnp.dtype(model_cfg.compute_jnp_dtype).itemsize  # rows travel in the compute dtype
    buffers = dispatch_bytes(per_device, moe.top_k, model_cfg.hidden_size, n_ep, itemsize) if n_ep > 1 else 0
    return MoEPlan(num_experts=moe.num_experts, top_k=moe.top_k, moe_layers=model_cfg.num_layers - len(moe.dense_layers),
                   expert_parallel=n_ep, experts_per_device=moe.num_experts // n_ep, total_params=total,
                   active_params=active, tokens_per_device=per_device,
                   capacity=capacity(per_device, moe.top_k) if n_ep > 1 else 0, all_to_all_bytes=buffers)
