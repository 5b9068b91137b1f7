"""The driver protocol: every `rl.mode` (and host layout) is a driver with one small interface.

    driver = DRIVERS[driver_name(cfg)].build(run, template)   # programs from the abstract state
    driver.restore(saved)                                     # a resumed run: its prompt source, its arrays
    state, metrics, preview = driver.step(state, it)          # one iteration: sample, score, update
    metrics |= driver.timings(seconds)                        # the verifier's host time, ...
    saved = driver.checkpoint()                               # what it adds to a checkpoint
    driver.close()                                            # stops a producer, on success or error

A driver owns its prompt source (the seeded pipeline's iterator, or a mixture's host state), so
the loop never draws prompts, and its key schedule (`fold_in(loop key, it)` or the overlapped
drivers' per-batch keys), so a resumed run replays exactly what an uninterrupted one would.

`run` is the run's pieces (`rljax.train.run.Run`, read here by attribute, never imported): cfg,
controls, tokenizer, reward_fn, env, data, sampler, replay, trainer_layout, sampler_layout,
keys["loop"] (and `cfg.rl.num_prompts`, the prompts sampled per iteration).
"""

from __future__ import annotations

import abc
import threading
from typing import Any

import jax
import numpy as np

from rljax.checkpoint.train_state import DriverState
from rljax.data.example import verifier_metadata
from rljax.data.pipeline import shard_rows
from rljax.errors import ConfigError
from rljax.rewards import as_callback
from rljax.sharding import Layout, global_batch, process_rows


class Driver(abc.ABC):
    """The protocol (module doc). Subclasses set `data` (a prompt source with `get_state` /
    `set_state`) and `callback` (the verifier's host side, with `take_seconds`), implement `step`,
    and, when they keep arrays across a resume, `checkpoint_extra` / `restore_extra` /
    `restore_target`. `fused`: sampling and the update share one compiled program."""

    fused: bool = False
    data: Any = None
    callback: Any = None
    resume_note: str | None = None  # what a resumed run should be told (`restore` returns it)

    def __init__(self) -> None:
        self.data_lock = threading.Lock()  # an async producer advances the prompt source

    @abc.abstractmethod
    def step(self, state, it: int):
        """Iteration `it`: (state, metrics, preview) after sampling, scoring and one update."""

    def checkpoint(self) -> DriverState:
        """The prompt source's state and the driver's arrays, read under one lock."""
        with self.data_lock:
            return DriverState(self.data.get_state(), self.checkpoint_extra())

    def restore(self, saved: DriverState) -> str | None:
        """A resumed run, before its first step: the prompt source at the batch after the
        checkpoint, the driver's arrays; returns a line for the run's log, or None."""
        self.data.set_state(saved.data_state)
        if saved.arrays:
            self.restore_extra(saved.arrays)
        return self.resume_note

    def restore_target(self, template) -> dict:
        """The abstract shapes (with shardings) of `checkpoint_extra`'s arrays, for orbax; {}: none."""
        return {}

    def checkpoint_extra(self) -> dict:
        return {}

    def restore_extra(self, extra: dict) -> None:
        pass

    def timings(self, seconds: float) -> dict[str, float]:
        """The step's host-timed parts: the verifier callback's time summed over its calls (timed on
        process 0, where it runs) and, for a fused program, the rest of the iteration."""
        verify = self.callback.take_seconds() if self.callback is not None else 0.0
        out = {"time/iteration_s": seconds, "time/verify_s": verify}
        if self.fused:
            out["time/sample_and_update_s"] = seconds - verify
        return out

    def close(self) -> None:
        pass


def pipeline_callback(run):
    """The verifier callback over the single-source pipeline's examples (indices point into them)."""
    return as_callback(run.reward_fn, run.tokenizer, [verifier_metadata(e) for e in run.data.examples])


def prompt_arrays(prompts, layout: Layout | None) -> tuple:
    """A pipeline batch as (tokens, mask, indices), as global arrays on `layout`'s mesh (this
    process's rows) when there is one."""
    arrays = (prompts.tokens_bt, prompts.mask_bt, prompts.indices_b.astype(np.int32))
    return arrays if layout is None else global_batch(arrays, layout.mesh)


def check_process_rows(layout: Layout | None, global_rows: int) -> None:
    """The data pipeline's rows for this process must be the rows its devices hold on the mesh."""
    if layout is None or jax.process_count() == 1:
        return
    want = process_rows(layout.mesh, global_rows)
    got = shard_rows(global_rows, jax.process_index(), jax.process_count())
    if (want.start, want.stop) != (got.start, got.stop):
        raise ConfigError(f"process {jax.process_index()} loads prompt rows {got.start}:{got.stop} but its devices "
                          f"hold rows {want.start}:{want.stop} on mesh {dict(layout.mesh.shape)}; make the batch "
                          "axes (data x fsdp) a multiple of the process count")
