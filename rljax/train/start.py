"""The run's start: a resumed state from the latest checkpoint, or a fresh one after the
optional warm start (SFT, or scripted tool-use episodes with an `[env]`), a curriculum's
calibration and the held-out accuracy before RL; and the held-out evaluation the loop repeats."""

from __future__ import annotations

import jax
import numpy as np

from rljax.checkpoint.train_state import restore_run
from rljax.data.splits import warm_start_split
from rljax.drivers.base import Driver
from rljax.evaluation.episodes import episode_accuracy
from rljax.evaluation.runner import EvalSetup, accuracy_by_task, greedy_accuracy, greedy_judged
from rljax.rewards import AUDIT_PART
from rljax.stages.episodes import episode_controls
from rljax.train.run import Run, new_train_state
from rljax.update import TrainState
from rljax.warmstart.sft import run_warm_start
from rljax.warmstart.tool_use import run_tool_warm_start


def initial_state(run: Run, driver: Driver, template: TrainState, *, resume: bool):
    """(state, first iteration, metric history): restored from the latest checkpoint when resuming
    (the driver gets its part back: `Driver.restore`), else a fresh state after the warm start,
    with the held-out accuracy before RL as history row 0."""
    if resume and run.ckpt.latest_step() is not None:
        state, start, saved = restore_run(run.ckpt, template, driver.restore_target(template),
                                          model_config=run.model_cfg, teacher=run.teacher,
                                          reward_model=run.reward_model)
        note = driver.restore(saved)
        run.log(f"resumed from {run.ckpt.directory}/{start}")
        if note:
            run.log(note)
        run.writer.truncate_after(start)
        return state, start, run.writer.read()
    if resume:
        run.log(f"no checkpoint in {run.ckpt.directory}; starting from scratch")
    state = new_train_state(run, warm_start(run))
    calibrate(run, state)
    row = {"step": 0, **evaluate(run, state), "eval/prompts_too_long": run.evaluator.num_too_long}
    run.log(f"held-out greedy accuracy before RL: {row['eval/accuracy']:.3f}")
    run.writer.write(0, row)
    return state, 0, [row]


def evaluate(run: Run, state: TrainState) -> dict[str, float]:
    """Greedy held-out accuracy, and per task for a mixture (`eval/{task}/accuracy`); with an
    `[env]`, the accuracy of greedy episodes with the env's tool."""
    params = _eval_params(state.sampler_params(), run)
    if run.env is not None:
        controls = episode_controls(run.controls, run.tokenizer, run.cfg.env)
        return {"eval/accuracy": episode_accuracy(run.evaluator, params, run.env, run.cfg.env, controls)}
    judged = greedy_judged(run.evaluator, params)
    solved = judged["correct"]
    out = {"eval/accuracy": float(np.mean(solved)) if solved.size else float("nan")}
    if AUDIT_PART in judged:  # the stricter check's accuracy on the same replies
        out["eval/accuracy_strict"] = float(np.mean(judged[AUDIT_PART])) if solved.size else float("nan")
    out.update({f"eval/{task}/accuracy": acc for task, acc in accuracy_by_task(run.evaluator, solved).items()})
    return out


def calibrate(run: Run, state: TrainState) -> None:
    """`auto_curriculum`'s start: greedy pass rate per source on a few of its training prompts
    (never the held-out split), after the warm start; other policies skip it. They are the front
    of each source's pool, which `warm_start_split` keeps out of the warm start's SFT set (the
    interleaved validation set holds each source's first `validation_size // sources`), so the
    pass rates are not inflated by memorisation."""
    if run.sampler is None or not hasattr(run.sampler.policy, "calibrate"):
        return
    per_source = max(8, run.cfg.warm_start.validation_size // len(run.sampler.sources))
    params = _eval_params(state.sampler_params(), run)
    rates = [greedy_accuracy(EvalSetup.build(run.model_cfg, src.train[:per_source], run.tokenizer, run.fmt,
                                             run.reward_fn, run.controls, max_prompt_len=run.cfg.data.max_prompt_tokens,
                                             add_bos=run.cfg.data.add_bos), params)
             for src in run.sampler.sources]
    run.sampler.calibrate(rates)
    run.log("curriculum start from greedy pass rates " + ", ".join(
        f"{s.name} {r:.2f}" for s, r in zip(run.sampler.sources, rates)))


def warm_start(run: Run):
    """The policy after the optional supervised warm start (the initial one when it is off)."""
    cfg = run.cfg
    if not cfg.warm_start.steps:
        return run.params
    params = run.params
    validates = bool(cfg.warm_start.target_accuracy or cfg.warm_start.patience)
    if validates:  # its validation runs the host-driven evaluator
        params = _eval_params(params, run)
    sft_set, validation_set = warm_start_split(run.train_set, cfg.warm_start.validation_size if validates else 0)
    validation = EvalSetup.build(run.model_cfg, validation_set or run.train_set[:cfg.warm_start.validation_size],
                                 run.tokenizer, run.fmt, run.reward_fn, run.controls,
                                 max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos,
                                 images=run.images)
    if run.env is not None:  # scripted tool-use episodes; validated by greedy episodes
        options = cfg.env
        controls = episode_controls(run.controls, run.tokenizer, run.cfg.env)
        accuracy = lambda p: episode_accuracy(validation, p, run.env, options, controls)  # noqa: E731
        return run_tool_warm_start(cfg, run.model_cfg, params, run.tokenizer, sft_set, run.fmt, run.env,
                                   run.keys["warm"], accuracy=accuracy, log=run.log)
    return run_warm_start(cfg, run.model_cfg, params, run.tokenizer, sft_set, run.fmt, run.keys["warm"],
                          validation=validation, images=run.images, log=run.log)


def _eval_params(params, run: Run):
    """Params the host-driven evaluator can use: across processes, a full copy on every device
    (so each process decodes and reads back whole arrays); otherwise as they are."""
    if run.trainer_layout is None or jax.process_count() == 1:
        return params
    return jax.device_put(params, run.trainer_layout.replicated)
