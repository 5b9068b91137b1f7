"""Builds the pieces of a run from its config: tokenizer, policy, task splits and reward.

Each builder is a plain function of the config so notebooks can call them one by one.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from rljax import envs, rewards
from rljax.data.example import Example
from rljax.data.sources import load_task
from rljax.data.splits import drop_overlap, heldout_split
from rljax.data.templates import PromptFormat
from rljax.errors import ConfigError
from rljax.lora import LoraConfig, adapter_shapes, load_peft
from rljax.models import ModelConfig, init_params, load_hf, read_hf_config
from rljax.sharding import Layout
from rljax.tokenizers import CharTokenizer, Tokenizer
from rljax.tokenizers import load as load_tokenizer
from rljax.train.config import DataSection, EnvSection, MeshSection, ModelSection, RewardSection, TrainConfig

CHARS_PREFIX = "chars:"


def build_tokenizer(section: ModelSection) -> Tokenizer:
    name = section.tokenizer or section.checkpoint
    if name.startswith(CHARS_PREFIX):
        return CharTokenizer(name[len(CHARS_PREFIX):])
    return load_tokenizer(name)


def policy_config(section: ModelSection, tokenizer: Tokenizer) -> ModelConfig:
    """The policy's ModelConfig without allocating: the checkpoint's config.json with the section's
    dtypes, or a Qwen2-style model sized by the section for random init."""
    if section.checkpoint:
        return read_hf_config(section.checkpoint, param_dtype=section.param_dtype,
                              compute_dtype=section.compute_dtype)
    return ModelConfig(
        model_type="qwen2", vocab_size=tokenizer.vocab_size, hidden_size=section.hidden_size,
        intermediate_size=section.intermediate_size, num_layers=section.num_layers,
        num_heads=section.num_heads, num_kv_heads=section.num_kv_heads, head_dim=section.head_dim,
        qkv_bias=True, tie_embeddings=True, max_positions=section.max_positions,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_ids[0] if tokenizer.eos_ids else None,
        pad_token_id=tokenizer.pad_id, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype)


def build_policy(section: ModelSection, tokenizer: Tokenizer, key: jax.Array,
                 layout: Layout | None = None) -> tuple[ModelConfig, Any]:
    """Loads the HF checkpoint, or random-inits a Qwen2-style model sized by the section.

    With the trainer `layout` the params are born sharded in it (`load_hf` streams each tensor
    into its shards, `init_params` draws each device's shards), so no device holds a whole
    weight; without one they land on the default device."""
    cfg = policy_config(section, tokenizer)
    shardings = layout.params(jax.eval_shape(lambda: init_params(cfg, key))) if layout is not None else None
    if section.checkpoint:
        return load_hf(section.checkpoint, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                       shardings=shardings)
    return cfg, init_params(cfg, key, shardings=shardings)


def build_lora(section: LoraConfig, cfg: ModelConfig) -> tuple[LoraConfig | None, Any]:
    """(LoRA config, starting adapters): (None, None) without LoRA; fresh adapters are made with
    the train state (None here); `lora.adapter` loads a PEFT adapter to continue, whose
    adapter_config.json sets rank, alpha, dropout, rsLoRA and targets."""
    if not section.enabled:
        return None, None
    if section.adapter is None:
        adapter_shapes(cfg, section)  # a target this model lacks is a ConfigError before anything is built
        return section, None
    return load_peft(section.adapter, cfg, defaults=section)


def build_layouts(section: MeshSection):
    """(trainer layout, sampler layout) over the configured devices.

    The trainer layout is None on one device (nothing to shard); the sampler layout is None when
    the sampler shares the trainer's (`mesh.sampler = "shared"`) or there is nothing to shard.
    A multi-process run must use every device of every process.
    """
    from rljax.sharding import MeshConfig, make_mesh, sampler_layout, trainer_layout

    devices = jax.devices()[:section.devices] if section.devices else jax.devices()
    if jax.process_count() > 1 and len(devices) != jax.device_count():
        raise ConfigError(f"mesh.devices={section.devices}: a {jax.process_count()}-process run must use all "
                          f"{jax.device_count()} devices; set mesh.devices=0")
    if len(devices) == 1:
        return None, None
    mesh = make_mesh(MeshConfig(data=section.data, fsdp=section.fsdp, tensor=section.tensor), devices)
    if section.sampler == "shared":
        return trainer_layout(mesh), None
    tensor = section.sampler_tensor or mesh.shape["tensor"]
    sampler_mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=tensor), devices)
    return trainer_layout(mesh), sampler_layout(sampler_mesh)


def build_splits(section: DataSection) -> tuple[tuple[Example, ...], tuple[Example, ...], int]:
    """(train, held-out eval, skipped rows). Eval questions never appear in train."""
    if section.source == "reasoning_gym":
        src = load_task("reasoning_gym", name=section.task, size=section.size + section.eval_size,
                        seed=section.seed, **section.task_kwargs)
    elif section.source in ("jsonl", "parquet"):
        src = load_task(section.source, path=section.path, fields=section.fields)
    else:
        src = load_task("tfds", name=section.tfds_name, data_dir=section.tfds_data_dir,
                        split=section.tfds_split, fields=section.fields)
    if section.eval_path:
        held = load_task("jsonl", path=section.eval_path, fields=section.fields).examples[:section.eval_size]
        train, _ = drop_overlap(src.examples, held)
    else:
        train, held = heldout_split(src.examples, section.eval_size, seed=section.seed)
    return train, held, src.num_skipped


def prompt_format(section: DataSection) -> PromptFormat:
    return PromptFormat(template=section.prompt_template, chat=section.chat, system=section.system_prompt)


def build_reward(section: RewardSection) -> rewards.RewardFn:
    """`correct` (by kind) plus an optional weighted format term; parts are reported by name."""
    limit = None if section.inline else section.time_limit_s
    correct = {
        "reasoning_gym": lambda: rewards.ReasoningGymAnswer(methods=section.answer_methods, time_limit_s=limit),
        "math": lambda: rewards.MathAnswer(methods=section.answer_methods, time_limit_s=limit),
        "code": lambda: rewards.CodeTests(),
    }[section.kind]()
    terms: dict[str, Any] = {"correct": (1.0, correct)}
    if section.format_weight:
        terms["format"] = (section.format_weight, rewards.RegexFormat(section.format_pattern))
    return rewards.compose(**terms)


def build_env(section: EnvSection) -> envs.Environment:
    """The `[env]` section's environment (`rljax.envs.make_env`): its format and turn limit, plus
    the section's `options` for the factory."""
    return envs.make_env(section.name, format=section.format, max_turns=section.max_turns, **section.options)


def lora_summary(lora: LoraConfig, cfg: ModelConfig, params: Any) -> str:
    """One line: rank, scale, targets and the adapters' share of the model's parameters."""
    trained = sum(math.prod(a) + math.prod(b) for a, b in adapter_shapes(cfg, lora).values())
    total = sum(x.size for x in jax.tree.leaves(params))
    return (f"LoRA rank {lora.rank} (scale {lora.scale:g}) on {', '.join(adapter_shapes(cfg, lora))}: "
            f"{trained / 1e6:.3f}M trained params ({100 * trained / total:.1f}% of the model), the base frozen")


def run_summary(cfg: TrainConfig, model_cfg: ModelConfig, params: Any, train: tuple, held: tuple) -> str:
    n = sum(x.size for x in jax.tree.leaves(params))
    return (f"model {model_cfg.model_type} {n / 1e6:.2f}M params | train {len(train)} / held-out {len(held)} "
            f"problems | {cfg.algorithm.algorithm}: {cfg.rl.iterations} iterations x "
            f"{cfg.rl.prompts_per_iteration} prompts x {cfg.sampling.num_samples} samples")
