"""Builds the pieces of a run from its config: tokenizer, policy, task splits and reward.

Each builder is a plain function of the config so notebooks can call them one by one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from rljax import envs, rewards
from rljax.data.example import Example
from rljax.data.mixture import MixtureSource
from rljax.data.selection import make_policy
from rljax.data.sources import load_task, reasoning_gym_generator
from rljax.data.splits import drop_overlap, heldout_split
from rljax.data.templates import PromptFormat, render_prompt
from rljax.errors import ConfigError
from rljax.lora import LoraConfig, adapter_shapes
from rljax.models import ModelConfig
from rljax.models.attention import describe_attention
from rljax.data.config import DataSection, SourceSection
from rljax.envs.config import EnvConfig
from rljax.rewards.config import build_reward
from rljax.train.config import TrainConfig


def interleave(pools) -> tuple:
    """Round-robin over the pools (a, b, a, b, ...), so any prefix mixes every source."""
    out, pools = [], [list(p) for p in pools]
    for i in range(max((len(p) for p in pools), default=0)):
        out.extend(p[i] for p in pools if i < len(p))
    return tuple(out)


def build_splits(section: DataSection) -> tuple[tuple[Example, ...], tuple[Example, ...], int]:
    """(train, held-out eval, skipped rows). Eval questions never appear in train. A mixture's
    train set interleaves its sources' pools and its held-out set joins their splits."""
    if section.sources:
        sources = build_sources(section)
        return interleave(s.train for s in sources), tuple(e for s in sources for e in s.held_out), 0
    one = section.single
    if one.kind == "visual":  # generated pictures (`rljax.data.visual_tasks`): held out by drawing
        from rljax.train.vision_setup import visual_splits

        return visual_splits(one)
    if one.kind == "reasoning_gym":
        src = load_task("reasoning_gym", name=one.task, size=one.size + one.eval_size, seed=section.seed,
                        **one.task_kwargs)
    elif one.kind in ("jsonl", "parquet"):
        src = load_task(one.kind, path=one.path, fields=one.fields)
    else:
        src = load_task("tfds", name=one.tfds_name, data_dir=one.tfds_data_dir, split=one.tfds_split,
                        fields=one.fields)
    if one.eval_path:
        held = load_task("jsonl", path=one.eval_path, fields=one.fields).examples[:one.eval_size]
        train, _ = drop_overlap(src.examples, held)
    else:
        train, held = heldout_split(src.examples, one.eval_size, seed=section.seed)
    return train, held, src.num_skipped


def prompt_format(section: DataSection) -> PromptFormat:
    """The prompt format; a mixture bakes each source's template into its questions
    (`build_sources`), so its format is the bare question (plus the chat wrapping)."""
    template = "{question}" if section.is_mixture else section.prompt_template
    return PromptFormat(template=template, chat=section.chat, system=section.system_prompt)


# Sources of a mixture draw from disjoint generator seed ranges: source j's pool is seeded
# data.seed + j * SOURCE_SEED_STRIDE (reasoning-gym item i uses Random(seed + i)).
SOURCE_SEED_STRIDE = 1_000_000


def mixture_sections(section: DataSection) -> tuple[SourceSection, ...]:
    """The mixture's sources: `[[data.sources]]`, or the single-source keys as a mixture of one."""
    if section.sources:
        return section.sources
    if section.source not in ("reasoning_gym", "jsonl", "parquet"):
        raise ConfigError(f"data.source={section.source!r} cannot be a mixture source; list it under "
                          "[[data.sources]] as reasoning_gym, jsonl or parquet")
    return (section.single,)


def build_sources(section: DataSection) -> tuple[MixtureSource, ...]:
    """Each source's training pool and held-out split (by question text, as `build_splits`),
    every example tagged with the source's name (its task). In a mixture (`is_mixture`) each
    source's template is baked into its questions, as `prompt_format` expects."""
    out = []
    for j, src in enumerate(mixture_sections(section)):
        seed = section.seed + j * SOURCE_SEED_STRIDE
        template = (src.prompt_template or section.prompt_template) if section.is_mixture else "{question}"
        fmt = PromptFormat(template=template)
        if src.kind == "reasoning_gym":
            pool = load_task("reasoning_gym", name=src.task, size=src.size + src.eval_size, seed=seed,
                             **src.task_kwargs).examples
        else:
            pool = load_task(src.kind, path=src.path, fields=src.fields).examples
        train, held = heldout_split(pool, src.eval_size, seed=seed)
        tag = lambda e, fmt=fmt, name=src.label: dataclasses.replace(  # noqa: E731
            e, question=e.question if e.messages is not None else render_prompt(e, fmt), task=name)
        generate = None
        if src.fresh:  # seeded right after the pool's range, so its items are new ones
            raw = reasoning_gym_generator(src.task, seed + src.size + src.eval_size, **src.task_kwargs)
            generate = lambda k, raw=raw, tag=tag: tag(raw(k))  # noqa: E731
        out.append(MixtureSource(name=src.label, train=tuple(map(tag, train)), held_out=tuple(map(tag, held)),
                                 level=src.level, weight=src.weight,
                                 family=src.task if src.kind == "reasoning_gym" else src.label, generate=generate,
                                 fresh_distinct=src.fresh_draws == "distinct"))
    return tuple(out)


def build_selection(section: DataSection, sources: tuple[MixtureSource, ...]):
    """The selection policy with `selection_options`; weights, levels and families default to the
    sources' own (a policy without such an option ignores them)."""
    from rljax.data.selection import POLICIES

    defaults = {"weights": tuple(s.weight for s in sources), "levels": tuple(s.level for s in sources),
                "families": tuple(s.family for s in sources)}
    known = {f.name for f in dataclasses.fields(POLICIES.get(section.selection))}
    options = {k: v for k, v in defaults.items() if k in known}
    if "weights" in options and len(set(options["weights"])) == 1:
        options["weights"] = None  # equal weights: the policy's own default
    return make_policy(section.selection, **{**options, **section.selection_options})


def run_reward(cfg: TrainConfig) -> rewards.RewardFn:
    """The run's reward: routed by task for a mixture, else the `[reward]` verifier."""
    return build_reward(cfg.reward, mixture_sections(cfg.data) if cfg.data.is_mixture else ())


def eval_split(cfg: TrainConfig, sources: tuple[MixtureSource, ...] | None = None) -> tuple[Example, ...]:
    """The held-out problems a run evaluates on: the first `eval.size` of its split, or of each
    source's split in a host-steered run (so every task is measured)."""
    if not cfg.host_batching:
        return build_splits(cfg.data)[1][:cfg.eval.size]
    sources = build_sources(cfg.data) if sources is None else sources
    return tuple(e for s in sources for e in s.held_out[:cfg.eval.size])


def build_env(section: EnvConfig) -> envs.Environment:
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
            f"{cfg.rl.prompts_per_iteration} prompts x {cfg.sampling.num_samples} samples | "
            f"{describe_attention(model_cfg)}")
