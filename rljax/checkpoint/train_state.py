"""What a training run's checkpoint holds, assembled in one place.

    params, opt_state, adapters        the trainable state (`TrainState`), each its own orbax tree
    extra                              step, critic, KL reference, a learned reward's running moments,
                                       and `extra["driver"]`: the arrays a driver keeps across a
                                       resume (one_step_off's pending batch, async's next index)
    data_state                         JSON: the driver's prompt source (pipeline iterator, or a
                                       host-steered mixture's selection/streams/replay)
    rng, config, model_config, lora    how to rebuild the run; `metrics` ranks "best"

A driver says what it adds (`DriverState`) and what shapes its arrays restore into; the loop
never assembles a tree itself. Teacher and reward model are not saved: a run reloads them from
their own checkpoints (the reward model's running moments are, in `extra`).
"""

from __future__ import annotations

import base64
import dataclasses
import io
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class DriverState:
    """A driver's part of a checkpoint: its prompt source's JSON state and its arrays (may be
    empty), read together (an async producer advances the source while the trainer saves)."""

    data_state: dict
    arrays: dict = dataclasses.field(default_factory=dict)


def extra_arrays(state) -> dict[str, Any]:
    """The train-state arrays besides params and optimiser state (step, critic, reference, a learned
    reward's running moments); absent ones are left out."""
    extra = {"step": state.step, "value_params": state.value_params, "ref_params": state.ref_params,
             "reward_moments": None if state.reward_model is None else state.reward_model.moments,
             "entropy_coef": state.entropy_coef}
    return {k: v for k, v in extra.items() if v is not None}


def save_run(ckpt, state, step: int, driver: DriverState, *, rng, config: dict, model_config,
             best: dict[str, float] | None) -> None:
    """An async orbax save of the run at `step`. A checkpointer that saves from a subset of the
    processes (a multi-process async run's trainer hosts) gets host copies: orbax saves no
    process-local jax.Array in a multi-process run, and restores NumPy into any sharding."""
    extra = extra_arrays(state)
    if driver.arrays:
        extra["driver"] = driver.arrays
    trees = {"params": state.params, "opt_state": state.opt_state, "extra": extra, "adapters": state.adapters}
    if ckpt.processes:
        trees = jax.device_get(trees)
    ckpt.save(step, **trees, rng=rng, data_state=driver.data_state, config=config, model_config=model_config,
              metrics=best, lora=state.lora)


def restore_run(ckpt, template, driver_target: dict, *, model_config, teacher=None, reward_model=None):
    """(state, step, DriverState) of the latest checkpoint, restored into `template` (the fresh
    state's abstract shapes and trainer-layout shardings, so each process reads only its shards)
    and `driver_target` (the driver's arrays' abstract shapes; empty: none). The frozen teacher and
    reward model are the run's own; the reward model's running moments come from the checkpoint."""
    extra = extra_arrays(template)
    if driver_target:
        extra["driver"] = driver_target
    restored = ckpt.restore(params=template.params, opt_state=template.opt_state, extra=extra,
                            model_config=model_config, adapters=template.adapters)
    state_extra = dict(restored.extra)
    arrays = state_extra.pop("driver", {})
    moments = state_extra.pop("reward_moments", None)
    if moments is not None:
        reward_model = reward_model.replace(moments=moments)
    state = template.replace(params=restored.params, opt_state=restored.opt_state, adapters=restored.adapters,
                             teacher=teacher, reward_model=reward_model, **state_extra)
    return state, restored.step, DriverState(restored.data_state, arrays)


def encode_array(x: np.ndarray) -> str:
    """An array as base64 `.npy` text: exact, and a JSON data state stays one file."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(x), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_array(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)
