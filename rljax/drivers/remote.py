"""`rl.mode = "async"` across processes (`mesh.sampler_processes = k`): the last k processes are
sampler hosts, the others trainer hosts (ReaLHF's disjoint device groups, Mei et al., 2024, on
whole hosts; AReaL's bounded staleness, Fu et al., 2025).

Each side builds its mesh from its own process's devices only, and no program spans the two:
jax.distributed serves the process ids and the key-value store, and `rljax.sharding.transport`
moves the bytes (XLA's transfer server: device buffers to device buffers).

    trainer (process 0):  publish("weights", v0)
                          for it:  item = get("rollouts/{j % k}", n_j)  ->  fresh_rows  ->  update
                                   publish("weights", it + 1, readers=samplers)
    sampler s of k:       for j = s, s + k, ... (>= the trainer's first index j0):
                              params = newest "weights" with version >= admission bound
                              sample + verify (the stage program, on this host's mesh)
                              put("rollouts/s", n, {sample, version_b, index, seconds})
                              (at most rl.queue_batches ahead of what the trainer consumed)

Batch j is the j-th batch of the one seeded data stream (every sampler host reads the whole
stream and keeps every k-th batch) sampled with key fold_in(loop key, j), as in `AsyncDriver`;
the trainer takes the batches in index order (round-robin over the channels), so a run depends
only on the seed and on which version each batch was sampled with.

The admission rule is `AsyncDriver`'s: batch j (trained at iteration v0 + (j - j0) - skipped)
starts only once the sampler holds a version >= that iteration - eta; the trainer writes its
skip count to the store so the bound falls with each skipped batch.

Stopping: the trainer writes a stop key when it leaves (success, error or Ctrl-C); a sampler
checks it at every wait. The trainer's waits have the transport's deadline
(`mesh.transport_timeout_s`; a sampler's first batch, which includes its compile, gets
`FIRST_BATCH_TIMEOUT_S`), so a dead sampler stops the trainer with `TransportTimeout`. The
samplers' waits have none (the trainer may be busy for long: compiles, evaluation,
checkpoints); a killed trainer takes the store with it (the coordinator runs in process 0),
which ends them at once.
A resumed run starts with empty queues (the store is new): the samplers restart at the
trainer's next index j0, and the first step reports `async/restarted_queue`.

Only one trainer process for now: several would need their update to span processes (a global
trainer mesh), which the local-meshes-only design here leaves for a later step.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.sharding import abstract_like
from rljax.sharding.transport import Transport, TransportTimeout
from rljax.sharding.placement import Roles
from rljax.stages.iteration import merge_metrics
from rljax.drivers.base import Driver
from rljax.drivers.overlap import OverlapPrograms, TakenBatch
from rljax.drivers.queue import fresh_rows
from rljax.update import TrainState

WEIGHTS = "weights"
_KEYS = "rljax/remote"
STOP_KEY = f"{_KEYS}/stop"
START_KEY = f"{_KEYS}/start"  # "j0:v0": the trainer's first batch index and policy version
SKIPPED_KEY = f"{_KEYS}/skipped"
_POLL_S = 0.002
FIRST_BATCH_TIMEOUT_S = 900.0  # the wait for each sampler's first batch, which includes its compile


class SamplerLost(RuntimeError):
    """A sampler host's connection broke mid-transfer (the process died)."""


def rollout_channel(sampler: int) -> str:
    return f"rollouts/{sampler}"


@jax.jit
def _drop_rows(batch, keep_b):
    """The stale rows out of the loss (mask zeroed), so shapes stay static."""
    return batch.replace(loss_mask_bt=batch.loss_mask_bt & keep_b[:, None])


def _item_like(programs: OverlapPrograms, sampler_params, rows: int, num_prompts: int, prompt_len: int):
    """The rollout item's shapes, placed on the trainer's mesh: the pull writes into these."""
    rep = programs.replicated
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=rep)  # noqa: E731
    return {"sample": programs.sample_template(sampler_params, num_prompts, prompt_len),
            "version_b": jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=rep), "index": scalar(jnp.int32),
            "sample_s": scalar(jnp.float32), "pull_s": scalar(jnp.float32), "verify_s": scalar(jnp.float32)}


def sampler_params_like(programs: OverlapPrograms, state: TrainState):
    return abstract_like(jax.eval_shape(TrainState.sampler_params, state), programs.sampler_params_shardings)


# ----------------------------------------------------------------------------- trainer host


class RemoteDriver(Driver):
    """The trainer host's side: `AsyncDriver`'s interface (`step`, `checkpoint_extra`,
    `restore_extra`, `close`, `data_lock`) over the transport instead of a thread and a queue."""

    resume_note = "async: the batches in flight at the checkpoint are dropped; the rollout queue restarts empty"

    def __init__(self, programs: OverlapPrograms, loop_key: jax.Array, cfg, state: TrainState,
                 *, num_prompts: int, transport: Transport | None = None, data=None, callback=None):
        super().__init__()
        self.data, self.callback = data, callback
        self.programs, self._keys = programs, programs.keys(loop_key)
        self.roles = Roles.from_mesh(cfg.mesh)
        self.max_staleness = cfg.rl.max_staleness
        rows = cfg.rl.prompts_per_iteration * cfg.sampling.num_samples
        self._like = _item_like(programs, sampler_params_like(programs, state), rows, num_prompts,
                                cfg.data.max_prompt_tokens)
        self._transport = transport or Transport.start(timeout_s=cfg.mesh.transport_timeout_s)
        self.next_index = 0  # the next batch index j to take
        self.restarted = False
        self.taken: collections.deque[TakenBatch] = collections.deque(maxlen=4096)
        self._taken_per_channel = [0] * len(self.roles.samplers)
        self._skipped = 0
        self._started = False
        self._peer_lost = False
        self._last_end: float | None = None

    def _publish(self, state: TrainState, version: int) -> float:
        t0 = time.perf_counter()
        params, _ = self.programs.to_sampler(state)
        self._transport.publish(WEIGHTS, version, params, readers=self.roles.samplers)
        return time.perf_counter() - t0

    def _take(self):
        j = self.next_index
        s = j % len(self.roles.samplers)
        n = self._taken_per_channel[s]
        t, timeout_s = self._transport, self._transport.timeout_s
        if n == 0:  # a sampler's first batch includes compiling its sampling program
            t.timeout_s = max(timeout_s, FIRST_BATCH_TIMEOUT_S)
        try:
            item = t.get(rollout_channel(self.roles.samplers[s]), n, self._like)
        except TransportTimeout:
            self._peer_lost = True
            raise
        except jax.errors.JaxRuntimeError as e:  # the sampler died while its batch was being pulled
            self._peer_lost = True
            raise SamplerLost(f"the connection to sampler process {self.roles.samplers[s]} broke while pulling "
                              f"{rollout_channel(self.roles.samplers[s])} item {n}: the process died; check its log "
                              f"({str(e).splitlines()[0]})") from None
        finally:
            t.timeout_s = timeout_s
        self._taken_per_channel[s] += 1
        self.next_index += 1
        got = int(item["index"])
        if got != j:
            raise RuntimeError(f"sampler {self.roles.samplers[s]} sent batch {got} where batch {j} was due")
        return item

    def step(self, state: TrainState, it: int):
        t = self._transport
        if not self._started:
            t.store.key_value_set(START_KEY, f"{self.next_index}:{it}", allow_overwrite=True)
            self._publish(state, it)
            self._started = True
        start = time.perf_counter() if self._last_end is None else self._last_end
        dropped = skipped = 0
        wait_s = 0.0
        while True:
            t0 = time.perf_counter()
            item = self._take()
            wait_s += time.perf_counter() - t0
            version_b = np.asarray(item["version_b"])
            keep_b, staleness_b = fresh_rows(version_b, it, self.max_staleness)
            dropped += int((~keep_b).sum())
            self.taken.append(TakenBatch(int(item["index"]), it, staleness_b, keep_b))
            if keep_b.any():
                break
            skipped += 1
            self._skipped += 1
            t.store.key_value_set(SKIPPED_KEY, str(self._skipped), allow_overwrite=True)
        batch, rollout_metrics, preview = item["sample"]
        batch = self.programs.to_trainer(batch)
        if not keep_b.all():
            batch = _drop_rows(batch, jax.device_put(keep_b, self.programs.batch_sharding))
        t0 = time.perf_counter()
        state, train_metrics = self.programs.update(state, batch, self._keys.update(int(item["index"])))
        jax.block_until_ready((state, train_metrics))
        update_s = time.perf_counter() - t0
        sync_s = self._publish(state, it + 1)
        end = time.perf_counter()
        wall, self._last_end = end - start, end
        kept = staleness_b[keep_b]
        metrics = {"async/staleness_mean": float(kept.mean()), "async/staleness_max": float(kept.max()),
                   "async/dropped_rows": float(dropped), "async/skipped_batches": float(skipped),
                   "async/queue_depth": float(self._queue_depth()), "async/restarted_queue": float(self.restarted),
                   "time/weight_sync_s": sync_s, "time/weight_pull_s": float(item["pull_s"]),
                   "time/update_s": update_s, "time/sample_s": float(item["sample_s"]),
                   "time/rollout_wait_s": wait_s, "time/sampler_verify_s": float(item["verify_s"]),
                   "time/trainer_busy_frac": (update_s + sync_s) / wall,
                   "time/sampler_busy_frac": min(1.0, float(item["sample_s"]) / wall)}
        self.restarted = False
        return state, merge_metrics(rollout_metrics, train_metrics, metrics), preview

    def _queue_depth(self) -> int:
        """Batches put but not yet taken, over all sampler hosts (the transport's item keys)."""
        depth = 0
        for s, process in enumerate(self.roles.samplers):
            n = self._taken_per_channel[s]
            while _try(self._transport, f"rljax/transport/{rollout_channel(process)}/item/{n}") is not None:
                depth, n = depth + 1, n + 1
        return depth

    def checkpoint_extra(self) -> dict:
        return {"next_index": jnp.asarray(self.next_index, jnp.int32)}

    def restore_target(self, template: TrainState) -> dict:
        return {"next_index": jax.ShapeDtypeStruct((), np.int32, sharding=self.programs.replicated)}

    def restore_extra(self, extra: dict) -> None:
        self.next_index = int(extra["next_index"])
        self.restarted = True

    def close(self) -> None:
        """Tells the sampler hosts to stop (they check at every wait). After a sampler host went
        silent, this process also leaves jax.distributed without its shutdown barrier: at exit the
        barrier would wait for the dead process's heartbeat timeout (100 s) and then abort."""
        self._transport.store.key_value_set(STOP_KEY, "1", allow_overwrite=True)
        if self._peer_lost:
            _leave_without_barrier()


def _leave_without_barrier() -> None:
    from jax._src import distributed  # the public API has no shutdown without the barrier

    distributed.global_state.preemption_sync_manager = None
    distributed.global_state.client = None  # its shutdown() is the barrier; the service stops alone


# ----------------------------------------------------------------------------- sampler host


class _Stop(Exception):
    """The trainer wrote the stop key."""


@dataclasses.dataclass
class RemoteSampler:
    """A sampler host's producer loop (see the module docstring)."""

    programs: OverlapPrograms
    prompts_sharding: Any
    params_like: Any
    prompt_stream: Any  # iterator of PromptBatch, the whole seeded stream
    transport: Transport
    roles: Roles
    loop_key: jax.Array
    max_staleness: int
    queue_batches: int
    wait_for_fresh: bool
    rows: int
    callback: Any = None
    log: Any = print

    def _stopped(self) -> bool:
        return _try(self.transport, STOP_KEY) is not None

    def _wait(self, ready):
        """Polls `ready()` until it returns something not None; raises _Stop on the stop key.

        No deadline: every wait here is on the trainer, which may legitimately be busy for long
        (its warm start, compiles, evaluation, checkpoints). A trainer that fails or is
        interrupted writes the stop key on its way out, and one that is killed takes the store
        with it (the coordinator runs in process 0), which `_try` raises at once."""
        while True:
            value = ready()
            if value is not None:
                return value
            if self._stopped():
                raise _Stop
            time.sleep(_POLL_S)

    def _pull(self):
        """The newest weights when the trainer published newer ones than this host holds (else
        None); `_pull_s` sums the seconds of the pulls since the last batch."""
        t0 = time.perf_counter()
        newer = self.transport.latest(WEIGHTS, self.params_like)
        if newer is not None:
            self._pull_s += time.perf_counter() - t0
        return newer

    def run(self) -> int:
        """Produces until the trainer says stop; returns how many batches it put."""
        try:
            return self._produce()
        except _Stop:
            return self._put_count

    def _produce(self) -> int:
        t = self.transport
        me = self.roles.samplers.index(self.roles.process)
        k = len(self.roles.samplers)
        channel = rollout_channel(self.roles.process)
        j0, v0 = (int(x) for x in self._wait(lambda: _try(t, START_KEY)).split(":"))
        keys = self.programs.keys(self.loop_key)
        self._put_count = 0
        self._pull_s = 0.0
        version, params = self._wait(self._pull)
        for j, prompts in enumerate(self.prompt_stream):
            if j < j0 or j % k != me:
                continue
            # the queue bound: at most queue_batches put and not yet consumed
            self._wait(lambda: True if self._put_count - t.consumed(channel) < self.queue_batches else None)
            need = lambda: v0 + (j - j0) - int(_try(t, SKIPPED_KEY) or 0) - self.max_staleness  # noqa: E731
            newer = self._pull()
            while newer is None and self.wait_for_fresh and version < need():
                newer = self._wait(self._pull)
                if newer[0] < need():
                    version, params = newer
                    newer = None
            if newer is not None:
                version, params = newer
            arrays = jax.device_put((prompts.tokens_bt, prompts.mask_bt, prompts.indices_b.astype(np.int32)),
                                    self.prompts_sharding)
            t0 = time.perf_counter()
            out = jax.block_until_ready(self.programs.sample(params, *arrays, keys.sample(j)))
            sample_s = time.perf_counter() - t0
            verify_s = self.callback.take_seconds() if self.callback is not None else 0.0
            rep = self.programs.sampler_replicated
            item = {"sample": out, "version_b": jax.device_put(np.full((self.rows,), version, np.int32), rep),
                    **jax.device_put({"index": np.int32(j), "sample_s": np.float32(sample_s),
                                      "pull_s": np.float32(self._pull_s), "verify_s": np.float32(verify_s)}, rep)}
            self._pull_s = 0.0
            t.put(channel, self._put_count, item, consumer=self.roles.trainers[0])
            self._put_count += 1
            if self._stopped():
                break
        return self._put_count


def _try(transport: Transport, key: str) -> str | None:
    """The key's value, None while it is missing; any other store error (the coordinator, which
    lives in trainer process 0, is gone) is raised at once rather than waited out."""
    try:
        return transport.store.key_value_try_get(key)
    except Exception as e:  # noqa: BLE001 - the client raises one error type for every status
        if "NOT_FOUND" in str(e):
            return None
        raise


