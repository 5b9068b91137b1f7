"""The RL loop of `rljax train`, as its outline:

    run = build_run(cfg)                                  # tokenizer, policy, data, reward, writers
    driver = DRIVERS[cfg.driver].build(run, template)     # the mode: sync, host, episodes, overlapped
    state, start, history = initial_state(run, driver)    # restore, or warm start + first eval
    for it in range(start, iterations):
        state = maybe_reset_reference(state, it)
        state, metrics, preview = driver.step(state, it)  # sample -> score -> update
        every eval.every:       greedy accuracy on the held-out split
        every samples_every:    a few completions with their rewards (and in any iteration whose
                                preview holds a row the reward audit disputes)
        every checkpoint.every: async orbax save (`rljax.checkpoint.train_state`: the state and
                                what the driver adds, its prompt source and any arrays)

Every mode is a driver with the same small interface (`rljax.drivers.base.Driver`); the loop
does not know which one runs. In a multi-process run every process runs this same loop on its
rows of each global batch; process 0 writes metrics, and checkpoints are written collectively.
With `mesh.sampler_processes` the last processes are sampler hosts instead
(`rljax.train.sampler_host`): they only produce rollouts.

Everything random is derived from `cfg.seed` (`fold_in(key, iteration)`, or the overlapped
drivers' per-batch keys), so a resumed run replays exactly the iterations an uninterrupted run
would.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from etils import epath

from rljax.checkpoint.train_state import save_run
from rljax.drivers import DRIVERS
from rljax.sharding.placement import is_sampler_process
from rljax.train.config import TrainConfig
from rljax.train.metrics_writer import SampleRecord, plot_curves
from rljax.train.progress import CompileCounter, Progress
from rljax.train.run import Run, abstract_train_state, build_run
from rljax.train.sampler_host import run_sampler
from rljax.train.start import evaluate, initial_state
from rljax.update import TrainState, reset_reference


@dataclasses.dataclass
class RunResult:
    output_dir: epath.Path  # local or a URI (gs://...)
    state: TrainState
    history: list[dict[str, Any]]
    start_accuracy: float | None
    final_accuracy: float | None
    plot: epath.Path | None


def train(cfg: TrainConfig, *, resume: bool = False, log=print) -> RunResult:
    """Runs `cfg` to completion (or resumes it from its latest checkpoint) and returns the result."""
    if is_sampler_process(cfg.mesh):  # a sampler host of a multi-process async run: it only produces
        run_sampler(cfg, log=log)
        return RunResult(epath.Path(cfg.output_dir), None, [], float("nan"), float("nan"), None)
    run = build_run(cfg, resume=resume, log=log)
    template = abstract_train_state(run)
    driver = DRIVERS[cfg.driver].build(run, template)
    try:
        state, start, history = initial_state(run, driver, template, resume=resume)
        progress = Progress(cfg.rl.iterations, start, enabled=_is_main() and cfg.metrics.progress_bar)
        accuracy = next((r["eval/accuracy"] for r in reversed(history) if r.get("eval/accuracy") is not None), None)
        compiles = CompileCounter()
        try:
            for it in range(start, cfg.rl.iterations):
                t0 = time.perf_counter()
                state = maybe_reset_reference(state, it, cfg.rl.reference_reset_every)
                state, metrics, preview = driver.step(state, it)
                metrics = jax.block_until_ready(metrics)  # the call returns at dispatch on an accelerator
                metrics = step_metrics(metrics, driver.timings(time.perf_counter() - t0))
                step, last = it + 1, it + 1 == cfg.rl.iterations
                if step % cfg.eval.every == 0 or last:
                    metrics.update(evaluate(run, state))
                    accuracy = metrics["eval/accuracy"]
                metrics["time/compiles"] = compiles.take()  # programs this step compiled (0 once warm)
                run.writer.write(step, metrics)
                if cfg.metrics.samples_every and (step % cfg.metrics.samples_every == 0 or last or disputed(preview)):
                    run.writer.write_samples(step, preview_samples(run, preview))
                history.append({"step": step, **metrics})
                progress.update(metrics)
                if step % cfg.checkpoint.every == 0 or last:
                    save(run, state, step, driver, accuracy)
        finally:
            compiles.close()
    finally:
        driver.close()  # stops an async producer on success, error or Ctrl-C alike
    progress.close()
    return finish(run, state, history, accuracy)


def maybe_reset_reference(state: TrainState, it: int, every: int) -> TrainState:
    """ProRL's reference reset every `every` iterations (0: never), before iteration `it` runs."""
    if every and it and it % every == 0 and state.ref_params is not None:
        return reset_reference(state)
    return state


def step_metrics(metrics, timings: dict[str, float]) -> dict[str, float]:
    """Host floats of an iteration's metrics plus the driver's timings (`Driver.timings`)."""
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}  # replicated: every process reads
    out.update(timings)
    out["time/generated_tokens_per_s"] = out["rollout/tokens"] / timings["time/iteration_s"]  # whole iteration
    return out


def disputed(preview) -> bool:
    """Whether the preview holds a row the audit disputes (logged whatever `samples_every` says)."""
    return preview.disputed_k is not None and bool(jax.device_get(preview.disputed_k).any())


def preview_samples(run: Run, preview) -> list[SampleRecord]:
    """A few sampled rows as text, for the sample log: prompt, completion and rewards."""
    p = jax.device_get(preview)
    decode = lambda tokens, masks: run.tokenizer.decode_batch(  # noqa: E731
        [t[m].tolist() for t, m in zip(tokens, masks)], skip_special=True)
    prompts = decode(p.prompt_tokens_kt, p.prompt_mask_kt)
    completions = decode(p.completion_tokens_kc, p.completion_mask_kc)
    return [SampleRecord(prompt=q, completion=c, reward=float(p.rewards_k[i]),
                         reward_parts={name: float(v[i]) for name, v in p.reward_parts_k.items()},
                         example_id=run.examples[int(p.prompt_index_k[i])].id)
            for i, (q, c) in enumerate(zip(prompts, completions))]


def save(run: Run, state: TrainState, step: int, driver, accuracy: float | None) -> None:
    """An async orbax save of the state and the driver's part (`rljax.checkpoint.train_state`)."""
    best = {run.cfg.checkpoint.best_metric: accuracy} if run.cfg.checkpoint.best_metric else None
    save_run(run.ckpt, state, step, driver.checkpoint(), rng=run.keys["loop"], config=run.cfg.to_dict(),
             model_config=run.model_cfg, best=best)


def finish(run: Run, state: TrainState, history: list[dict[str, Any]], accuracy: float | None) -> RunResult:
    run.ckpt.wait()
    run.ckpt.close()
    run.writer.close()
    plot = plot_curves(run.writer.read(), run.out / "curves.png") if _is_main() else None
    start_accuracy = history[0].get("eval/accuracy") if history else None
    return RunResult(run.out, state, history, start_accuracy, accuracy, plot)


def _is_main() -> bool:
    return jax.process_index() == 0
