"""The LoRA config (the TOML `[lora]` section) and the weights it targets.

LoRA (Hu et al., 2021) trains a low-rank update of frozen weights: a projection W becomes
W + s A B with A [in, r], B [r, out] and s = alpha / r, or alpha / sqrt(r) with rsLoRA
(Kalajdzievski, 2023), which keeps the update's scale steady as the rank grows.

Targets are matched by name: each entry of `targets` is a regex that must match a weight's whole
name, ours (`q`, `k`, `v`, `o`, `gate`, `up`, `down`, `embed`, `lm_head`), its path in the params
tree (`layers/q`) or its Hugging Face module name (`q_proj`, `embed_tokens`), so a PEFT
`target_modules` list works as it is. A target matches every layer (adapters are stacked on the
layer axis like the weights they adapt).
"""

from __future__ import annotations

import dataclasses
import math
import re

from rljax.config_io import bounded
from rljax.errors import ConfigError
from rljax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Target:
    """One weight LoRA can adapt. `contract`: how many leading (input) axes of one layer's weight
    the forward contracts (`rljax.models.layers.project`); `kind`: `linear` (a projection),
    `embedding` (the input lookup) or `head` (the untied LM head, [V, D] used as h @ W^T)."""

    name: str
    path: str
    hf_module: str
    contract: int = 1
    kind: str = "linear"

    @property
    def stacked(self) -> bool:
        return self.path.startswith("layers/")


# In the order of a layer's forward pass; every family names its projections this way.
TARGETS: tuple[Target, ...] = (
    Target("embed", "embed", "model.embed_tokens", kind="embedding"),
    Target("q", "layers/q", "self_attn.q_proj"),
    Target("k", "layers/k", "self_attn.k_proj"),
    Target("v", "layers/v", "self_attn.v_proj"),
    Target("o", "layers/o", "self_attn.o_proj", contract=2),
    Target("gate", "layers/gate", "mlp.gate_proj"),
    Target("up", "layers/up", "mlp.up_proj"),
    Target("down", "layers/down", "mlp.down_proj"),
    # An MoE model's shared expert (Qwen2-MoE); its routed experts stay frozen (docs/moe.md).
    Target("shared_gate", "layers/shared_gate", "mlp.shared_expert.gate_proj"),
    Target("shared_up", "layers/shared_up", "mlp.shared_expert.up_proj"),
    Target("shared_down", "layers/shared_down", "mlp.shared_expert.down_proj"),
    Target("lm_head", "lm_head", "lm_head", kind="head"),
)
TARGETS_BY_NAME = {t.name: t for t in TARGETS}
ATTENTION_AND_MLP = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on a frozen base model; `rank = 0` turns LoRA off (full fine-tuning).

    `alpha` and `rslora` set the scale s (alpha / r, or alpha / sqrt(r)); `dropout` is applied to
    a projection's input on the adapter branch only, in the trained forward (PEFT's rule; the
    sampler, the reference and the old log-probs run without it). `targets`: regexes over weight
    names (module docstring); the default adapts every attention and MLP projection, PEFT's
    "all-linear". `adapter`: a PEFT adapter directory to start from instead of fresh adapters (its
    adapter_config.json then sets rank, alpha, rslora and targets). `merge_for_sampling`: the
    sampler decodes with W + s A B merged once per iteration instead of the two extra small
    matmuls per projection and token (same function, rounded once; see BENCHMARKS.md).
    """

    rank: int = bounded(0, ge=0)
    alpha: float = bounded(16.0, gt=0)
    dropout: float = bounded(0.0, ge=0, lt=1)
    targets: tuple[str, ...] = ATTENTION_AND_MLP
    rslora: bool = False
    adapter: str | None = None
    merge_for_sampling: bool = True

    def __post_init__(self):
        if self.rank < 0:
            raise ConfigError(f"lora.rank={self.rank} must be >= 0 (0: LoRA off)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if not self.targets:
            raise ConfigError("lora.targets is empty; name at least one weight, e.g. targets = [\"q\", \"v\"]")
        for pattern in self.targets:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"lora.targets entry {pattern!r} is not a regex ({err}); escape it") from None

    @property
    def enabled(self) -> bool:
        """LoRA is on: a rank, or a PEFT adapter to continue (whose config gives the rank)."""
        return self.rank > 0 or self.adapter is not None

    @property
    def scale(self) -> float:
        """s in W + s A B: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def replace(self, **changes) -> LoraConfig:
        return dataclasses.replace(self, **changes)


def model_targets(cfg: ModelConfig) -> tuple[Target, ...]:
    """The weights this model has: no `lm_head` when the embedding is tied; an MoE model has no
    dense MLP (its experts are not LoRA targets) and a shared expert only where its family does."""
    moe, shared = cfg.moe is not None, cfg.moe is not None and cfg.moe.shared_expert_size > 0
    has = {"lm_head": not cfg.tie_embeddings, "gate": not moe, "up": not moe, "down": not moe,
           "shared_gate": shared, "shared_up": shared, "shared_down": shared}
    return tuple(t for t in TARGETS if has.get(t.name, True))


def resolve_targets(lora: LoraConfig, cfg: ModelConfig) -> tuple[Target, ...]:
    """The targets `lora.targets` selects on this model, in forward order. A pattern that matches
    no weight of the model is a ConfigError naming the weights it has."""
    have = model_targets(cfg)
    chosen = set()
    for pattern in lora.targets:
        hits = {t.name for t in have if any(re.fullmatch(pattern, n) for n in (t.name, t.path, t.hf_module,
                                                                               t.hf_module.split(".")[-1]))}
        if not hits and cfg.moe is not None and pattern in ("gate", "up", "down"):
            continue  # the default targets on an MoE model: its experts stay frozen, as PEFT leaves them
        if not hits:
            tied = " (its embedding is tied: there is no lm_head; target embed)" if cfg.tie_embeddings else ""
            raise ConfigError(f"lora.targets entry {pattern!r} matches no weight of this model{tied}; choose from "
                              f"{', '.join(t.name for t in have)}")
        chosen |= hits
    return tuple(t for t in have if t.name in chosen)
