"""The RL loop of `rljax train`: warm start, then compiled iterations, with eval and checkpoints.

    for it in range(start, iterations):
        prompts = next(data)                                   # grain: seeded, this process's rows
        state, metrics = iteration(state, prompts, key_it)      # ONE compiled program: sample ->
                                                                # verify (io_callback) -> update
        every eval.every:  greedy accuracy on the held-out split
        every checkpoint.every: async orbax save (params, opt state, step, rng, data state, config)

With `mesh.sampler = "tensor"` the iteration is two programs instead (sampler layout, then
trainer layout) with an on-device weight sync before them, timed as `time/weight_sync_s`.
In a multi-process run (`rljax.sharding.initialize`) every process runs this same loop on its
rows of each global batch; process 0 writes metrics, and checkpoints are written collectively.

Everything random is derived from `cfg.seed` by `fold_in(key, iteration)`, so a resumed run
replays exactly the iterations an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rljax.checkpoint import Checkpointer
from rljax.data.pipeline import prompt_batches
from rljax.data.pipeline import shard_rows
from rljax.errors import CheckpointError, ConfigError
from rljax.evaluation.runner import EvalSetup, greedy_accuracy
from rljax.rewards import as_callback
from rljax.sampling import SampleControls
from rljax.sharding import Layout, global_batch, process_rows
from rljax.train import setup
from rljax.train.config import TrainConfig
from rljax.train.iteration import make_iteration, make_split_iteration
from rljax.train.metrics_writer import MetricsWriter, plot_curves
from rljax.train.progress import Progress
from rljax.train.warm_start import run_warm_start
from rljax.update import TrainState, init_train_state, reset_reference


@dataclasses.dataclass
class RunResult:
    output_dir: Path
    state: TrainState
    history: list[dict[str, Any]]
    start_accuracy: float | None
    final_accuracy: float | None
    plot: Path | None


def sample_controls(cfg: TrainConfig, tokenizer) -> SampleControls:
    """The run's sampling controls with the tokenizer's EOS and pad ids where the recipe sets none."""
    return cfg.sampling.with_tokenizer(tokenizer)


def train(cfg: TrainConfig, *, resume: bool = False, log=print) -> RunResult:
    """Runs `cfg` to completion (or resumes it from its latest checkpoint) and returns the result."""
    out = Path(cfg.output_dir)
    if not resume and any((out / "checkpoints").glob("[0-9]*")):
        raise CheckpointError(f"{out} already holds checkpoints; pass --resume to continue that run, or set "
                              f"output_dir=... for a new one")
    out.mkdir(parents=True, exist_ok=True)
    is_main = jax.process_index() == 0
    key = jax.random.key(cfg.seed)
    k_init, k_warm, k_loop = jax.random.split(key, 3)

    state_layout, sampler_layout = setup.build_layouts(cfg.mesh)
    tokenizer = setup.build_tokenizer(cfg.model)
    model_cfg, params = setup.build_policy(cfg.model, tokenizer, k_init)
    train_set, held_out, skipped = setup.build_splits(cfg.data)
    fmt = setup.prompt_format(cfg.data)
    reward_fn = setup.build_reward(cfg.reward)
    log(setup.run_summary(cfg, model_cfg, params, train_set, held_out) + (f" | skipped rows {skipped}" if skipped else ""))

    over = max(1, round(cfg.rl.prompts_per_iteration * cfg.rl.oversample)) if cfg.rl.dynamic_sampling \
        else cfg.rl.prompts_per_iteration
    data = prompt_batches(train_set, tokenizer=tokenizer, batch_size=over, seed=cfg.data.seed,
                          max_prompt_len=cfg.data.max_prompt_tokens, fmt=fmt,
                          buckets=cfg.data.prompt_buckets or None, add_bos=cfg.data.add_bos)
    controls = sample_controls(cfg, tokenizer)
    evaluator = EvalSetup.build(model_cfg, held_out[:cfg.eval.size], tokenizer, fmt, reward_fn, controls,
                                max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos)
    writer = MetricsWriter(out, tensorboard=cfg.metrics.tensorboard, wandb_project=cfg.metrics.wandb_project,
                           config=cfg.to_dict(), enabled=is_main, resume=resume)
    ckpt = Checkpointer(out / "checkpoints", keep_last=cfg.checkpoint.keep_last,
                        best_metric=cfg.checkpoint.best_metric)

    data_iter = iter(data.dataset)
    start = 0
    history: list[dict[str, Any]] = []
    start_accuracy = None
    if resume and ckpt.latest_step() is not None:
        # Restore straight into the trainer layout: each process reads only the shards it holds.
        template = _place(init_train_state(model_cfg, params, cfg.algorithm, cfg.optim), state_layout)
        restored = ckpt.restore(params=template.params, opt_state=template.opt_state,
                                extra=_extra(template), model_config=model_cfg)
        state = template.replace(params=restored.params, opt_state=restored.opt_state, **restored.extra)
        data_iter.set_state(restored.data_state)
        start = restored.step
        writer.truncate_after(start)
        history = writer.read()
        start_accuracy = history[0].get("eval/accuracy") if history else None
        log(f"resumed from {ckpt.directory}/{start}")
    else:
        if resume:
            log(f"no checkpoint in {ckpt.directory}; starting from scratch")
        if cfg.warm_start.steps:
            validation = EvalSetup.build(model_cfg, train_set[:cfg.warm_start.validation_size], tokenizer, fmt,
                                         reward_fn, controls, max_prompt_len=cfg.data.max_prompt_tokens,
                                         add_bos=cfg.data.add_bos)
            params = run_warm_start(cfg, model_cfg, params, tokenizer, train_set, fmt, k_warm,
                                    validation=validation, log=log)
        state = init_train_state(model_cfg, params, cfg.algorithm, cfg.optim)
        start_accuracy = greedy_accuracy(evaluator, state.params)
        state = _place(state, state_layout)
        log(f"held-out greedy accuracy before RL: {start_accuracy:.3f}")
        row = {"step": 0, "eval/accuracy": start_accuracy}
        writer.write(0, row)
        history.append(row)

    callback = as_callback(reward_fn, tokenizer, [setup.verifier_metadata(e) for e in data.examples])
    # Shapes are global: prompts_per_iteration groups from `over` prompts over all processes.
    kwargs = dict(num_groups=cfg.rl.prompts_per_iteration, dynamic_sampling=cfg.rl.dynamic_sampling,
                  greedy_baseline=cfg.algorithm.advantage == "remax")
    if sampler_layout is not None:
        iteration = make_split_iteration(controls, callback, state, num_prompts=over, trainer=state_layout,
                                         sampler=sampler_layout, **kwargs)
    else:
        iteration = make_iteration(controls, callback, layout=state_layout, **kwargs)
    prompt_layout = sampler_layout or state_layout
    if prompt_layout is not None:
        _check_process_rows(prompt_layout, over)
    progress = Progress(cfg.rl.iterations, start, enabled=is_main and cfg.metrics.progress_bar)
    accuracy = next((r["eval/accuracy"] for r in reversed(history) if r.get("eval/accuracy") is not None), None)
    for it in range(start, cfg.rl.iterations):
        batch = next(data_iter)
        t0 = time.perf_counter()
        if cfg.rl.reference_reset_every and it and it % cfg.rl.reference_reset_every == 0 \
                and state.ref_params is not None:
            state = reset_reference(state)
        prompts = (batch.tokens_bt, batch.mask_bt, batch.indices_b.astype(np.int32))
        if prompt_layout is not None:
            prompts = global_batch(prompts, prompt_layout.mesh)  # this process's rows -> global arrays
        state, metrics = iteration(state, *prompts, jax.random.fold_in(k_loop, it))
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}  # replicated: every process reads
        dt = time.perf_counter() - t0
        metrics["time/iteration_s"] = dt
        # The verifier callback is timed on the host (on process 0, where it runs).
        metrics["time/verify_s"] = callback.last_seconds
        if sampler_layout is None:  # sampling and the update share one compiled program
            metrics["time/sample_and_update_s"] = dt - callback.last_seconds
        metrics["tokens_per_s"] = metrics["tokens/generated"] / dt
        step = it + 1
        if step % cfg.eval.every == 0 or step == cfg.rl.iterations:
            accuracy = greedy_accuracy(evaluator, _eval_params(state.params, state_layout))
            metrics["eval/accuracy"] = accuracy
        writer.write(step, metrics)
        history.append({"step": step, **metrics})
        progress.update(metrics)
        if step % cfg.checkpoint.every == 0 or step == cfg.rl.iterations:
            best = {cfg.checkpoint.best_metric: accuracy} if cfg.checkpoint.best_metric else None
            ckpt.save(step, params=state.params, opt_state=state.opt_state, extra=_extra(state), rng=k_loop,
                      data_state=data_iter.get_state(), config=cfg.to_dict(), model_config=model_cfg,
                      metrics=best)
    progress.close()
    ckpt.wait()
    ckpt.close()
    writer.close()
    plot = plot_curves(writer.read(), out / "curves.png") if is_main else None
    return RunResult(out, state, history, start_accuracy, accuracy, plot)


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


def _place(state: TrainState, layout: Layout | None) -> TrainState:
    """The state in the trainer layout. Across processes it is placed from host copies (identical
    in every process: same seed, same deterministic init and warm start), each process its shards."""
    if layout is None:
        return state
    return jax.device_put(jax.device_get(state) if jax.process_count() > 1 else state, layout.tree(state))


def _eval_params(params, layout: Layout | None):
    """Params the host-driven evaluator can use: across processes, a full copy on every device
    (so each process decodes and reads back whole arrays); otherwise as they are."""
    if layout is None or jax.process_count() == 1:
        return params
    return jax.device_put(params, layout.replicated)


def _extra(state: TrainState) -> dict[str, Any]:
    """The train-state arrays besides params and optimiser state (step, critic, reference)."""
    extra = {"step": state.step, "value_params": state.value_params, "ref_params": state.ref_params}
    return {k: v for k, v in extra.items() if v is not None}
