"""LoRA adapters as their own pytree beside the frozen params: init, attach, merge.

    adapters = init_adapters(cfg, lora, key)          # {"layers": {"q": {"lora_a", "lora_b"}, ...}, ...}
    policy   = attach(params, adapters, lora)         # params with LoraWeights: forward / token_logprobs as usual
    merged   = merge(params, adapters, lora)          # plain weights W + s A B (the sampler's copy)

The adapters mirror the params tree (`layers/q` -> `layers/q/lora_a`, `layers/q/lora_b`), so the
sharding rules, the optimiser and checkpoints treat them like any params tree, and nothing of the
base is copied: attaching only wraps references to the frozen arrays.

Initialisation is PEFT's (Hu et al., 2021): for a projection, A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))
(kaiming-uniform with a = sqrt(5), nn.Linear's default) and B = 0; for the embedding, A = 0 and
B ~ N(0, 1). Either way A B = 0, so a fresh adapter leaves the model's function unchanged and the
first RL step starts from the base policy. Adapters are f32 whatever the base's dtype: the base
may be stored in bf16 while the trained weights and their optimiser moments keep f32 precision.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from rljax.lora.config import TARGETS, LoraConfig, Target, resolve_targets
from rljax.lora.weight import LoraWeight
from rljax.models.config import ModelConfig
from rljax.models.transformer import Params, init_params

Adapters = dict[str, Any]


def _get(tree, path: str):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _set(tree: dict, path: str, value) -> dict:
    """A copy of the nested dict `tree` with `path` set (untouched subtrees are shared)."""
    head, _, rest = path.partition("/")
    return {**tree, head: _set(tree.get(head, {}), rest, value) if rest else value}


def adapter_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """target name -> (A shape, B shape), stacked targets with their leading L (module docstring)."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    r = lora.rank
    out = {}
    for t in resolve_targets(lora, cfg):
        w = _get(shapes, t.path).shape
        if t.kind == "embedding":  # [V, D]: A [V, r], B [r, D]
            out[t.name] = ((w[0], r), (r, w[1]))
        elif t.kind == "head":  # [V, D] used as h @ W^T: A [D, r], B [r, V]
            out[t.name] = ((w[1], r), (r, w[0]))
        else:  # [L, in..., out...]
            lead, inner, outer = w[:1], w[1:1 + t.contract], w[1 + t.contract:]
            out[t.name] = ((*lead, *inner, r), (*lead, r, *outer))
    return out


def init_adapters(cfg: ModelConfig, lora: LoraConfig, key: jax.Array) -> Adapters:
    """Fresh f32 adapters for every target of `lora` on this model (PEFT's init: A B = 0)."""
    if lora.rank < 1:
        raise ValueError(f"init_adapters needs lora.rank >= 1, not {lora.rank}")
    adapters: Adapters = {}
    targets = {t.name: t for t in resolve_targets(lora, cfg)}
    for i, (name, (a_shape, b_shape)) in enumerate(adapter_shapes(cfg, lora).items()):
        k = jax.random.fold_in(key, i)
        if targets[name].kind == "embedding":
            a = jnp.zeros(a_shape, jnp.float32)
            b = jax.random.normal(k, b_shape, jnp.float32)
        else:
            stacked = targets[name].stacked
            fan_in = math.prod(a_shape[1 if stacked else 0:-1])
            bound = 1.0 / math.sqrt(fan_in)
            a = jax.random.uniform(k, a_shape, jnp.float32, -bound, bound)
            b = jnp.zeros(b_shape, jnp.float32)
        adapters = _set(adapters, targets[name].path, {"lora_a": a, "lora_b": b})
    return adapters


def targets_of(adapters: Adapters) -> tuple[Target, ...]:
    """The targets an adapters tree holds, in forward order."""
    def has(t: Target) -> bool:
        try:
            _get(adapters, t.path)
            return True
        except KeyError:
            return False

    return tuple(t for t in TARGETS if has(t))


def attach(params: Params, adapters: Adapters, lora: LoraConfig, *, dropout_key: jax.Array | None = None) -> Params:
    """`params` with every adapted weight replaced by a `LoraWeight` (W, A, B): the model then runs
    W + s A B without merging. `dropout_key` turns on the adapter branch's dropout (the trained
    forward only), one independent key per target and layer."""
    out = params
    use_dropout = dropout_key is not None and lora.dropout > 0.0
    for i, t in enumerate(targets_of(adapters)):
        w = _get(params, t.path)
        ab = _get(adapters, t.path)
        key = None
        if use_dropout and t.kind == "linear":  # PEFT's embedding LoRA has no dropout; the head is merged
            key = jax.random.split(jax.random.fold_in(dropout_key, i), w.shape[0])
        out = _set(out, t.path, LoraWeight(w, ab["lora_a"], ab["lora_b"], key, scale=lora.scale,
                                           dropout=lora.dropout, kind=t.kind))
    return out


def merge(params: Params, adapters: Adapters, lora: LoraConfig, *, keep_embedding: bool = True) -> Params:
    """Params with W + s A B in place of each adapted weight, in W's dtype: the same function as
    `attach` up to one rounding per weight, with no extra matmuls (what the sampler decodes with).

    An adapted input embedding stays attached (`keep_embedding`): in a tied model, merged, it would
    also move the tied LM head, which PEFT leaves at the base weight; its lookup branch costs one
    [r, D] matmul per token. `merged_model` unties such a model for export instead."""
    attached = attach(params, adapters, lora)
    out = attached
    for t in targets_of(adapters):
        if t.kind == "embedding" and keep_embedding:
            continue
        out = _set(out, t.path, _get(attached, t.path).merged())
    return out


def merged_model(cfg: ModelConfig, params: Params, adapters: Adapters, lora: LoraConfig
                 ) -> tuple[ModelConfig, Params]:
    """(config, plain params) of the adapted model, every adapter merged, for a HF export. A tied
    model whose embedding is adapted comes back untied, its LM head the base embedding, so the
    exported model computes what the adapted one does."""
    targets = {t.name for t in targets_of(adapters)}
    if cfg.tie_embeddings and "embed" in targets:
        cfg = cfg.replace(tie_embeddings=False)
        params = {**params, "lm_head": params["embed"]}
    return cfg, merge(params, adapters, lora, keep_embedding=False)


# ----------------------------------------------------------------------------- the critic


def init_value_adapters(cfg: ModelConfig, lora: LoraConfig, key: jax.Array) -> Params:
    """A LoRA critic's trainable part: its own adapters on the frozen base (the LM head, which a
    critic does not use, left out) plus a zero scalar head, so initial values are 0 as in
    `rljax.models.init_value_params`."""
    adapters = init_adapters(cfg, lora, key)
    adapters.pop("lm_head", None)
    return {"adapters": adapters, "value_head": jnp.zeros((cfg.hidden_size,), jnp.float32),
            "value_bias": jnp.zeros((), jnp.float32)}


def attach_value(params: Params, value_trainable: Params, lora: LoraConfig, *,
                 dropout_key: jax.Array | None = None) -> Params:
    """The critic's params for `rljax.models.values`: the frozen base with the critic's adapters
    attached, plus its head."""
    backbone = {k: v for k, v in params.items() if k != "lm_head"}
    return {**attach(backbone, value_trainable["adapters"], lora, dropout_key=dropout_key),
            "value_head": value_trainable["value_head"], "value_bias": value_trainable["value_bias"]}


def num_params(tree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))
