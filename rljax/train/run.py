"""The run's pieces, built once from its config: `build_run(cfg) -> Run`.

Tokenizer, policy (born sharded in the trainer layout; a vision-language one from
`rljax.train.vision_setup`, whose prompt batches carry their images), LoRA, frozen teacher and reward model,
the prompt source (the seeded single-source pipeline, or a mixture's host sampler), the reward,
the held-out evaluator, the metrics writer and the checkpointer. A driver
(`rljax.drivers.DRIVERS`) reads what it needs from `Run` by attribute.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from etils import epath

from rljax.checkpoint import Checkpointer
from rljax.data.example import Example
from rljax.data.templates import PromptFormat
from rljax.envs.base import Environment
from rljax.lora import LoraConfig
from rljax.models import ModelConfig
from rljax.models.auxiliary import FrozenModel
from rljax.models.moe import route_layers
from rljax.models.transformer import Params
from rljax.rewards import RewardFn
from rljax.rewards.learned import LearnedReward
from rljax.tokenizers import Tokenizer
from rljax.data.mixture import MixtureSampler
from rljax.data.pipeline import PromptData, prompt_batches
from rljax.data.prompt_images import ImagePrompter
from rljax.data.replay import ReplayBuffer
from rljax.errors import CheckpointError
from rljax.evaluation.runner import EvalSetup
from rljax.lora.setup import build_lora
from rljax.models.setup import build_policy, build_teacher, build_tokenizer
from rljax.plan.remat import choose_remat, needs_choice
from rljax.rewards.config import build_reward, build_reward_model
from rljax.sampling import SampleControls
from rljax.sharding import Layout, abstract_like
from rljax.sharding.placement import build_layouts, checkpoint_processes, data_processes
from rljax.storage import check_writable
from rljax.train.config import TrainConfig
from rljax.train.metrics_writer import MetricsWriter
from rljax.train.vision_setup import build_vision
from rljax.train.setup import (build_env, build_selection, build_sources, build_splits, eval_split, interleave,
                               lora_summary, prompt_format, run_reward, run_summary)
from rljax.update import TrainState, init_train_state
from rljax.update.abstract import abstract_train_state as abstract_state


@dataclasses.dataclass
class Run:
    """The pieces of a run, built once from its config (`build_run`)."""

    cfg: TrainConfig
    out: epath.Path  # output_dir: local or a URI (gs://...), never a collapsed pathlib.Path
    keys: dict[str, jax.Array]  # init, warm, loop
    trainer_layout: Layout | None
    sampler_layout: Layout | None
    tokenizer: Tokenizer
    model_cfg: ModelConfig
    params: Params  # the initial policy (before any warm start)
    lora: LoraConfig | None  # None: every weight trains
    adapters: dict | None  # LoRA adapters to start from (a PEFT adapter); None: fresh ones
    train_set: tuple[Example, ...]
    fmt: PromptFormat
    reward_fn: RewardFn
    data: PromptData | None  # the single-source pipeline (None when host-steered)
    sampler: MixtureSampler | None  # the host-steered run's mixture (None: the pipeline)
    replay: ReplayBuffer | None
    controls: SampleControls
    evaluator: EvalSetup
    writer: MetricsWriter
    ckpt: Checkpointer
    log: Callable[[str], None]
    env: Environment | None = None  # the `[env]` section's environment (multi-turn episodes)
    teacher: FrozenModel | None = None  # the frozen distillation teacher
    reward_model: LearnedReward | None = None  # the learned reward
    images: ImagePrompter | None = None  # the host step giving prompts their pictures (None: text prompts)

    @property
    def examples(self):
        """The table prompt indices point into (a mixture's grows with fresh questions)."""
        return self.data.examples if self.sampler is None else self.sampler.examples


def sample_controls(cfg: TrainConfig, tokenizer) -> SampleControls:
    """The run's sampling controls with the tokenizer's EOS and pad ids where the recipe sets none."""
    return cfg.sampling.with_tokenizer(tokenizer)


def build_run(cfg: TrainConfig, *, resume: bool, log=print) -> Run:
    """Tokenizer, policy, splits, reward, prompt pipeline, evaluator, metrics writer, checkpointer."""
    out = check_writable(cfg.output_dir)  # a missing bucket or permission stops here, with the fix
    if not resume and any((out / "checkpoints").glob("[0-9]*")):
        raise CheckpointError(f"{out} already holds checkpoints; pass --resume to continue that run, or set "
                              f"output_dir=... for a new one")
    # Layouts first: they unset an expert or context mesh an earlier run left as JAX's mesh, and an
    # array made under it (the keys) would carry that mesh into this run's programs.
    trainer_layout, sampler_layout = build_layouts(cfg.mesh)
    k_init, k_warm, k_loop = jax.random.split(jax.random.key(cfg.seed), 3)
    tokenizer = build_tokenizer(cfg.model)
    vision = build_vision(cfg, tokenizer, k_init, (trainer_layout, sampler_layout))  # None: a text policy
    if vision is None:
        model_cfg, params = build_policy(cfg.model, tokenizer, k_init, trainer_layout)  # born sharded
    else:  # the decoder's config; the tower's travels with each batch's images
        model_cfg, params, tokenizer = vision.cfg.text, vision.params, vision.tokenizer
    lora, adapters = build_lora(cfg.lora, model_cfg)
    if needs_choice(cfg):  # the fastest remat mode (and micro-batches) the memory plan fits (cached per configuration)
        choice = choose_remat(cfg, model_cfg, tokenizer=tokenizer)
        log(choice.line())
        cfg = choice.cfg
    teacher = (build_teacher(cfg.teacher, model_cfg, tokenizer, k_init, trainer_layout)
               if cfg.algorithm.needs.teacher_logp else None)
    reward_model = (build_reward_model(cfg.reward.model, model_cfg, tokenizer, trainer_layout)
                    if cfg.reward.model.enabled else None)
    fmt = prompt_format(cfg.data)
    data = sampler = replay = images = None
    if cfg.host_batching:
        sources = build_sources(cfg.data)
        train_set = interleave(s.train for s in sources)
        held_out = eval_split(cfg, sources)
        skipped = 0
        reward_fn = run_reward(cfg)
        sampler = MixtureSampler(sources, build_selection(cfg.data, sources), seed=cfg.data.seed,
                                 tokenizer=tokenizer, fmt=fmt, max_prompt_len=cfg.data.max_prompt_tokens,
                                 add_bos=cfg.data.add_bos, max_redraws=cfg.data.band_max_redraws)
        num_too_long = sampler.num_too_long
        if cfg.rl.replay.capacity:
            r = cfg.rl.replay
            replay = ReplayBuffer(capacity=r.capacity, row_len=cfg.data.max_prompt_tokens + cfg.sampling.max_new_tokens,
                                  per_prompt=r.per_prompt, max_pass_rate=r.max_pass_rate,
                                  routes_lk=route_layers(model_cfg) if cfg.algorithm.needs.routes else None)
    else:
        train_set, held_out, skipped = build_splits(cfg.data)
        reward_fn = build_reward(cfg.reward)
        images = None if vision is None else vision.prompter(cfg, train_set[:8] + held_out[:8])
        data = prompt_batches(train_set, tokenizer=tokenizer, batch_size=cfg.rl.num_prompts, seed=cfg.data.seed,
                              max_prompt_len=cfg.data.max_prompt_tokens, fmt=fmt,
                              buckets=cfg.data.prompt_buckets or None, add_bos=cfg.data.add_bos,
                              images=None if images is None else images.add_to, **data_processes(cfg.mesh))
        num_too_long = data.num_too_long
        held_out = held_out[:cfg.eval.size]
    controls = sample_controls(cfg, tokenizer)
    evaluator = EvalSetup.build(model_cfg, held_out, tokenizer, fmt, reward_fn, controls,
                                max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos, images=images)
    dropped = {"skipped rows": skipped, "training prompts over data.max_prompt_tokens (dropped)": num_too_long,
               "held-out prompts over data.max_prompt_tokens (dropped)": evaluator.num_too_long}
    log(run_summary(cfg, model_cfg, params, train_set, held_out)
        + "".join(f" | {what} {n}" for what, n in dropped.items() if n))
    if lora is not None:
        log(lora_summary(lora, model_cfg, params))
    if teacher is not None:
        log(f"teacher {teacher.cfg.model_type} {teacher.num_params / 1e6:.2f}M params, frozen "
            f"({cfg.algorithm.distill}, distill_coef {cfg.algorithm.distill_coef:g}, "
            f"reward_weight {cfg.algorithm.reward_weight:g})")
    if reward_model is not None:
        log(f"reward model {reward_model.model.cfg.model_type} {reward_model.model.num_params / 1e6:.2f}M params, "
            f"frozen (weight {reward_model.weight:g}, normalize {reward_model.normalize}; verifier correct_weight "
            f"{cfg.reward.correct_weight:g})")
    writer = MetricsWriter(out, tensorboard=cfg.metrics.tensorboard, wandb_project=cfg.metrics.wandb_project,
                           config=cfg.to_dict(), enabled=jax.process_index() == 0, resume=resume)
    ckpt = Checkpointer(out / "checkpoints", keep_last=cfg.checkpoint.keep_last,
                        best_metric=cfg.checkpoint.best_metric, processes=checkpoint_processes(cfg.mesh))
    env = build_env(cfg.env) if cfg.env.enabled else None
    return Run(cfg=cfg, out=out, keys={"init": k_init, "warm": k_warm, "loop": k_loop}, env=env, teacher=teacher, reward_model=reward_model,
               trainer_layout=trainer_layout, sampler_layout=sampler_layout, tokenizer=tokenizer,
               model_cfg=model_cfg, params=params, lora=lora, adapters=adapters, train_set=train_set, fmt=fmt,
               reward_fn=reward_fn, data=data, sampler=sampler, replay=replay,
               controls=controls, evaluator=evaluator, writer=writer, ckpt=ckpt, log=log, images=images)


def new_train_state(run: Run, params) -> TrainState:
    """A fresh state born in the trainer layout: reference, value model and optimiser state come
    out of one program with the layout's `out_shardings` (`init_train_state`), params as they are."""
    cfg = run.cfg
    return init_train_state(run.model_cfg, params, cfg.algorithm, cfg.optim, update_cfg=cfg.update,
                            shaping=cfg.shaping, layout=run.trainer_layout, lora=run.lora, adapters=run.adapters,
                            teacher=run.teacher, reward_model=run.reward_model)


def abstract_train_state(run: Run) -> TrainState:
    """The fresh state's shapes, dtypes and trainer-layout shardings, allocating nothing (the
    restore target, so orbax reads each process's shards straight into place; the drivers'
    programs are built from it): `rljax.update.abstract_train_state`, placed."""
    state = abstract_state(run.cfg, run.model_cfg, params=run.params, lora=run.lora, adapters=run.adapters,
                           teacher=run.teacher, reward_model=run.reward_model)
    return state if run.trainer_layout is None else abstract_like(state, run.trainer_layout.tree(state))
