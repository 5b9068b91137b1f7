"""The RL loop of `rljax train`, as its outline:

    run = build_run(cfg)                                  # tokenizer, policy, data, reward, writers
    state, start, history = initial_state(run)            # restore, or warm start + first eval
    iteration = compile_iteration(run, state)             # rollout -> update, one program
    for it in range(start, iterations):
        state = maybe_reset_reference(state, it)
        state, metrics, preview = iteration(state, next(prompts), fold_in(key, it))
        every eval.every:       greedy accuracy on the held-out split
        every samples_every:    a few completions with their rewards
        every checkpoint.every: async orbax save (params, opt state, step, rng, data state, config)

A mixture (`[[data.sources]]`, a selection policy), DAPO resampling or replay make the
iteration host-steered instead (`rljax.train.batching.HostBatcher`: sample -> host -> update,
one device); its data state (selection, streams, replay) is checkpointed like the pipeline's.

With `mesh.sampler = "tensor"` the iteration is two programs instead (sampler layout, then
trainer layout) with an on-device weight sync before them, timed as `time/weight_sync_s`.
With `mesh.sampler_devices` the sampler has devices of its own, and `rl.mode = "one_step_off"`
or `"async"` overlaps the two programs (`rljax.train.overlap`: a driver that pulls its own
prompts, checkpointed with its pending batch or sample index).
With an `[env]` section the rollout is multi-turn episodes with a tool (`rljax.train.episodes`:
the environment stepped from inside the decode loop), still one program, and the held-out
accuracy is that of greedy episodes.
In a multi-process run (`rljax.sharding.initialize`) every process runs this same loop on its
rows of each global batch; process 0 writes metrics, and checkpoints are written collectively.
With `mesh.sampler_processes` (async across processes) the last processes are sampler hosts
instead (`rljax.train.remote`): they only produce rollouts, and process 0 trains on its own devices.

Everything random is derived from `cfg.seed` by `fold_in(key, iteration)`, so a resumed run
replays exactly the iterations an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np
from etils import epath

from rljax.checkpoint import Checkpointer
from rljax.data.example import verifier_metadata
from rljax.data.mixture import MixtureSampler
from rljax.data.pipeline import PromptData, prompt_batches, shard_rows
from rljax.data.replay import ReplayBuffer
from rljax.data.splits import warm_start_split
from rljax.errors import CheckpointError, ConfigError
from rljax.evaluation.runner import EvalSetup, accuracy_by_task, greedy_accuracy, greedy_solved
from rljax.rewards import as_callback
from rljax.envs import get_format
from rljax.sampling import SampleControls, multiturn
from rljax.sharding import Layout, abstract_like, global_batch, process_rows
from rljax.storage import check_writable
from rljax.train import episodes, overlap, remote, setup
from rljax.train.config import TrainConfig
from rljax.train.batching import HostBatcher, HostDataState, Rounds
from rljax.train.iteration import make_iteration, make_split_iteration, make_stages
from rljax.train.metrics_writer import MetricsWriter, SampleRecord, plot_curves
from rljax.train.progress import CompileCounter, Progress
from rljax.train.tool_warm_start import run_tool_warm_start
from rljax.train.warm_start import run_warm_start
from rljax.update import TrainState, init_train_state, reset_reference


@dataclasses.dataclass
class RunResult:
    output_dir: epath.Path  # local or a URI (gs://...)
    state: TrainState
    history: list[dict[str, Any]]
    start_accuracy: float | None
    final_accuracy: float | None
    plot: epath.Path | None


@dataclasses.dataclass
class Run:
    """The pieces of a run, built once from its config (`build_run`)."""

    cfg: TrainConfig
    out: epath.Path  # output_dir: local or a URI (gs://...), never a collapsed pathlib.Path
    keys: dict[str, jax.Array]  # init, warm, loop
    trainer_layout: Layout | None
    sampler_layout: Layout | None
    tokenizer: Any
    model_cfg: Any
    params: Any  # the initial policy (before any warm start)
    lora: Any  # the LoRA config (None: every weight trains)
    adapters: Any  # LoRA adapters to start from (a PEFT adapter); None: fresh ones
    train_set: tuple
    fmt: Any
    reward_fn: Any
    data: PromptData | None  # the single-source pipeline (None when host-steered)
    sampler: MixtureSampler | None  # the host-steered run's mixture (None: the pipeline)
    replay: ReplayBuffer | None
    num_prompts: int  # sampled per iteration (over-sampled for dynamic sampling)
    controls: SampleControls
    evaluator: EvalSetup
    writer: MetricsWriter
    ckpt: Checkpointer
    log: Callable[[str], None]
    env: Any = None  # the `[env]` section's environment (multi-turn episodes), or None
    teacher: Any = None  # the frozen distillation teacher (`rljax.models.FrozenModel`), or None
    reward_model: Any = None  # the learned reward (`rljax.rewards.learned.LearnedReward`), or None
    resumed_overlap: dict | None = None  # the overlapped driver's checkpointed state, when resuming


def sample_controls(cfg: TrainConfig, tokenizer) -> SampleControls:
    """The run's sampling controls with the tokenizer's EOS and pad ids where the recipe sets none."""
    return cfg.sampling.with_tokenizer(tokenizer)


def train(cfg: TrainConfig, *, resume: bool = False, log=print) -> RunResult:
    """Runs `cfg` to completion (or resumes it from its latest checkpoint) and returns the result."""
    if remote.is_sampler_process(cfg):  # a sampler host of a multi-process async run: it only produces
        remote.run_sampler(cfg, log=log)
        return RunResult(epath.Path(cfg.output_dir), None, [], float("nan"), float("nan"), None)
    run = build_run(cfg, resume=resume, log=log)
    state, start, history, data_iter = initial_state(run, resume=resume)
    iteration, callback = compile_iteration(run, state, data_iter)
    driver = iteration if cfg.rl.mode != "sync" else None
    progress = Progress(cfg.rl.iterations, start, enabled=_is_main() and cfg.metrics.progress_bar)
    accuracy = next((r["eval/accuracy"] for r in reversed(history) if r.get("eval/accuracy") is not None), None)
    compiles = CompileCounter()
    try:
        for it in range(start, cfg.rl.iterations):
            t0 = time.perf_counter()
            state = maybe_reset_reference(state, it, cfg.rl.reference_reset_every)
            if driver is not None:  # it pulls its own prompts, one batch (or more) ahead
                state, metrics, preview = driver.step(state, it)
            else:
                prompts = _prompt_arrays(run, next(data_iter)) if run.sampler is None else ()
                state, metrics, preview = iteration(state, *prompts, jax.random.fold_in(run.keys["loop"], it))
            metrics = jax.block_until_ready(metrics)  # the call returns at dispatch on an accelerator
            metrics = step_metrics(metrics, time.perf_counter() - t0, callback.take_seconds(),
                                   fused=run.sampler_layout is None and run.sampler is None)
            step = it + 1
            last = step == cfg.rl.iterations
            if step % cfg.eval.every == 0 or last:
                metrics.update(evaluate(run, state))
                accuracy = metrics["eval/accuracy"]
            metrics["time/compiles"] = compiles.take()  # programs this step compiled (0 once warm)
            run.writer.write(step, metrics)
            if cfg.metrics.samples_every and (step % cfg.metrics.samples_every == 0 or last):
                run.writer.write_samples(step, preview_samples(run, preview))
            history.append({"step": step, **metrics})
            progress.update(metrics)
            if step % cfg.checkpoint.every == 0 or last:
                save(run, state, step, data_iter, accuracy, driver=driver)
    finally:
        compiles.close()
        if driver is not None:  # stops an async producer on success, error or Ctrl-C alike
            driver.close()
    progress.close()
    return finish(run, state, history, accuracy)


# ----------------------------------------------------------------------------- building


def build_run(cfg: TrainConfig, *, resume: bool, log=print) -> Run:
    """Tokenizer, policy, splits, reward, prompt pipeline, evaluator, metrics writer, checkpointer."""
    out = check_writable(cfg.output_dir)  # a missing bucket or permission stops here, with the fix
    if not resume and any((out / "checkpoints").glob("[0-9]*")):
        raise CheckpointError(f"{out} already holds checkpoints; pass --resume to continue that run, or set "
                              f"output_dir=... for a new one")
    k_init, k_warm, k_loop = jax.random.split(jax.random.key(cfg.seed), 3)
    trainer_layout, sampler_layout = (remote.build_layouts(cfg.mesh) if cfg.mesh.sampler_processes
                                      else setup.build_layouts(cfg.mesh))
    tokenizer = setup.build_tokenizer(cfg.model)
    model_cfg, params = setup.build_policy(cfg.model, tokenizer, k_init, trainer_layout)  # born sharded
    lora, adapters = setup.build_lora(cfg.lora, model_cfg)
    teacher = (setup.build_teacher(cfg.teacher, model_cfg, tokenizer, k_init, trainer_layout)
               if cfg.algorithm.needs.teacher_logp else None)
    reward_model = (setup.build_reward_model(cfg.reward.model, model_cfg, tokenizer, trainer_layout)
                    if cfg.reward.model.enabled else None)
    fmt = setup.prompt_format(cfg.data)
    num_prompts = max(1, round(cfg.rl.prompts_per_iteration * cfg.rl.oversample)) if cfg.rl.dynamic_sampling \
        else cfg.rl.prompts_per_iteration
    data = sampler = replay = None
    if cfg.host_batching:
        _check_host_batching(cfg)
        sources = setup.build_sources(cfg.data)
        train_set = setup.interleave(s.train for s in sources)
        held_out = setup.eval_split(cfg, sources)
        skipped = 0
        reward_fn = setup.run_reward(cfg)
        sampler = MixtureSampler(sources, setup.build_selection(cfg.data, sources), seed=cfg.data.seed,
                                 tokenizer=tokenizer, fmt=fmt, max_prompt_len=cfg.data.max_prompt_tokens,
                                 add_bos=cfg.data.add_bos, max_redraws=cfg.data.band_max_redraws)
        num_too_long = sampler.num_too_long
        if cfg.rl.replay.capacity:
            r = cfg.rl.replay
            replay = ReplayBuffer(capacity=r.capacity, row_len=cfg.data.max_prompt_tokens + cfg.sampling.max_new_tokens,
                                  per_prompt=r.per_prompt, max_pass_rate=r.max_pass_rate)
    else:
        train_set, held_out, skipped = setup.build_splits(cfg.data)
        reward_fn = setup.build_reward(cfg.reward)
        data = prompt_batches(train_set, tokenizer=tokenizer, batch_size=num_prompts, seed=cfg.data.seed,
                              max_prompt_len=cfg.data.max_prompt_tokens, fmt=fmt,
                              buckets=cfg.data.prompt_buckets or None, add_bos=cfg.data.add_bos,
                              **remote.data_processes(cfg))
        num_too_long = data.num_too_long
        held_out = held_out[:cfg.eval.size]
    controls = sample_controls(cfg, tokenizer)
    evaluator = EvalSetup.build(model_cfg, held_out, tokenizer, fmt, reward_fn, controls,
                                max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos)
    dropped = {"skipped rows": skipped, "training prompts over data.max_prompt_tokens (dropped)": num_too_long,
               "held-out prompts over data.max_prompt_tokens (dropped)": evaluator.num_too_long}
    log(setup.run_summary(cfg, model_cfg, params, train_set, held_out)
        + "".join(f" | {what} {n}" for what, n in dropped.items() if n))
    if lora is not None:
        log(setup.lora_summary(lora, model_cfg, params))
    if teacher is not None:
        log(f"teacher {teacher.cfg.model_type} {teacher.num_params / 1e6:.2f}M params, frozen "
            f"({cfg.algorithm.distill}, distill_coef {cfg.algorithm.distill_coef:g}, "
            f"reward_weight {cfg.algorithm.reward_weight:g})")
    if reward_model is not None:
        log(f"reward model {reward_model.model.cfg.model_type} {reward_model.model.num_params / 1e6:.2f}M params, "
            f"frozen (weight {reward_model.weight:g}, normalize {reward_model.normalize}; verifier correct_weight "
            f"{cfg.reward.correct_weight:g})")
    writer = MetricsWriter(out, tensorboard=cfg.metrics.tensorboard, wandb_project=cfg.metrics.wandb_project,
                           config=cfg.to_dict(), enabled=_is_main(), resume=resume)
    ckpt = Checkpointer(out / "checkpoints", keep_last=cfg.checkpoint.keep_last,
                        best_metric=cfg.checkpoint.best_metric, processes=remote.checkpoint_processes(cfg))
    env = setup.build_env(cfg.env) if cfg.env.enabled else None
    return Run(cfg=cfg, out=out, keys={"init": k_init, "warm": k_warm, "loop": k_loop}, env=env, teacher=teacher, reward_model=reward_model,
               trainer_layout=trainer_layout, sampler_layout=sampler_layout, tokenizer=tokenizer,
               model_cfg=model_cfg, params=params, lora=lora, adapters=adapters, train_set=train_set, fmt=fmt,
               reward_fn=reward_fn, data=data, sampler=sampler, replay=replay,
               num_prompts=num_prompts, controls=controls, evaluator=evaluator, writer=writer, ckpt=ckpt, log=log)


def new_train_state(run: Run, params) -> TrainState:
    """A fresh state born in the trainer layout: reference, value model and optimiser state come
    out of one program with the layout's `out_shardings` (`init_train_state`), params as they are."""
    cfg = run.cfg
    return init_train_state(run.model_cfg, params, cfg.algorithm, cfg.optim, update_cfg=cfg.update,
                            shaping=cfg.shaping, layout=run.trainer_layout, lora=run.lora, adapters=run.adapters,
                            teacher=run.teacher, reward_model=run.reward_model)


def abstract_train_state(run: Run) -> TrainState:
    """The fresh state's shapes, dtypes and trainer-layout shardings, allocating nothing: the
    restore target, so orbax reads each process's shards straight into place."""
    cfg = run.cfg
    abstract_params, abstract_adapters = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                      (run.params, run.adapters))
    state = jax.eval_shape(lambda p, a, t, r: init_train_state(run.model_cfg, p, cfg.algorithm, cfg.optim,
                                                               update_cfg=cfg.update, shaping=cfg.shaping, lora=run.lora,
                                                               adapters=a, teacher=t, reward_model=r),
                           abstract_params, abstract_adapters, run.teacher, run.reward_model)
    if run.trainer_layout is None:
        return state
    return abstract_like(state, run.trainer_layout.tree(state))


def initial_state(run: Run, *, resume: bool):
    """(state, first iteration, metric history, prompt iterator): restored from the latest
    checkpoint when resuming, else a fresh state after the warm start, with the held-out
    accuracy before RL as history row 0."""
    data_iter = iter(run.data.dataset) if run.sampler is None else HostDataState(run.sampler, run.replay)
    if resume and run.ckpt.latest_step() is not None:
        state, start = restore(run, data_iter)
        run.writer.truncate_after(start)
        return state, start, run.writer.read(), data_iter
    if resume:
        run.log(f"no checkpoint in {run.ckpt.directory}; starting from scratch")
    params = warm_start(run)
    state = new_train_state(run, params)
    if run.sampler is not None:
        calibrate(run, state)
    row = {"step": 0, **evaluate(run, state), "eval/prompts_too_long": run.evaluator.num_too_long}
    run.log(f"held-out greedy accuracy before RL: {row['eval/accuracy']:.3f}")
    run.writer.write(0, row)
    return state, 0, [row], data_iter


def restore(run: Run, data_iter) -> tuple[TrainState, int]:
    """The latest checkpoint, placed straight into the trainer layout (each process reads only the
    shards it holds), with the prompt iterator set to the batch after it. An overlapped run's
    driver state (`overlap_template`) is kept in `run.resumed_overlap` for `compile_iteration`."""
    template = abstract_train_state(run)
    extra = _extra(template)
    if run.cfg.rl.mode != "sync":
        extra["overlap"] = overlap_template(run, template)
    restored = run.ckpt.restore(params=template.params, opt_state=template.opt_state, extra=extra,
                                model_config=run.model_cfg, adapters=template.adapters)
    data_iter.set_state(restored.data_state)
    state_extra = dict(restored.extra)
    run.resumed_overlap = state_extra.pop("overlap", None)
    moments = state_extra.pop("reward_moments", None)
    reward_model = run.reward_model if moments is None else run.reward_model.replace(moments=moments)
    run.log(f"resumed from {run.ckpt.directory}/{restored.step}")
    if run.cfg.rl.mode == "async":
        run.log("async: the batches in flight at the checkpoint are dropped; the rollout queue restarts empty")
    # Teacher and reward model are not checkpointed: the run holds them as loaded from their own
    # checkpoints (the reward model's running moments are, above).
    return template.replace(params=restored.params, opt_state=restored.opt_state, adapters=restored.adapters,
                            teacher=run.teacher, reward_model=reward_model, **state_extra), restored.step


def evaluate(run: Run, state: TrainState) -> dict[str, float]:
    """Greedy held-out accuracy, and per task for a mixture (`eval/{task}/accuracy`); with an
    `[env]`, the accuracy of greedy episodes with the env's tool (`held_out_accuracy`)."""
    if run.env is not None:
        return {"eval/accuracy": held_out_accuracy(run, _eval_params(state.sampler_params(), run))}
    solved = greedy_solved(run.evaluator, _eval_params(state.sampler_params(), run))
    out = {"eval/accuracy": float(np.mean(solved)) if solved.size else float("nan")}
    out.update({f"eval/{task}/accuracy": acc for task, acc in accuracy_by_task(run.evaluator, solved).items()})
    return out


def calibrate(run: Run, state: TrainState) -> None:
    """`auto_curriculum`'s start: greedy pass rate per source on a few of its training prompts
    (never the held-out split), after the warm start; other policies skip it. They are the front
    of each source's pool, which `warm_start_split` keeps out of the warm start's SFT set (the
    interleaved validation set holds each source's first `validation_size // sources`), so the
    pass rates are not inflated by memorisation."""
    if not hasattr(run.sampler.policy, "calibrate"):
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
                                 max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos)
    if run.env is not None:  # scripted tool-use episodes; validated by greedy episodes
        options = episodes.EpisodeOptions.from_section(cfg.env)
        controls = episode_controls(run)
        accuracy = lambda p: episodes.episode_accuracy(validation, p, run.env, options, controls)  # noqa: E731
        return run_tool_warm_start(cfg, run.model_cfg, params, run.tokenizer, sft_set, run.fmt, run.env,
                                   run.keys["warm"], accuracy=accuracy, log=run.log)
    return run_warm_start(cfg, run.model_cfg, params, run.tokenizer, sft_set, run.fmt, run.keys["warm"],
                          validation=validation, log=run.log)


def compile_iteration(run: Run, state: TrainState, data_iter=None):
    """The iteration program(s) and the verifier callback they call (its host time is read per step).
    Shapes are global: `prompts_per_iteration` groups from `num_prompts` prompts over all processes.
    In `rl.mode` one_step_off or async, the iteration is an `rljax.train.overlap` driver that
    draws its prompts from `data_iter` itself."""
    cfg = run.cfg
    if cfg.rl.mode != "sync":
        return overlap_driver(run, state, data_iter)
    if run.env is not None:  # multi-turn episodes: the env's host side is the callback
        host = episodes.EpisodeHost(run.env, run.tokenizer, run.data.examples,
                                    max_observation_tokens=cfg.env.max_observation_tokens,
                                    truncation_marker=cfg.env.truncation_marker)
        iteration = episodes.make_episode_iteration(episode_controls(run), host,
                                                    episodes.EpisodeOptions.from_section(cfg.env),
                                                    layout=run.trainer_layout)
        return iteration, host
    if run.sampler is not None:
        callback = as_callback(run.reward_fn, run.tokenizer, run.sampler.table)  # grows with fresh questions
        rounds = Rounds.from_config(cfg.rl)
        stages = make_stages(run.controls, callback, state, num_prompts=rounds.round_size,
                             trainer=run.trainer_layout, sampler=run.sampler_layout)
        batcher = HostBatcher(run.sampler, stages, num_groups=cfg.rl.prompts_per_iteration,
                              num_samples=cfg.sampling.num_samples, rounds=rounds, replay=run.replay,
                              replay_fraction=cfg.rl.replay.fraction)
        return batcher.step, callback
    callback = as_callback(run.reward_fn, run.tokenizer, [verifier_metadata(e) for e in run.data.examples])
    common = dict(num_groups=cfg.rl.prompts_per_iteration, dynamic_sampling=cfg.rl.dynamic_sampling)
    if run.sampler_layout is not None:
        iteration = make_split_iteration(run.controls, callback, state, num_prompts=run.num_prompts,
                                         trainer=run.trainer_layout, sampler=run.sampler_layout, **common)
    else:
        iteration = make_iteration(run.controls, callback, layout=run.trainer_layout, **common)
    prompt_layout = run.sampler_layout or run.trainer_layout
    if prompt_layout is not None:
        _check_process_rows(prompt_layout, run.num_prompts)
    return iteration, callback


def _overlap_programs(run: Run, state, callback) -> overlap.OverlapPrograms:
    stages = make_stages(run.controls, callback, state, num_prompts=run.num_prompts,
                         trainer=run.trainer_layout, sampler=run.sampler_layout)
    return overlap.OverlapPrograms.from_stages(stages)


def overlap_driver(run: Run, state: TrainState, data_iter):
    """(driver, verifier callback) for `rl.mode` one_step_off or async, restored from
    `run.resumed_overlap` when the run resumes."""
    cfg = run.cfg
    callback = as_callback(run.reward_fn, run.tokenizer, [verifier_metadata(e) for e in run.data.examples])
    programs = _overlap_programs(run, state, callback)
    prompts = lambda: _prompt_arrays(run, next(data_iter))  # noqa: E731
    if cfg.mesh.sampler_processes:  # the producers are other processes (`rljax.train.remote`)
        driver = remote.RemoteDriver(programs, run.keys["loop"], cfg, state, num_prompts=run.num_prompts)
    elif cfg.rl.mode == "one_step_off":
        driver = overlap.OneStepOff(programs, prompts, run.keys["loop"])
    else:
        driver = overlap.AsyncDriver(programs, prompts, run.keys["loop"], max_staleness=cfg.rl.max_staleness,
                                     queue_batches=cfg.rl.queue_batches, wait_for_fresh=cfg.rl.stale_rows == "wait",
                                     rows=cfg.rl.prompts_per_iteration * cfg.sampling.num_samples,
                                     segment_steps=cfg.rl.segment_steps if cfg.rl.partial_rollouts else 0)
    if run.resumed_overlap is not None:
        driver.restore_extra(run.resumed_overlap)
    return driver, callback


def overlap_template(run: Run, template: TrainState) -> dict:
    """The restore target of the overlapped driver's checkpoint entry: one_step_off's pending batch
    (the sampling program's output shapes, from `jax.eval_shape`) or async's next sample index."""
    if run.cfg.rl.mode == "async":
        return {"next_index": jax.ShapeDtypeStruct((), np.int32, sharding=run.trainer_layout.replicated)}
    programs = _overlap_programs(run, template, as_callback(run.reward_fn, run.tokenizer, []))
    params = abstract_like(jax.eval_shape(TrainState.sampler_params, template), programs.sampler_params_shardings)
    return {"pending": programs.sample_template(params, run.num_prompts, run.cfg.data.max_prompt_tokens)}


def episode_controls(run: Run) -> SampleControls:
    """The run's controls with the env format's tool-call end as a stop sequence."""
    fmt = get_format(run.cfg.env.format)
    return multiturn.episode_controls(run.controls, run.tokenizer.encode(fmt.stop_sequence))


def held_out_accuracy(run: Run, params) -> float:
    """Greedy accuracy on the held-out split: single completions, or greedy episodes with the
    env's tool when the run has an `[env]`."""
    if run.env is None:
        return greedy_accuracy(run.evaluator, params)
    return episodes.episode_accuracy(run.evaluator, params, run.env, episodes.EpisodeOptions.from_section(run.cfg.env),
                                     episode_controls(run))


# ----------------------------------------------------------------------------- the steps


def maybe_reset_reference(state: TrainState, it: int, every: int) -> TrainState:
    """ProRL's reference reset every `every` iterations (0: never), before iteration `it` runs."""
    if every and it and it % every == 0 and state.ref_params is not None:
        return reset_reference(state)
    return state


def step_metrics(metrics, seconds: float, verify_seconds: float, *, fused: bool) -> dict[str, float]:
    """Host floats of an iteration's metrics plus its timings. `verify_seconds` is the verifier
    callback's host time summed over its calls this iteration."""
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}  # replicated: every process reads
    out["time/iteration_s"] = seconds
    out["time/verify_s"] = verify_seconds  # timed on the host of process 0, where it runs
    if fused:  # sampling and the update share one compiled program
        out["time/sample_and_update_s"] = seconds - verify_seconds
    out["time/generated_tokens_per_s"] = out["rollout/tokens"] / seconds  # over the whole iteration
    return out


def preview_samples(run: Run, preview) -> list[SampleRecord]:
    """A few sampled rows as text, for the sample log: prompt, completion and rewards."""
    p = jax.device_get(preview)
    decode = lambda tokens, masks: run.tokenizer.decode_batch(  # noqa: E731
        [t[m].tolist() for t, m in zip(tokens, masks)], skip_special=True)
    prompts = decode(p.prompt_tokens_kt, p.prompt_mask_kt)
    examples = run.data.examples if run.sampler is None else run.sampler.examples
    completions = decode(p.completion_tokens_kc, p.completion_mask_kc)
    return [SampleRecord(prompt=q, completion=c, reward=float(p.rewards_k[i]),
                         reward_parts={name: float(v[i]) for name, v in p.reward_parts_k.items()},
                         example_id=examples[int(p.prompt_index_k[i])].id)
            for i, (q, c) in enumerate(zip(prompts, completions))]


def save(run: Run, state: TrainState, step: int, data_iter, accuracy: float | None, *, driver=None) -> None:
    """An async orbax save; an overlapped run adds its driver's state (`checkpoint_extra`), read
    with the prompt iterator's under one lock (an async producer advances the iterator)."""
    best = {run.cfg.checkpoint.best_metric: accuracy} if run.cfg.checkpoint.best_metric else None
    extra = _extra(state)
    if driver is not None:
        with driver.data_lock:
            data_state, extra["overlap"] = data_iter.get_state(), driver.checkpoint_extra()
    else:
        data_state = data_iter.get_state()
    trees = {"params": state.params, "opt_state": state.opt_state, "extra": extra, "adapters": state.adapters}
    if run.cfg.mesh.sampler_processes:  # orbax refuses process-local arrays in a multi-process run
        trees = remote.host_copy(trees)
    run.ckpt.save(step, **trees, rng=run.keys["loop"], data_state=data_state, config=run.cfg.to_dict(),
                  model_config=run.model_cfg, metrics=best, lora=state.lora)


def finish(run: Run, state: TrainState, history: list[dict[str, Any]], accuracy: float | None) -> RunResult:
    run.ckpt.wait()
    run.ckpt.close()
    run.writer.close()
    plot = plot_curves(run.writer.read(), run.out / "curves.png") if _is_main() else None
    start_accuracy = history[0].get("eval/accuracy") if history else None
    return RunResult(run.out, state, history, start_accuracy, accuracy, plot)


# ----------------------------------------------------------------------------- placement


def _is_main() -> bool:
    return jax.process_index() == 0


def _prompt_arrays(run: Run, prompts):
    arrays = (prompts.tokens_bt, prompts.mask_bt, prompts.indices_b.astype(np.int32))
    layout = run.sampler_layout or run.trainer_layout
    if layout is not None:
        arrays = global_batch(arrays, layout.mesh)  # this process's rows -> global arrays
    return arrays


def _check_process_rows(layout: Layout, global_rows: int) -> None:
    """The data pipeline's rows for this process must be the rows its devices hold on the mesh."""
    if jax.process_count() == 1:
        return
    want = process_rows(layout.mesh, global_rows)
    got = shard_rows(global_rows, jax.process_index(), jax.process_count())
    if (want.start, want.stop) != (got.start, got.stop):
        raise ConfigError(f"process {jax.process_index()} loads prompt rows {got.start}:{got.stop} but its devices "
                          f"hold rows {want.start}:{want.stop} on mesh {dict(layout.mesh.shape)}; make the batch "
                          "axes (data x fsdp) a multiple of the process count")


def _check_host_batching(cfg: TrainConfig) -> None:
    """A host-steered iteration (mixture, resampling, replay) runs in one process for now: its
    prompts are drawn on the host and placed whole on the mesh."""
    if jax.process_count() > 1:
        raise ConfigError("a mixture, selection policy, rl.resample_round_size or rl.replay runs in one process "
                          "for now; use a single source without resampling or replay across processes")


def _eval_params(params, run: Run):
    """Params the host-driven evaluator can use: across processes, a full copy on every device
    (so each process decodes and reads back whole arrays); otherwise as they are."""
    if run.trainer_layout is None or jax.process_count() == 1:
        return params
    return jax.device_put(params, run.trainer_layout.replicated)


def _extra(state: TrainState) -> dict[str, Any]:
    """The train-state arrays besides params and optimiser state (step, critic, reference, a learned
    reward's running moments)."""
    extra = {"step": state.step, "value_params": state.value_params, "ref_params": state.ref_params,
             "reward_moments": None if state.reward_model is None else state.reward_model.moments}
    return {k: v for k, v in extra.items() if v is not None}
