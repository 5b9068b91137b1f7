"""The optimiser: AdamW (Loshchilov & Hutter, 2019) after global-norm gradient clipping, on a
linear-warmup then constant or cosine (Loshchilov & Hutter, SGDR 2017) learning-rate schedule."""

from __future__ import annotations

import dataclasses

import optax

from rljax.config_io import bounded
from rljax.errors import ConfigError


def _constant(cfg: OptimConfig):
    warm = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
    return optax.join_schedules([warm, optax.constant_schedule(cfg.learning_rate)], [cfg.warmup_steps]) \
        if cfg.warmup_steps else optax.constant_schedule(cfg.learning_rate)


def _cosine(cfg: OptimConfig):
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if cfg.warmup_steps else cfg.learning_rate, peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps, decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.final_lr_ratio)


SCHEDULES = {"constant": _constant, "cosine": _cosine}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW hyper-parameters; `total_steps` counts optimiser updates (cosine decay length)."""

    learning_rate: float = bounded(1e-6, ge=0)
    schedule: str = "constant"
    warmup_steps: int = bounded(0, ge=0)
    total_steps: int = bounded(1000, ge=1)
    final_lr_ratio: float = bounded(0.0, ge=0, le=1)
    b1: float = bounded(0.9, ge=0, lt=1)
    b2: float = bounded(0.999, ge=0, lt=1)
    eps: float = bounded(1e-8, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    max_grad_norm: float | None = bounded(1.0, gt=0)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.learning_rate < 0 or self.warmup_steps < 0:
            raise ConfigError("learning_rate and warmup_steps must be >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm={self.max_grad_norm} must be > 0 (or None for no clipping)")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """The learning rate as a function of the optimiser step."""
    return SCHEDULES[cfg.schedule](cfg)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """optax chain: clip_by_global_norm(max_grad_norm) -> AdamW(schedule)."""
    parts = [] if cfg.max_grad_norm is None else [optax.clip_by_global_norm(cfg.max_grad_norm)]
    parts.append(optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts)
