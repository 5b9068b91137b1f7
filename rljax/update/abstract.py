"""The run's fresh train state as ShapeDtypeStructs, from its config alone: what `rljax plan`
sizes, what a resumed run restores into (placed in the trainer layout) and what a sampler host
shapes its programs with. One definition, so the plan and the run cannot disagree."""

from __future__ import annotations

import jax

from rljax.lora.setup import build_lora
from rljax.models import init_params
from rljax.models.auxiliary import FrozenModel
from rljax.models.hf_io import has_head_bias, head_shapes
from rljax.models.setup import build_tokenizer, teacher_config
from rljax.rewards.config import judge_spec, reward_model_config
from rljax.rewards.learned import LearnedReward
from rljax.update.step import TrainState, init_train_state


def abstract_train_state(cfg, model_cfg, *, params=None, lora=None, adapters=None, teacher=None,
                         reward_model=None) -> TrainState:
    """`cfg`'s (a `rljax.train.config.TrainConfig`) fresh train state as ShapeDtypeStructs
    (`init_train_state` traced, not run), from the run's own pieces when it has them (a built run:
    policy, LoRA, adapters, teacher, reward model, whose static fields the programs key on), else
    from the config alone (`abstract_pieces`: what `rljax plan` and a sampler host size)."""
    if params is None:
        params, lora, adapters, teacher, reward_model = abstract_pieces(cfg, model_cfg)
    shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    return jax.eval_shape(lambda p, a, t, r: init_train_state(model_cfg, p, cfg.algorithm, cfg.optim,
                                                              update_cfg=cfg.update, shaping=cfg.shaping, lora=lora,
                                                              adapters=a, teacher=t, reward_model=r),
                          shapes(params), shapes(adapters), teacher, reward_model)


def abstract_pieces(cfg, model_cfg):
    """(params, lora, adapters, teacher, reward model) as ShapeDtypeStructs from the config: the
    checkpoints' configs are read, never their weights (`lora.adapter`'s files give its rank and
    targets)."""
    lora, adapters = build_lora(cfg.lora, model_cfg)
    teacher_cfg = teacher_config(cfg.teacher, model_cfg) if cfg.algorithm.needs.teacher_logp else None
    rm_cfg = reward_model_config(cfg.reward.model, model_cfg) if cfg.reward.model.enabled else None
    judge = (judge_spec(cfg.reward.model, build_tokenizer(cfg.model))
             if rm_cfg is not None and cfg.reward.model.kind == "judge" else None)

    def init():
        params = init_params(model_cfg, jax.random.key(0))
        teacher = None if teacher_cfg is None else FrozenModel(teacher_cfg, init_params(teacher_cfg, jax.random.key(1)))
        reward_model = None
        if rm_cfg is not None:
            bias = cfg.reward.model.kind == "prm" and has_head_bias(cfg.reward.model.checkpoint)
            rm_params = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), head_shapes(*rm_cfg, bias))
            rm = cfg.reward.model
            reward_model = LearnedReward.create(FrozenModel(rm_cfg[0], rm_params), weight=rm.weight,
                                                normalize=rm.normalize, kind=rm.kind, step_token=0,
                                                step_aggregation=rm.step_aggregation, step_discount=rm.step_discount,
                                                credit=rm.credit, judge=judge)
        return params, teacher, reward_model

    params, teacher, reward_model = jax.eval_shape(init)
    return params, lora, adapters, teacher, reward_model
