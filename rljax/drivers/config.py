"""The `[rl]` section: the RL schedule and how sampling and training overlap (the driver's settings)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rljax.config_io import bounded
from rljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ReplaySection:
    """Replay of successful trajectories (`rljax.data.replay`; ARPO, RePO 2025); capacity 0: off.
    Successes of groups with pass rate < `max_pass_rate` are stored (at most `per_prompt` per
    prompt); up to `fraction` of each batch's groups, those that all failed, get one back.
    Replay is keyed on the prompt, so it needs prompts that come back: a pool, not `fresh`
    questions."""

    capacity: int = bounded(0, ge=0)
    fraction: float = bounded(0.25, ge=0, le=1)
    per_prompt: int = bounded(2, ge=1)
    max_pass_rate: float = bounded(0.5, ge=0, le=1)


@dataclasses.dataclass(frozen=True)
class RLSection:
    """The RL schedule. `dynamic_sampling` over-samples `oversample` x prompts and keeps groups
    whose rewards differ (DAPO, 2025). `reference_reset_every` > 0 resets the KL reference to the
    current policy (and restarts the optimiser moments) every that many iterations (ProRL, 2025).

    `resample_round_size` > 0 resamples instead (DAPO's own scheme, `rljax.data.resampling`):
    rounds of that many prompts until `prompts_per_iteration` groups have reward variance, at
    most `resample_max_rounds` rounds. It and `replay` run the iteration as sample -> host ->
    update (`rljax.drivers.host`).

    `mode` picks how sampling and training overlap (`rljax.drivers.overlap`; the overlapped modes
    need `mesh.sampler_devices` > 0, a sampler on its own devices, or for `async` across
    processes `mesh.sampler_processes` > 0, `rljax.drivers.remote`):
    - `sync`: sample, then update, every iteration (one program, or two with mesh.sampler=tensor).
    - `one_step_off`: batch k+1 is sampled with the params before update k while update k runs
      (verl's one-step off-policy pipeline); deterministic, and resumed exactly.
    - `async`: a producer thread samples into a queue of at most `queue_batches` batches and the
      trainer takes them; rows more than `max_staleness` policy versions old are dropped (AReaL's
      bounded staleness eta, Fu et al., 2025). `stale_rows = "wait"` (AReaL's admission rule)
      holds the sampler back so no batch goes stale in the queue; `"drop"` lets it run ahead
      (bounded by the queue) and the trainer drops, and counts, the stale rows.

    `partial_rollouts` (async only, static scheduler; AReaL's interruptible rollouts): the sampler
    checks for new params every `segment_steps` decode steps and, when a newer version arrived,
    recomputes the KV cache under it and goes on; unfinished rows keep their tokens, each token
    keeps the version and log-prob it was drawn with (`rljax.sampling.interruptible`)."""

    iterations: int = bounded(60, ge=0)
    prompts_per_iteration: int = bounded(64, ge=1)
    dynamic_sampling: bool = False
    oversample: float = bounded(2.0, ge=1)
    reference_reset_every: int = bounded(0, ge=0)
    resample_round_size: int = bounded(0, ge=0)
    resample_max_rounds: int = bounded(4, ge=1)
    replay: ReplaySection = ReplaySection()
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    max_staleness: int = bounded(1, ge=0)
    queue_batches: int = bounded(2, ge=1)
    stale_rows: Literal["wait", "drop"] = "wait"
    partial_rollouts: bool = False
    segment_steps: int = bounded(8, ge=1)

    def __post_init__(self):
        if self.resample_round_size and self.dynamic_sampling:
            raise ConfigError("rl.resample_round_size resamples instead of rl.dynamic_sampling's fixed pool; "
                              "set one of them")
        if self.resample_round_size and self.prompts_per_iteration > self.resample_round_size * self.resample_max_rounds:
            raise ConfigError(f"rl.resample_max_rounds={self.resample_max_rounds} rounds of "
                              f"{self.resample_round_size} prompts cannot fill {self.prompts_per_iteration} groups; "
                              "raise either")

    @property
    def num_prompts(self) -> int:
        """Prompts sampled per iteration: `prompts_per_iteration`, over-sampled by `oversample` for
        dynamic sampling."""
        if self.dynamic_sampling:
            return max(1, round(self.prompts_per_iteration * self.oversample))
        return self.prompts_per_iteration

    @property
    def host_batching(self) -> bool:
        """Whether the iteration is sample -> host -> update (resampling or replay)."""
        return bool(self.resample_round_size or self.replay.capacity)
