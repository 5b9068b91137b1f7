"""The `[model]` and `[teacher]` sections and what they build: tokenizer, policy, teacher.

`policy_config` / `teacher_config` read a checkpoint's config without allocating (what `rljax
plan` sizes); `build_policy` / `build_teacher` load it, born sharded in a trainer layout when one
is given (a `rljax.sharding.Layout`: each tensor streamed into its shards).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax

from rljax.config_io import bounded
from rljax.errors import ConfigError, RljaxError
from rljax.models.auxiliary import FrozenModel, check_vocabulary
from rljax.models.config import ModelConfig
from rljax.models.gguf import is_gguf, load_gguf, read_gguf_config
from rljax.models.hf_io import load_hf, read_hf_config
from rljax.models.moe_config import MoEConfig
from rljax.models.packaged import resolve_checkpoint
from rljax.models.transformer import init_params
from rljax.models.vl_setup import VisionSection
from rljax.storage import copy_locally_hint, is_remote
from rljax.tokenizers import Tokenizer
from rljax.tokenizers import load as load_tokenizer


def check_local(key: str, value: str | None) -> None:
    """A model is read from a local path: a bucket URI is one line naming the copy to make."""
    if value is not None and is_remote(value):
        raise ConfigError(f"{key}={value!r}: a model is read from a local directory; copy it first "
                          f"({copy_locally_hint(value)}) and set {key} to the copy")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Where the policy comes from: a HF checkpoint directory, or a from-scratch architecture.

    `tokenizer`: a path/name for `rljax.tokenizers.load` (default: the checkpoint directory), or
    `chars:<alphabet>` for a character tokenizer (tiny from-scratch jobs). `attention` picks the
    full-sequence attention (training, scoring, prefill) and `decode_attention` the decode steps'
    ("auto": the backend's fused kernel where it serves the model; docs/api/models.md).
    A from-scratch model with `num_experts` > 0 is Qwen3-MoE-shaped: every layer's MLP routes
    each token to `num_experts_per_tok` experts of width `moe_intermediate_size` (default
    `intermediate_size`), with q/k norms and renormalised top-k gates. `moe_impl` picks how an MoE
    model's experts run, checkpoint or not (docs/moe.md).
    """

    checkpoint: str | None = None
    tokenizer: str | None = None
    hidden_size: int = bounded(128, ge=1)
    intermediate_size: int = bounded(256, ge=1)
    num_layers: int = bounded(3, ge=1)
    num_heads: int = bounded(4, ge=1)
    num_kv_heads: int = bounded(2, ge=1)
    head_dim: int = bounded(32, ge=1)
    max_positions: int = bounded(256, ge=1)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    decode_attention: Literal["auto", "xla", "pallas"] = "auto"
    num_experts: int = bounded(0, ge=0)
    num_experts_per_tok: int = bounded(2, ge=1)
    moe_intermediate_size: int | None = bounded(None, ge=1)
    moe_impl: Literal["auto", "grouped", "dense"] = "auto"
    vision: VisionSection = VisionSection()  # [model.vision]: a from-scratch tower (depth 0: none)
    train_vision: bool = True  # False: the tower gets no update (right for a pretrained one only)

    def __post_init__(self):
        if self.checkpoint is None and self.tokenizer is None:
            raise ConfigError("model: set model.checkpoint (a HF directory) or model.tokenizer "
                              "(e.g. 'chars:0123456789+-= ') for a from-scratch model")
        for name in ("checkpoint", "tokenizer"):
            check_local(f"model.{name}", getattr(self, name))


@dataclasses.dataclass(frozen=True)
class TeacherSection:
    """A frozen distillation teacher (`algorithm.distill`; `rljax.objectives.distill`): a HF
    directory, a GGUF file or a packaged model's name, of any supported family and size that
    shares the policy's vocabulary and tokenizer (a tokenizer in its directory is compared with
    the policy's). It is held in the trainer's layout beside the policy, in `param_dtype`, and
    scores in `compute_dtype`."""

    checkpoint: str | None = None
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self):
        check_local("teacher.checkpoint", self.checkpoint)


def build_tokenizer(section: ModelSection) -> Tokenizer:
    """`model.tokenizer` (a path, a built-in name or `chars:<alphabet>`), else the checkpoint's."""
    return load_tokenizer(resolve_checkpoint(section.tokenizer or section.checkpoint))


def policy_config(section: ModelSection, tokenizer: Tokenizer) -> ModelConfig:
    """The policy's ModelConfig without allocating: the checkpoint's config.json with the section's
    dtypes, or a Qwen2-style model sized by the section for random init."""
    if section.checkpoint:
        path = resolve_checkpoint(section.checkpoint)
        read = read_gguf_config if is_gguf(path) else read_hf_config
        return with_moe_impl(read(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                                  attention=section.attention, decode_attention=section.decode_attention), section)
    if section.num_experts:
        moe = MoEConfig(num_experts=section.num_experts, top_k=section.num_experts_per_tok, norm_topk_prob=True,
                        expert_size=section.moe_intermediate_size or section.intermediate_size, impl=section.moe_impl)
        return dataclasses.replace(_scratch_config(section, tokenizer), model_type="qwen3_moe", moe=moe,
                                   qkv_bias=False, qk_norm=True)
    return _scratch_config(section, tokenizer)


def with_moe_impl(cfg: ModelConfig, section: ModelSection) -> ModelConfig:
    """`cfg` with the section's `moe_impl` (an MoE model's; a dense model is unchanged)."""
    return cfg if cfg.moe is None else cfg.replace(moe=cfg.moe.replace(impl=section.moe_impl))


def _scratch_config(section: ModelSection, tokenizer: Tokenizer) -> ModelConfig:
    return ModelConfig(
        model_type="qwen2", vocab_size=tokenizer.vocab_size, hidden_size=section.hidden_size,
        intermediate_size=section.intermediate_size, num_layers=section.num_layers,
        num_heads=section.num_heads, num_kv_heads=section.num_kv_heads, head_dim=section.head_dim,
        qkv_bias=True, tie_embeddings=True, max_positions=section.max_positions,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_ids[0] if tokenizer.eos_ids else None,
        pad_token_id=tokenizer.pad_id, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
        attention=section.attention, decode_attention=section.decode_attention)


def build_policy(section: ModelSection, tokenizer: Tokenizer, key: jax.Array,
                 layout=None) -> tuple[ModelConfig, Any]:
    """Loads the checkpoint (a HF directory, a GGUF file or a packaged model's name:
    `rljax.models.resolve_checkpoint`), or random-inits a Qwen2-style model sized by the section.

    With the trainer `layout` the params are born sharded in it (`load_hf` streams each tensor
    into its shards, `init_params` draws each device's shards), so no device holds a whole
    weight; without one they land on the default device."""
    cfg = policy_config(section, tokenizer)
    shardings = layout.params(jax.eval_shape(lambda: init_params(cfg, key))) if layout is not None else None
    if section.checkpoint:
        path = resolve_checkpoint(section.checkpoint)
        load = load_gguf if is_gguf(path) else load_hf
        loaded, params = load(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                              shardings=shardings, attention=section.attention, decode_attention=section.decode_attention)
        return with_moe_impl(loaded, section), params
    return cfg, init_params(cfg, key, shardings=shardings)


def teacher_config(section: TeacherSection, policy: ModelConfig) -> ModelConfig:
    """The teacher's ModelConfig without allocating (its config.json or GGUF header), checked to
    share the policy's vocabulary."""
    path = resolve_checkpoint(section.checkpoint)
    read = read_gguf_config if is_gguf(path) else read_hf_config
    cfg = read(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype)
    check_vocabulary(policy, cfg, "teacher")
    return cfg


def _same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers map every id to the same text."""
    if a.vocab_size != b.vocab_size:
        return False
    ids = [[i] for i in range(a.vocab_size)]
    return a.decode_batch(ids, skip_special=False) == b.decode_batch(ids, skip_special=False)


def build_teacher(section: TeacherSection, policy: ModelConfig, tokenizer: Tokenizer, key: jax.Array,
                  layout=None) -> FrozenModel:
    """The distillation teacher, born sharded in the trainer's `layout` like the policy (each
    tensor streamed into its shards). Its vocabulary must be the policy's, and a tokenizer shipped
    with it must be the policy's tokenizer: one line otherwise (re-tokenisation is not supported)."""
    cfg = teacher_config(section, policy)
    path = resolve_checkpoint(section.checkpoint)
    check_tokenizer(path, tokenizer, f"teacher.checkpoint={section.checkpoint!r}")
    shardings = layout.params(jax.eval_shape(lambda: init_params(cfg, key))) if layout is not None else None
    load = load_gguf if is_gguf(path) else load_hf
    cfg, params = load(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                       shardings=shardings)
    return FrozenModel(cfg, params)


def check_tokenizer(path, tokenizer: Tokenizer, what: str) -> None:
    """An auxiliary model's own tokenizer (when it ships one) must be the policy's."""
    try:
        own = load_tokenizer(path)
    except RljaxError:  # no tokenizer files beside it: the vocabulary check stands
        return
    if not _same_tokenizer(own, tokenizer):
        raise ConfigError(f"{what} ships a tokenizer other than the policy's; it reads the policy's token ids, so it "
                          "must use the policy's tokenizer (re-tokenisation is not supported)")
