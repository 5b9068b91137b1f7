"""Sampling and training at once, on disjoint device groups (`mesh.sampler_devices`): the
`rl.mode = "one_step_off"` and `"async"` drivers.

Both use `make_stages`' two programs: the sampling program on the sampler's mesh and the update
program on the trainer's. JAX dispatches asynchronously, so a program dispatched on the sampler's
devices runs while one dispatched on the trainer's runs; the host only orders them.

one_step_off (verl's one-step off-policy pipeline; Sheng et al., 2024, "HybridFlow"):

    batch_0 = sample(theta_0, prompts_0)
    for k:  theta_{k+1} = update(theta_k, batch_k)  ||  batch_{k+1} = sample(theta_k, prompts_{k+1})

Both halves of step k are dispatched before either is waited on. Dispatch order fixes every
value, so the same seed gives the same run, and a checkpoint after step k holds the pending
batch k+1 (sampled with theta_k) so a resumed run is the uninterrupted one.

async (AReaL, Fu et al., 2025): a producer thread samples with the newest published params into
a bounded `RolloutQueue`; the trainer takes batches in order, drops rows more than
`rl.max_staleness` versions older than its own (`fresh_rows`; a batch with no fresh row is
skipped), updates, and publishes the new params to the sampler's mesh. The producer is the
only host thread; it waits only with timeouts, and any failure on either side stops both
(`close`). A checkpoint drops the in-flight batches: the resumed queue starts empty.

Partial rollouts (`rl.partial_rollouts`, async only; AReaL's interruptible generation): the
producer samples batch j with `rljax.sampling.interruptible.sample_with_updates`, asking the
mailbox for newer params every `rl.segment_steps` decode steps. When the trainer has published
a newer version mid-generation, unfinished rows keep their tokens, the KV cache is recomputed
under the new params and decoding continues; then the sampling program's scoring half
(`rljax.stages.rollout.rollout_from_samples`, the same io_callback verifier) builds the batch.
Each token's behaviour log-prob is the one it was drawn with (`sampler_logp_bt`), and a row's
version is its oldest token's (`rollout_queue.row_versions`), so eta bounds every token trained.
Without a swap the batch is bitwise the whole-batch program's.

Keys: batch j is sampled with the first half of split(fold_in(loop key, j)) and trained with the
second, as the synchronous iteration splits the key of iteration j.

Metrics per step, besides the stages' own: `time/weight_sync_s` (trainer -> sampler params copy),
`time/sample_s` and `time/update_s` (each program's seconds, timed apart while both run),
`time/sampler_busy_frac` and `time/trainer_busy_frac` (their share of the step's wall time: both
near 1 means full overlap), `async/staleness_mean` / `async/staleness_max` (versions between
the trained rows' policy and the trainer's), and in async `async/dropped_rows`,
`async/skipped_batches`, `async/queue_depth` and `async/restarted_queue` (1 on the first step
after a resume, whose queue started empty), and `async/swaps` (weight swaps while the trained
batch was generated; 0 without partial rollouts) and `async/mixed_version_rows` (its trained rows
whose tokens came from more than one version).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax.drivers.base import Driver
from rljax.sampling.interruptible import sample_with_updates
from rljax.sharding import abstract_like, sync_weights
from rljax.stages.iteration import Stages, merge_metrics
from rljax.drivers.queue import (BusyClock, ParamsMailbox, RolloutQueue, Stopped, VersionedBatch, fresh_rows,
                                       mixed_version_rows, row_versions)
from rljax.update import TrainState

JOIN_TIMEOUT_S = 10.0  # a producer inside a long sampling program leaves once it returns
PromptSource = Callable[[], tuple]  # the next (prompt_tokens_pt, prompt_mask_pt, index_p) on the sampler's mesh


def thread_in_callers_mesh(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread that runs `target` under the calling thread's `jax.set_mesh` mesh. JAX's
    mesh context is per thread, and the run's expert or context mesh (`rljax.sharding.placement`)
    is what the MoE block and the context-parallel forward read: without it the sampler thread
    would trace its programs without the expert-parallel all-to-all, leaving the sharded expert
    weights to XLA's own partitioning (numerically the same, not the dispatch the mesh asks for)."""
    mesh = jax.sharding.get_mesh()

    def run() -> None:
        with jax.set_mesh(mesh):
            target()

    return threading.Thread(target=run, name=name, daemon=True)


@dataclasses.dataclass(frozen=True)
class OverlapPrograms:
    """The stages on the two meshes: `sample(params, tokens, mask, index, key)` on the sampler's,
    `update(state, batch, key)` on the trainer's (state donated), `to_sampler(state) -> (params,
    seconds)` the timed on-device copy of the policy into the sampler's layout, and
    `to_trainer(batch)` the batch's copy onto the trainer's mesh, and `sample_partial(weights,
    tokens, mask, index, key, segment_steps) -> (sample, version_bc, swaps)` the interruptible
    form of `sample` (see the module docstring), polling `weights() -> (params, version)`."""

    sample: Callable
    update: Callable
    to_sampler: Callable
    to_trainer: Callable
    sample_partial: Callable
    sampler_params_shardings: Any
    batch_sharding: Any
    replicated: Any  # the trainer mesh's replicated sharding
    sampler_replicated: Any  # the sampler mesh's

    @classmethod
    def from_stages(cls, stages: Stages) -> "OverlapPrograms":
        p = stages.split
        if p is None:
            raise ValueError("the overlapped modes need make_stages(trainer=..., sampler=...) on two meshes")

        def to_sampler(state: TrainState):
            return sync_weights(jax.block_until_ready(p.to_sampler(state)), p.sampler_params_sh)

        def sample_partial(weights, prompt_tokens_pt, prompt_mask_pt, index_p, key, segment_steps: int):
            prompts = jax.device_put((prompt_tokens_pt, prompt_mask_pt, index_p), p.prompts_sh)
            k_sample, _ = jax.random.split(key)  # as the sampling program splits it
            polled = []  # the params decoding ended with serve a greedy baseline, if the objective needs one

            def weights_seen():
                polled.append(weights())
                return polled[-1]

            out, version_bc, swaps = sample_with_updates(p.model_cfg, prompts[0], prompts[1], k_sample, p.controls,
                                                         segment_steps=segment_steps, weights=weights_seen)
            newest = max(polled, key=lambda pv: pv[1])[0]
            return p.score_jit(newest, out, *prompts, key), version_bc, swaps

        return cls(sample=p.sample_jit, update=p.update_jit, to_sampler=to_sampler, sample_partial=sample_partial,
                   to_trainer=lambda batch: jax.device_put(batch, p.batch_sh),
                   sampler_params_shardings=p.sampler_params_sh, batch_sharding=p.batch_sh,
                   replicated=jax.sharding.NamedSharding(p.batch_sh.mesh, jax.sharding.PartitionSpec()),
                   sampler_replicated=jax.sharding.NamedSharding(p.prompts_sh.mesh, jax.sharding.PartitionSpec()))

    def keys(self, loop_key: jax.Array) -> "StageKeys":
        return StageKeys(jax.device_put(loop_key, self.sampler_replicated), jax.device_put(loop_key, self.replicated))

    def sample_template(self, sampler_params, num_prompts: int, prompt_len: int):
        """The sampling program's output shapes, placed as a restored pending batch is: the batch in
        the trainer's rows layout, metrics and preview replicated on the trainer's mesh."""
        prompts = (jax.ShapeDtypeStruct((num_prompts, prompt_len), jnp.int32),
                   jax.ShapeDtypeStruct((num_prompts, prompt_len), jnp.bool_),
                   jax.ShapeDtypeStruct((num_prompts,), jnp.int32))
        key = jax.eval_shape(lambda: jax.random.key(0))
        batch, metrics, preview = jax.eval_shape(self.sample, sampler_params, *prompts, key)

        def place(tree, sharding):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

        return place(batch, self.batch_sharding), place(metrics, self.replicated), place(preview, self.replicated)


@dataclasses.dataclass(frozen=True)
class StageKeys:
    """fold_in(loop key, j) computed on each side's own devices. A key derived on the trainer's
    device would queue behind the running update there (a device runs its programs in order), and
    the sampling program waiting on it would no longer overlap the update."""

    sampler_root: jax.Array
    trainer_root: jax.Array

    def sample(self, j: int) -> jax.Array:
        return jax.random.fold_in(self.sampler_root, j)

    def update(self, j: int) -> jax.Array:
        return jax.random.fold_in(self.trainer_root, j)


def wait_timed(start: float, **groups) -> dict[str, float]:
    """Waits for every pytree in `groups` and returns each one's seconds from `start` until all
    its arrays were ready (polled every 0.5 ms, so two programs running at once are timed apart).
    Errors raised by a program surface here."""
    pending = {name: [jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
                      for x in jax.tree.leaves(tree)] for name, tree in groups.items()}
    done: dict[str, float] = {}
    while pending:
        for name in [n for n, leaves in pending.items() if all(x.is_ready() for x in leaves)]:
            done[name] = time.perf_counter() - start
            jax.block_until_ready(pending.pop(name))  # re-raises a failed program's error
        if pending:
            time.sleep(5e-4)
    return done


def _mask_rows(batch, keep_b):
    return batch.replace(loss_mask_bt=batch.loss_mask_bt & keep_b[:, None])


_mask_rows_jit = jax.jit(_mask_rows)


class OneStepOff(Driver):
    """`rl.mode = "one_step_off"`: `step(state, it)` trains batch `it` (sampled with theta_{it-1},
    or theta_0 for batch 0) while it samples batch it+1 with theta_it. See the module docstring.
    A checkpoint keeps the pending batch (`restore_target`: the sampling program's output shapes
    for `num_prompts` prompts of `prompt_len` tokens)."""

    def __init__(self, programs: OverlapPrograms, prompts: PromptSource, loop_key: jax.Array, *,
                 data=None, callback=None, num_prompts: int = 0, prompt_len: int = 0):
        super().__init__()
        self.programs, self._prompts, self._keys = programs, prompts, programs.keys(loop_key)
        self.data, self.callback, self._shape = data, callback, (num_prompts, prompt_len)
        self.pending = None  # (batch, rollout metrics, preview) of the next batch to train

    def step(self, state: TrainState, it: int):
        p, keys = self.programs, self._keys
        start = time.perf_counter()
        params, sync_s = p.to_sampler(state)  # theta_it, copied before the update donates it
        fresh = self.pending is None  # batch 0: sampled with theta_it, now
        if fresh:
            self.pending = p.sample(params, *self._prompts(), keys.sample(it))
        batch, rollout_metrics, preview = self.pending
        # The sampler's inputs are ready before the update is dispatched, so nothing it needs waits
        # behind the update; the update goes first because a program with a host callback (the
        # verifier) may run inside its own dispatch call on CPU.
        following = jax.block_until_ready((self._prompts(), keys.sample(it + 1)))
        t_dispatch = time.perf_counter()
        state, train_metrics = p.update(state, p.to_trainer(batch), keys.update(it))
        self.pending = p.sample(params, *following[0], following[1])
        seconds = wait_timed(t_dispatch, update=(state, train_metrics), sample=self.pending)
        wall = time.perf_counter() - start
        staleness = 0.0 if fresh else 1.0  # a pending batch was drawn by theta_{k-1}, trained from theta_k
        timings = {"time/weight_sync_s": sync_s, "time/update_s": seconds["update"],
                   "time/sample_s": seconds["sample"], "time/trainer_busy_frac": seconds["update"] / wall,
                   "time/sampler_busy_frac": seconds["sample"] / wall,
                   "async/staleness_mean": staleness, "async/staleness_max": staleness}
        return state, merge_metrics(rollout_metrics, train_metrics, timings), preview

    def checkpoint_extra(self) -> dict:
        return {"pending": self.pending}

    def restore_target(self, template: TrainState) -> dict:
        params = abstract_like(jax.eval_shape(TrainState.sampler_params, template),
                               self.programs.sampler_params_shardings)
        return {"pending": self.programs.sample_template(params, *self._shape)}

    def restore_extra(self, extra: dict) -> None:
        self.pending = extra["pending"]

    def close(self) -> None:
        self.pending = None


@dataclasses.dataclass(frozen=True)
class TakenBatch:
    """What the trainer did with one batch from the queue (kept for inspection and tests)."""

    index: int
    trainer_version: int
    staleness_b: np.ndarray
    keep_b: np.ndarray
    version_bc: np.ndarray | None = None  # per-token versions (partial rollouts)


class AsyncDriver(Driver):
    """`rl.mode = "async"`: a producer thread fills a bounded queue with versioned batches while
    `step(state, it)` trains on the next batch with fresh rows (see the module docstring).

    Policy version = the number of updates behind the params: the trainer at iteration `it` is
    version `it`, and the params it publishes after its update are version `it + 1`.

    `wait_for_fresh` (`rl.stale_rows = "wait"`) is AReaL's admission rule (Fu et al., 2025):
    the producer starts batch s (the one iteration s will train) only once the published version is
    at least s - eta, so every row is at most eta versions old when trained and none is sampled
    only to be dropped; the sampler is ahead of the trainer by at most eta batches. Without it
    (`"drop"`) the producer never waits except on a full queue, and the trainer drops what
    went stale.

    `segment_steps` > 0 samples with partial rollouts (`rl.partial_rollouts`, polling for new
    params every that many decode steps); 0 samples whole batches with one version."""

    resume_note = "async: the batches in flight at the checkpoint are dropped; the rollout queue restarts empty"

    def __init__(self, programs: OverlapPrograms, prompts: PromptSource, loop_key: jax.Array, *,
                 max_staleness: int, queue_batches: int, rows: int, wait_for_fresh: bool = True,
                 segment_steps: int = 0, data=None, callback=None):
        super().__init__()
        self.programs, self._prompts, self._keys = programs, prompts, programs.keys(loop_key)
        self.data, self.callback = data, callback
        self.max_staleness, self.rows, self.wait_for_fresh = max_staleness, rows, wait_for_fresh
        self.segment_steps = segment_steps
        self._stop = threading.Event()
        self.queue = RolloutQueue(queue_batches, self._stop)
        self._mailbox = ParamsMailbox()
        self._clock = BusyClock()
        self.next_index = 0  # the next sample index j
        self.restarted = False
        self.taken: collections.deque[TakenBatch] = collections.deque(maxlen=4096)
        self._first_version = self._started = self._skipped = 0
        self._thread: threading.Thread | None = None
        self._last_end: float | None = None

    # ------------------------------------------------------------------ producer

    def start(self, state: TrainState, version: int) -> None:
        params, _ = self.programs.to_sampler(state)
        self._mailbox.publish(params, version)
        self._first_version = version
        self._thread = thread_in_callers_mesh(self._produce, "rljax-async-sampler")
        self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                if self.wait_for_fresh:  # AReaL's admission rule: batch s starts once version >= s - eta
                    params, version = self._mailbox.wait_for(self._admission_version, self._stop)
                else:
                    params, version = self._mailbox.latest()
                self._started += 1
                with self.data_lock:
                    prompts, j = self._prompts(), self.next_index
                    self.next_index += 1
                self._clock.begin()
                t0 = time.perf_counter()
                try:
                    item = self._sample(params, version, prompts, j)
                finally:
                    self._clock.end()
                self.queue.put(dataclasses.replace(item, sample_s=time.perf_counter() - t0))
        except Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which re-raises it
            self.queue.error = e

    def _sample(self, params, version: int, prompts, j: int) -> VersionedBatch:
        """Batch j, sampled whole with `params` (version `version`), or as a partial rollout that
        starts with them and takes up newer ones (`poll_weights`) between segments."""
        key = self._keys.sample(j)
        if not self.segment_steps:
            out = jax.block_until_ready(self.programs.sample(params, *prompts, key))
            return VersionedBatch(out, self.row_versions(out, version), j, 0.0)
        polls = itertools.count()

        def weights():
            n = next(polls)
            if self._stop.is_set():  # leave within one segment when the run stops
                raise Stopped
            return (params, version) if n == 0 else self.poll_weights(j, n)

        out, version_bc, swaps = self.programs.sample_partial(weights, *prompts, key, self.segment_steps)
        version_bc = np.asarray(jax.device_get(version_bc))
        out = jax.block_until_ready(out)
        return VersionedBatch(out, row_versions(version_bc, version), j, 0.0, version_bc, swaps)

    def poll_weights(self, j: int, poll: int) -> tuple[Any, int]:
        """The (sampler params, version) a partial rollout of batch j continues with, asked before
        its `poll`-th segment (poll >= 1; poll 0 is the version the batch started with): the newest
        published. A seam for tests and schedulers (`wait_for_version` forces a swap)."""
        del j, poll
        return self._mailbox.latest()

    def wait_for_version(self, version: int) -> tuple[Any, int]:
        """The newest (params, version) once the trainer has published `version` (raises
        `Stopped` if the run stops first)."""
        return self._mailbox.wait_for(lambda: version, self._stop)

    def row_versions(self, sample, version: int) -> np.ndarray:
        """Each row's policy version, int32 [rows], of a batch sampled whole: the version it was
        sampled with. A partial rollout's rows take their oldest token's version instead
        (`rljax.drivers.queue.row_versions` of `version_bc`)."""
        del sample
        return np.full((self.rows,), version, np.int32)

    def _admission_version(self) -> int:
        """The oldest version the next batch may be sampled with: it will be trained at iteration
        s = first version + batches started - batches skipped (a skip moves every later batch one
        iteration earlier, so the bound falls and the producer can never wait on a trainer that
        waits on it)."""
        return self._first_version + self._started - self._skipped - self.max_staleness

    # ------------------------------------------------------------------ trainer

    def step(self, state: TrainState, it: int):
        if self._thread is None:
            self.start(state, it)
        start = time.perf_counter() if self._last_end is None else self._last_end
        dropped = skipped = 0
        while True:
            item = self.queue.get()
            keep_b, staleness_b = fresh_rows(item.version_b, it, self.max_staleness)
            dropped += int((~keep_b).sum())
            self.taken.append(TakenBatch(item.index, it, staleness_b, keep_b, item.version_bc))
            if keep_b.any():
                break
            skipped += 1
            self._skipped += 1  # only this thread writes it; the producer reads it
        depth = self.queue.depth()
        batch, rollout_metrics, preview = item.sample
        batch = self.programs.to_trainer(batch)
        if not keep_b.all():
            batch = _mask_rows_jit(batch, jax.device_put(keep_b, self.programs.batch_sharding))
        t0 = time.perf_counter()
        state, train_metrics = self.programs.update(state, batch, self._keys.update(item.index))
        jax.block_until_ready((state, train_metrics))
        update_s = time.perf_counter() - t0
        params, sync_s = self.programs.to_sampler(state)
        self._mailbox.publish(params, it + 1)
        end = time.perf_counter()
        wall = end - start
        self._last_end = end
        kept = staleness_b[keep_b]
        mixed = 0 if item.version_bc is None else int((mixed_version_rows(item.version_bc) & keep_b).sum())
        metrics = {"async/staleness_mean": float(kept.mean()), "async/staleness_max": float(kept.max()),
                   "async/dropped_rows": float(dropped), "async/skipped_batches": float(skipped),
                   "async/queue_depth": float(depth), "async/restarted_queue": float(self.restarted),
                   "async/swaps": float(item.swaps), "async/mixed_version_rows": float(mixed),
                   "time/weight_sync_s": sync_s, "time/update_s": update_s, "time/sample_s": item.sample_s,
                   "time/trainer_busy_frac": (update_s + sync_s) / wall,
                   "time/sampler_busy_frac": self._clock.busy_seconds(start, end) / wall}
        self.restarted = False
        return state, merge_metrics(rollout_metrics, train_metrics, metrics), preview

    # ------------------------------------------------------------------ checkpoints and shutdown

    def checkpoint_extra(self) -> dict:
        """The next sample index (read under `data_lock`, with the data state: `Driver.checkpoint`)."""
        return {"next_index": jnp.asarray(self.next_index, jnp.int32)}

    def restore_target(self, template: TrainState) -> dict:
        return {"next_index": jax.ShapeDtypeStruct((), np.int32, sharding=self.programs.replicated)}

    def restore_extra(self, extra: dict) -> None:
        """A resumed run: keys continue after the last drawn batch; the queue starts empty (its
        batches, and the one being sampled at the save, are dropped), which the first step reports
        as `async/restarted_queue`."""
        self.next_index = int(extra["next_index"])
        self.restarted = True

    def close(self) -> None:
        """Stops the producer (at its next wait, or once its sampling program returns), drops the
        queued batches and joins the thread."""
        self._stop.set()
        self.queue.drain()
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)
            if self._thread.is_alive():  # a warning, not an error: close() runs in `finally`, where an
                # exception would hide the one that stopped the run; the daemon thread cannot block exit
                warnings.warn(f"the async sampler thread did not stop within {JOIN_TIMEOUT_S} s", RuntimeWarning)
            self._thread = None


