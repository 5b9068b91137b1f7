"""`rl.mode = "sync"` on the seeded single-source pipeline: sample -> score -> update as ONE
compiled program (`rljax.stages.iteration.make_iteration`), or two on split layouts
(`mesh.sampler = "tensor"` or `mesh.sampler_devices`: the sampler's program, an on-device weight
sync, the trainer's); with an `[env]` the rollout is multi-turn episodes, still one program
(`rljax.stages.episodes`), and the env's host side is the callback whose time is reported.

Iteration `it` draws the pipeline's next batch and samples with key fold_in(loop key, it). A
batch of image prompts carries its `PromptImages` (`rljax.data.prompt_images`) into the same
iteration; a text batch carries None.
"""

from __future__ import annotations

from typing import Callable

import jax

from rljax.drivers.base import Driver, check_process_rows, pipeline_callback, prompt_arrays
from rljax.sampling.episode_host import EpisodeHost
from rljax.stages.episodes import episode_controls, make_episode_iteration
from rljax.stages.iteration import make_iteration, make_split_iteration


class SyncDriver(Driver):
    """`iteration(state, tokens, mask, indices, key)` on the pipeline's batches."""

    def __init__(self, iteration: Callable, callback, data, loop_key: jax.Array, *, layout, fused: bool):
        super().__init__()
        self.iteration, self.callback, self.data, self._key = iteration, callback, data, loop_key
        self._layout, self.fused = layout, fused

    def step(self, state, it: int):
        batch = next(self.data)  # its `images` is None for text prompts (no leaves: the text program)
        prompts = prompt_arrays(batch, self._layout)
        return self.iteration(state, *prompts, jax.random.fold_in(self._key, it), images=batch.images)


def build_sync(run, template) -> SyncDriver:
    """The fused iteration (one program), or the split one when the sampler has a layout of its own."""
    cfg = run.cfg
    callback = pipeline_callback(run)
    common = dict(num_groups=cfg.rl.prompts_per_iteration, dynamic_sampling=cfg.rl.dynamic_sampling)
    if run.sampler_layout is not None:
        iteration = make_split_iteration(run.controls, callback, template, num_prompts=run.cfg.rl.num_prompts,
                                         trainer=run.trainer_layout, sampler=run.sampler_layout, **common)
    else:
        iteration = make_iteration(run.controls, callback, layout=run.trainer_layout, **common)
    layout = run.sampler_layout or run.trainer_layout
    check_process_rows(layout, run.cfg.rl.num_prompts)
    return SyncDriver(iteration, callback, iter(run.data.dataset), run.keys["loop"], layout=layout,
                      fused=run.sampler_layout is None)


def build_episodes(run, template) -> SyncDriver:
    """Multi-turn episodes with the `[env]`'s tool, stepped from inside the decode loop: one program."""
    cfg = run.cfg
    host = EpisodeHost(run.env, run.tokenizer, run.data.examples, max_observation_tokens=cfg.env.max_observation_tokens,
                       truncation_marker=cfg.env.truncation_marker)
    iteration = make_episode_iteration(episode_controls(run.controls, run.tokenizer, cfg.env), host, cfg.env,
                                       layout=run.trainer_layout)
    return SyncDriver(iteration, host, iter(run.data.dataset), run.keys["loop"], layout=run.trainer_layout,
                      fused=True)
