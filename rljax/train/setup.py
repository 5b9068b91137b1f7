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
from rljax.errors import ConfigError, RljaxError
from rljax.lora import LoraConfig, adapter_shapes, load_peft
from rljax.models import ModelConfig, init_params, is_gguf, load_gguf, load_hf, read_gguf_config, read_hf_config
from rljax.models import resolve_checkpoint
from rljax.models.attention import describe_attention
from rljax.sharding import Layout
from rljax.tokenizers import Tokenizer
from rljax.tokenizers import load as load_tokenizer
from rljax.models.auxiliary import FrozenModel, check_vocabulary
from rljax.models.heads import read_head
from rljax.models.hf_io import has_head_bias, head_shapes
from rljax.rewards.judge import JudgeSpec, split_template
from rljax.rewards.learned import LearnedReward
from rljax.train.config import (DataSection, EnvSection, MeshSection, ModelSection, RewardModelSection,
                                RewardSection, SourceSection, TeacherSection, TrainConfig)


def build_tokenizer(section: ModelSection) -> Tokenizer:
    """`model.tokenizer` (a path, a built-in name or `chars:<alphabet>`), else the checkpoint's."""
    return load_tokenizer(resolve_checkpoint(section.tokenizer or section.checkpoint))


def policy_config(section: ModelSection, tokenizer: Tokenizer) -> ModelConfig:
    """The policy's ModelConfig without allocating: the checkpoint's config.json with the section's
    dtypes, or a Qwen2-style model sized by the section for random init."""
    if section.checkpoint:
        path = resolve_checkpoint(section.checkpoint)
        read = read_gguf_config if is_gguf(path) else read_hf_config
        return read(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                    attention=section.attention, decode_attention=section.decode_attention)
    return ModelConfig(
        model_type="qwen2", vocab_size=tokenizer.vocab_size, hidden_size=section.hidden_size,
        intermediate_size=section.intermediate_size, num_layers=section.num_layers,
        num_heads=section.num_heads, num_kv_heads=section.num_kv_heads, head_dim=section.head_dim,
        qkv_bias=True, tie_embeddings=True, max_positions=section.max_positions,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_ids[0] if tokenizer.eos_ids else None,
        pad_token_id=tokenizer.pad_id, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
        attention=section.attention, decode_attention=section.decode_attention)


def build_policy(section: ModelSection, tokenizer: Tokenizer, key: jax.Array,
                 layout: Layout | None = None) -> tuple[ModelConfig, Any]:
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
        return load(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                    shardings=shardings, attention=section.attention, decode_attention=section.decode_attention)
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
                  layout: Layout | None = None) -> FrozenModel:
    """The distillation teacher, born sharded in the trainer's `layout` like the policy (each
    tensor streamed into its shards). Its vocabulary must be the policy's, and a tokenizer shipped
    with it must be the policy's tokenizer: one line otherwise (re-tokenisation is not supported)."""
    cfg = teacher_config(section, policy)
    path = resolve_checkpoint(section.checkpoint)
    _check_tokenizer(path, tokenizer, f"teacher.checkpoint={section.checkpoint!r}")
    shardings = layout.params(jax.eval_shape(lambda: init_params(cfg, key))) if layout is not None else None
    load = load_gguf if is_gguf(path) else load_hf
    cfg, params = load(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                       shardings=shardings)
    return FrozenModel(cfg, params)


def reward_model_config(section: RewardModelSection, policy: ModelConfig) -> tuple[ModelConfig, int]:
    """(config, num_labels) of the reward model without allocating: a Bradley-Terry model is a
    sequence classifier with one label, a PRM a token classifier with two; its vocabulary is the
    policy's."""
    path = resolve_checkpoint(section.checkpoint)
    if section.kind == "judge":  # a causal LM
        read = read_gguf_config if is_gguf(path) else read_hf_config
        cfg = read(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype)
        check_vocabulary(policy, cfg, "reward model")
        return cfg, None
    kind, labels = read_head(path)
    want = {"bt": ("sequence", 1, "*ForSequenceClassification with num_labels=1 (rljax train-rm writes one)"),
            "prm": ("token", 2, "*ForTokenClassification with num_labels=2 (TRL's PRMTrainer format)")}[section.kind]
    if (kind, labels) != want[:2]:
        raise ConfigError(f"reward.model.checkpoint={section.checkpoint!r} is a {kind}-classification model with "
                          f"{labels} labels; reward.model.kind={section.kind!r} needs a {want[2]}")
    cfg = read_hf_config(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype)
    check_vocabulary(policy, cfg, "reward model")
    return cfg, labels


def build_reward_model(section: RewardModelSection, policy: ModelConfig, tokenizer: Tokenizer,
                       layout: Layout | None = None) -> LearnedReward:
    """The learned reward, its model born in the trainer's `layout` like the policy; a tokenizer
    shipped with it must be the policy's (one line otherwise)."""
    cfg, labels = reward_model_config(section, policy)
    path = resolve_checkpoint(section.checkpoint)
    _check_tokenizer(path, tokenizer, f"reward.model.checkpoint={section.checkpoint!r}")
    if section.kind == "judge":
        load = load_gguf if is_gguf(path) else load_hf
        shardings = layout.params(head_shapes(cfg, None)) if layout is not None else None
        cfg, params = load(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                           shardings=shardings)
        return LearnedReward.create(FrozenModel(cfg, params), weight=section.weight, normalize=section.normalize,
                                    kind="judge", judge=judge_spec(section, tokenizer))
    step_token = None
    if section.kind == "prm":
        ids = tokenizer.encode(section.step_separator)
        if len(ids) != 1:
            raise ConfigError(f"reward.model.step_separator={section.step_separator!r} is {len(ids)} tokens in the "
                              "policy's tokenizer; a step must end with one token: pick a separator that is one")
        step_token = ids[0]
    shardings = layout.params(head_shapes(cfg, labels, has_head_bias(path))) if layout is not None else None
    cfg, params = load_hf(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                          shardings=shardings, num_labels=labels)
    return LearnedReward.create(FrozenModel(cfg, params), weight=section.weight, normalize=section.normalize,
                                kind=section.kind, step_token=step_token, step_aggregation=section.step_aggregation,
                                step_discount=section.step_discount, credit=section.credit)


def judge_spec(section: RewardModelSection, tokenizer: Tokenizer) -> JudgeSpec:
    """The judge's template and verdicts as the policy tokenizer's ids (BOS first when it has one)."""
    try:
        prefix, middle, suffix = split_template(section.template)
    except ValueError as err:
        raise ConfigError(f"reward.model.template={section.template!r}: {err}") from None
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    verdicts = tuple((tuple(tokenizer.encode(text)), float(score)) for text, score in section.verdicts.items())
    if not verdicts or any(not ids for ids, _ in verdicts):
        raise ConfigError("reward.model.verdicts maps each verdict's text to its score, e.g. {Yes = 1.0, No = 0.0}")
    return JudgeSpec(prefix=tuple(bos + tokenizer.encode(prefix)), middle=tuple(tokenizer.encode(middle)),
                     suffix=tuple(tokenizer.encode(suffix)), verdicts=verdicts, default=float(section.default_score),
                     max_tokens=section.max_verdict_tokens, eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id)


def _check_tokenizer(path, tokenizer: Tokenizer, what: str) -> None:
    """An auxiliary model's own tokenizer (when it ships one) must be the policy's."""
    try:
        own = load_tokenizer(path)
    except RljaxError:  # no tokenizer files beside it: the vocabulary check stands
        return
    if not _same_tokenizer(own, tokenizer):
        raise ConfigError(f"{what} ships a tokenizer other than the policy's; it reads the policy's token ids, so it "
                          "must use the policy's tokenizer (re-tokenisation is not supported)")


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

    With `mesh.sampler_devices` the two meshes are disjoint (`rljax.sharding.split_devices`): the
    trainer's axes over the first devices, the sampler's data=-1 x tensor over the last ones,
    each a layout even on one device (the overlapped modes place arrays on either side).
    """
    from rljax.sharding import MeshConfig, make_mesh, sampler_layout, split_devices, trainer_layout

    devices = jax.devices()[:section.devices] if section.devices else jax.devices()
    if jax.process_count() > 1 and len(devices) != jax.device_count():
        raise ConfigError(f"mesh.devices={section.devices}: a {jax.process_count()}-process run must use all "
                          f"{jax.device_count()} devices; set mesh.devices=0")
    if section.sampler_devices:
        if jax.process_count() > 1:
            raise ConfigError("mesh.sampler_devices runs in one process for now (no cross-host weight transport); "
                              "set mesh.sampler_devices=0")
        trainer_devices, sampler_devices = split_devices(devices, section.sampler_devices)
        mesh = make_mesh(MeshConfig(data=section.data, fsdp=section.fsdp, tensor=section.tensor), trainer_devices)
        sampler_mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=section.sampler_tensor or 1), sampler_devices)
        return trainer_layout(mesh), sampler_layout(sampler_mesh)
    if len(devices) == 1:
        return None, None
    mesh = make_mesh(MeshConfig(data=section.data, fsdp=section.fsdp, tensor=section.tensor), devices)
    if section.sampler == "shared":
        return trainer_layout(mesh), None
    tensor = section.sampler_tensor or mesh.shape["tensor"]
    sampler_mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=tensor), devices)
    return trainer_layout(mesh), sampler_layout(sampler_mesh)


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
    return (SourceSection(kind=section.source, task=section.task, task_kwargs=section.task_kwargs, path=section.path,
                          fields=section.fields, size=section.size, eval_size=section.eval_size,
                          prompt_template=section.prompt_template),)


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


def _correct_verifier(kind: str, section: RewardSection):
    limit = None if section.inline else section.time_limit_s
    return {
        "reasoning_gym": lambda: rewards.ReasoningGymAnswer(methods=section.answer_methods, time_limit_s=limit),
        "math": lambda: rewards.MathAnswer(methods=section.answer_methods, time_limit_s=limit),
        "code": lambda: rewards.CodeTests(),
    }[kind]()


def build_reward(section: RewardSection, sources: tuple[SourceSection, ...] = ()) -> rewards.RewardFn:
    """`correct` (by kind) plus an optional weighted format term; parts are reported by name.

    With mixture `sources`, `correct` routes each row to its source's verifier (`verifier`, else
    the reward's kind) by the task name its example carries (`rljax.rewards.RoutedVerifier`)."""
    if sources:
        correct = rewards.RoutedVerifier({s.label: _correct_verifier(s.verifier or section.kind, section)
                                          for s in sources})
    else:
        correct = _correct_verifier(section.kind, section)
    terms: dict[str, Any] = {"correct": (section.correct_weight, correct)}
    if section.format_weight:
        terms["format"] = (section.format_weight, rewards.RegexFormat(section.format_pattern))
    return rewards.compose(**terms)


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
            f"{cfg.rl.prompts_per_iteration} prompts x {cfg.sampling.num_samples} samples | "
            f"{describe_attention(model_cfg)}")
