"""A host-steered RL iteration: mixture selection, DAPO resampling rounds and replay.

    drawn = sampler.draw(R)                             # tasks by the policy, rows by stream
    batch_r = sample(params, drawn.prompts, key_r)      # R * n scored rows (compiled once)
    ...repeat while the resampler wants another round (fixed-size rounds: static shapes)
    batch = gather(rounds, sel.indices_g, sel.valid_g)  # G groups; filler groups loss-masked
    batch = mix_into_batch(batch, replay)               # optional; then store the fresh successes
    state = update(state, batch, key)                   # compiled once
    sampler.observe(task_ids, group_stats(...))         # the policy learns from every sampled group

The rounds: with `rl.resample_round_size` R > 0, up to `rl.resample_max_rounds` rounds of R
prompts until G groups have reward variance (DAPO's resampling); with `rl.dynamic_sampling`,
one over-sampled round (the fixed pool, `refill`'s rule); otherwise one round of G prompts,
all kept. The policy signal is the group-normalised advantage ``|A| = |r - mean_g| /
(std_g + 1e-6)`` of every sampled group (DUMP's and SEC's learning progress; GRPO's
advantage), so a task's groups that the resampler dropped still tell the policy it is solved.

It is its own module because the fused iteration (`rljax.stages.iteration.make_iteration`) has
no host in the middle; this is the path for everything that needs one. With a trainer layout
the stages are the split iteration's programs (`make_stages`), on one process.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from rljax.checkpoint.train_state import decode_array, encode_array
from rljax.data.mixture import MixtureSampler, task_metrics
from rljax.data.replay import ReplayBuffer, mix_into_batch
from rljax.data.resampling import RoundResampler
from rljax.data.selection import group_stats
from rljax.drivers.base import Driver
from rljax.errors import CheckpointError, ConfigError
from rljax.rewards import as_callback
from rljax.stages.iteration import make_stages, merge_metrics
from rljax.update import RolloutBatch

_SUMMED = ("rollout/tokens", "rollout/verifier_failed")  # rollout metrics that add up over rounds
_REPLAY_ARRAYS = ("tokens", "attn_mask", "loss_mask", "behaviour_logp", "rewards", "order", "routes")
_ROW_FIELDS = ("tokens_bt", "attn_mask_bt", "loss_mask_bt", "sampler_logp_bt", "rewards_b", "baseline_rewards_b",
               "verifier_rewards_b", "routes_btlk")


@dataclasses.dataclass(frozen=True)
class Rounds:
    """How many prompts each round draws and how many rounds at most; `filter` keeps only groups
    with reward variance (resampling or the fixed pool), else every group is kept."""

    round_size: int
    max_rounds: int
    filter: bool

    @classmethod
    def from_config(cls, rl) -> "Rounds":
        if rl.resample_round_size:
            return cls(rl.resample_round_size, rl.resample_max_rounds, True)
        if rl.dynamic_sampling:
            return cls(rl.num_prompts, 1, True)
        return cls(rl.prompts_per_iteration, 1, False)


def host_advantages(rewards_gn) -> np.ndarray:
    """GRPO's group-normalised advantage ``(r - mean_g) / (std_g + 1e-6)``, ``[G, n]`` (the
    selection policies' learning-progress signal)."""
    r = np.asarray(rewards_gn, np.float64)
    return (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)


def gather_groups(batches: list[RolloutBatch], indices_g, valid_g, n: int) -> RolloutBatch:
    """Groups `indices_g` (round-major positions) of the concatenated rounds as one prompt-major
    batch of ``G * n`` rows (NumPy); an invalid group's rows get an all-False loss mask."""
    indices_g, valid_g = np.asarray(indices_g), np.asarray(valid_g, bool)
    rows = (indices_g[:, None] * n + np.arange(n)[None, :]).reshape(-1)
    fields = {}
    for name in _ROW_FIELDS:
        parts = [getattr(b, name) for b in batches]
        if parts[0] is not None:
            fields[name] = np.concatenate([np.asarray(p) for p in parts])[rows]
    fields["loss_mask_bt"] = fields["loss_mask_bt"] & np.repeat(valid_g, n)[:, None]
    return RolloutBatch(group_ids_b=np.repeat(np.arange(len(indices_g)), n).astype(np.int32),
                        completion_len=batches[0].completion_len, **fields)


def _round_metrics(per_round: list[dict]) -> dict[str, float]:
    """Rollout metrics over every sampled row of every round: means of the rounds' means (equal
    round sizes), sums of the counts."""
    out = {}
    for key in per_round[0]:
        values = [float(m[key]) for m in per_round]
        out[key] = float(np.sum(values) if key in _SUMMED else np.mean(values))
    return out


@dataclasses.dataclass
class _Rounds:
    """What a step's sampling rounds produced: their batches (on the host), draws and rollout
    metrics, the first round's preview, and the resampler that decided when to stop (or None)."""

    batches: list
    drawn: list
    rollout_metrics: list
    preview: Any
    resampler: RoundResampler | None


class HostBatcher:
    """One host-steered iteration (module doc): `step(state, key) -> (state, metrics, preview)`."""

    def __init__(self, sampler: MixtureSampler, stages, *, num_groups: int, num_samples: int,
                 rounds: Rounds, replay: ReplayBuffer | None = None, replay_fraction: float = 0.0,
                 correct_threshold: float = 1.0):
        self.sampler, self.stages = sampler, stages  # rljax.stages.iteration.Stages
        self.num_groups, self.n, self.rounds = num_groups, num_samples, rounds
        self.replay, self.replay_fraction, self.correct_threshold = replay, replay_fraction, correct_threshold
        self.last_task_ids_g: np.ndarray | None = None  # the groups the update saw, for tests and logs

    def step(self, state, key) -> tuple[Any, dict[str, float], Any]:
        rounds = self._sample_rounds(state, key)
        batches, drawn_all, rs = rounds.batches, rounds.drawn, rounds.resampler
        task_ids_s = np.concatenate([d.task_ids_b for d in drawn_all])  # every sampled group
        prompt_ids_s = sum((d.prompt_ids for d in drawn_all), ())
        rewards_sn = np.concatenate([np.asarray(b.rewards_b) for b in batches]).reshape(-1, self.n)
        if rs is None:
            indices_g, valid_g, spend = np.arange(self.num_groups), np.ones(self.num_groups, bool), {}
        else:
            sel = rs.result()
            indices_g, valid_g, spend = sel.indices_g, sel.valid_g, sel.spend.metrics()
        batch = gather_groups(batches, indices_g, valid_g, self.n)
        batch, replay_m = self._replay(batch, [prompt_ids_s[i] for i in indices_g])
        state, train_metrics = self.stages.update(state, batch, key)
        self.sampler.observe(task_ids_s, group_stats(rewards_sn, host_advantages(rewards_sn), prompt_ids_s,
                                                     self.correct_threshold))
        self.last_task_ids_g = task_ids_s[indices_g]
        metrics = merge_metrics(_round_metrics(rounds.rollout_metrics), spend, task_metrics(
            self.sampler.names, task_ids_s, rewards_sn, self.correct_threshold),
            self._selection_metrics([d.metrics for d in drawn_all]), replay_m,
            {k: float(v) for k, v in jax.device_get(train_metrics).items()})
        return state, metrics, rounds.preview

    def _sample_rounds(self, state, key) -> _Rounds:
        """One round of `round_size` prompts, or (resampling) rounds until `num_groups` groups have
        reward variance or `max_rounds` ran; round r samples with fold_in(key, r) (round 0: key)."""
        rs = RoundResampler(num_groups=self.num_groups, round_size=self.rounds.round_size,
                            max_rounds=self.rounds.max_rounds) if self.rounds.filter else None
        out = _Rounds([], [], [], None, rs)
        while True:
            drawn = self.sampler.draw(self.rounds.round_size)
            p = drawn.prompts
            k_round = key if not out.batches else jax.random.fold_in(key, len(out.batches))
            batch_r, metrics_r, preview_r = self.stages.sample(state, p.tokens_bt, p.mask_bt,
                                                               p.indices_b.astype(np.int32), k_round)
            batch_r = jax.device_get(batch_r)
            out.batches.append(batch_r)
            out.drawn.append(drawn)
            out.rollout_metrics.append(jax.device_get(metrics_r))
            out.preview = preview_r if out.preview is None else out.preview
            if rs is None:
                return out
            baseline_r = None if batch_r.baseline_rewards_b is None else np.asarray(batch_r.baseline_rewards_b)[::self.n]
            rs.add_round(np.asarray(batch_r.rewards_b).reshape(-1, self.n), baseline_r)
            if rs.done:
                return out

    def _replay(self, batch: RolloutBatch, prompt_ids_g: list) -> tuple[RolloutBatch, dict]:
        """Replayed successes mixed into the all-failed groups; the fresh groups stored."""
        if self.replay is None:
            return batch, {}
        mixed = mix_into_batch(batch, self.replay, prompt_ids_g=prompt_ids_g, fraction=self.replay_fraction)
        self.replay.add(prompt_ids_g, batch.tokens_bt, batch.attn_mask_bt, batch.loss_mask_bt,
                        batch.sampler_logp_bt, batch.rewards_b, routes_btlk=batch.routes_btlk)
        return mixed.batch, {**mixed.metrics, **self.replay.metrics()}

    def _selection_metrics(self, selection_m: list[dict]) -> dict[str, float]:
        selection = {k: float(np.mean([m[k] for m in selection_m])) for k in selection_m[0]}
        selection["selection/band_rejected"] = float(sum(m["selection/band_rejected"] for m in selection_m))
        selection.update({f"selection/{name}/samples_total": float(v)
                          for name, v in zip(self.sampler.names, self.sampler.samples_total)})
        return selection


class HostDataState:
    """The checkpoint's `data_state` of a host-steered run, with the data iterator's
    `get_state`/`set_state`: the sampler's JSON (selection state, stream positions, samples per
    task) and the replay buffer, its arrays as base64 `.npy` (exact, and the JSON stays one
    file; the arrays are capacity x row length, small next to the params)."""

    def __init__(self, sampler: MixtureSampler, replay: ReplayBuffer | None = None):
        self.sampler, self.replay = sampler, replay

    def get_state(self) -> dict:
        state = {"mixture": self.sampler.state_dict()}
        if self.replay is not None:
            state["replay"] = {k: encode_array(v) if isinstance(v, np.ndarray) else v
                               for k, v in self.replay.state_dict().items()}
        return state

    def set_state(self, state: dict) -> None:
        if "mixture" not in state:
            raise CheckpointError("the checkpoint holds a single-source data state but the config is a mixture "
                                  "(or uses resampling or replay); resume with the run's own config")
        self.sampler.load_state(state["mixture"])
        if self.replay is not None:
            if "replay" not in state:
                raise CheckpointError("the checkpoint has no replay buffer; resume with rl.replay.capacity=0 "
                                      "or start a new run")
            self.replay.load_state_dict({k: decode_array(v) if k in _REPLAY_ARRAYS else v
                                         for k, v in state["replay"].items()})


class HostDriver(Driver):
    """The host-steered iteration as a driver: `HostBatcher.step` with key fold_in(loop key, it);
    its prompt source is the mixture's host state (`HostDataState`)."""

    def __init__(self, batcher: HostBatcher, callback, data: HostDataState, loop_key: jax.Array):
        super().__init__()
        self.batcher, self.callback, self.data, self._key = batcher, callback, data, loop_key

    def step(self, state, it: int):
        return self.batcher.step(state, jax.random.fold_in(self._key, it))


def build_host(run, template) -> HostDriver:
    """A mixture, a selection policy, resampling or replay: sample -> host -> update, one process."""
    if jax.process_count() > 1:
        raise ConfigError("a mixture, selection policy, rl.resample_round_size or rl.replay runs in one process "
                          "for now; use a single source without resampling or replay across processes")
    cfg = run.cfg
    callback = as_callback(run.reward_fn, run.tokenizer, run.sampler.table)  # grows with fresh questions
    rounds = Rounds.from_config(cfg.rl)
    stages = make_stages(run.controls, callback, template, num_prompts=rounds.round_size,
                         trainer=run.trainer_layout, sampler=run.sampler_layout)
    batcher = HostBatcher(run.sampler, stages, num_groups=cfg.rl.prompts_per_iteration,
                          num_samples=cfg.sampling.num_samples, rounds=rounds, replay=run.replay,
                          replay_fraction=cfg.rl.replay.fraction)
    return HostDriver(batcher, callback, HostDataState(run.sampler, run.replay), run.keys["loop"])
