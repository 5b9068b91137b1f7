"""The data plane between an asynchronous sampler and the trainer: versioned batches, a bounded
queue that never blocks without a timeout, a one-slot params mailbox, and the staleness filter.

    producer:  params, version = mailbox.latest()  ->  sample  ->  queue.put(VersionedBatch)
    trainer:   queue.get()  ->  fresh_rows(version_b, trainer_version, eta)  ->  update
               ->  mailbox.publish(new params, version + 1)

A batch's rows carry the policy version that generated them (`version_b`). With interruptible
rollouts a row's tokens may come from several versions (`version_bc`, -1 where no token); the
row's version is then the oldest of them (`row_versions`), so the staleness bound holds for
every token the loss sees. Rows older than eta versions are dropped (AReaL's bounded staleness,
Fu et al., 2025: "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
Reasoning"); the trainer zeroes their loss mask so shapes stay static.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

POLL_S = 0.05  # how often a waiting side checks the stop event: the bound on shutdown latency


class Stopped(Exception):
    """The other side asked to stop (the run ended, or failed) while this side was waiting."""


@dataclasses.dataclass(frozen=True)
class VersionedBatch:
    """One sampled batch: the sampling program's (RolloutBatch, rollout metrics, preview), the
    policy version of each row, the sample index j (its key is fold_in(loop key, j)), and the
    sampler's seconds on it. An interruptible rollout adds each token's version (`version_bc`,
    -1 where no token) and the number of weight swaps while it was generated."""

    sample: Any
    version_b: np.ndarray  # int32 [rows]
    index: int
    sample_s: float
    version_bc: np.ndarray | None = None  # int32 [rows, max_new_tokens]
    swaps: int = 0


def row_versions(version_bc: np.ndarray, fallback: int) -> np.ndarray:
    """A row's policy version from its tokens' versions: the oldest (min) over tokens >= 0, or
    `fallback` for a row with no token (a filler, which the loss ignores anyway). [B, C] -> [B]."""
    has = version_bc >= 0
    oldest = np.where(has, version_bc, np.iinfo(np.int32).max).min(axis=1)
    return np.where(has.any(axis=1), oldest, fallback).astype(np.int32)


def mixed_version_rows(version_bc: np.ndarray) -> np.ndarray:
    """bool [B]: rows whose tokens (>= 0) came from more than one policy version."""
    has = version_bc >= 0
    newest = np.where(has, version_bc, np.iinfo(np.int32).min).max(axis=1)
    return has.any(axis=1) & (newest != row_versions(version_bc, fallback=0))


def fresh_rows(version_b: np.ndarray, trainer_version: int, max_staleness: int) -> tuple[np.ndarray, np.ndarray]:
    """(keep_b, staleness_b): staleness = trainer version - row version; keep rows with
    staleness <= eta (`max_staleness`)."""
    staleness_b = trainer_version - np.asarray(version_b, np.int64)
    return staleness_b <= max_staleness, staleness_b


class RolloutQueue:
    """A bounded FIFO of `VersionedBatch`es whose waits give up when `stop` is set.

    `put` and `get` wait in slices of POLL_S so that neither side ever blocks past a stop request:
    the producer never hangs on a full queue after the trainer has gone, and the trainer never
    hangs on an empty one after the producer has failed (`get` re-raises the producer's error)."""

    def __init__(self, maxsize: int, stop: threading.Event):
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._stop = stop
        self.error: BaseException | None = None  # set by the producer when it fails

    def put(self, item: VersionedBatch) -> None:
        while True:
            if self._stop.is_set():
                raise Stopped
            try:
                self._queue.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def get(self) -> VersionedBatch:
        while True:
            if self.error is not None:
                raise self.error
            if self._stop.is_set():
                raise Stopped
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def depth(self) -> int:
        return self._queue.qsize()

    def drain(self) -> int:
        """Empties the queue (in-flight batches are dropped) and returns how many it held."""
        n = 0
        while True:
            try:
                self._queue.get_nowait()
                n += 1
            except queue.Empty:
                return n


class ParamsMailbox:
    """One slot holding the latest (sampler params, version): the trainer overwrites, the
    producer reads the newest at the start of each batch (or waits, with timeouts, for a version
    recent enough: AReaL's admission rule)."""

    def __init__(self):
        self._changed = threading.Condition()
        self._slot: tuple[Any, int] | None = None

    def publish(self, params, version: int) -> None:
        with self._changed:
            self._slot = (params, version)
            self._changed.notify_all()

    def latest(self) -> tuple[Any, int]:
        with self._changed:
            assert self._slot is not None, "publish the first params before starting the producer"
            return self._slot

    def wait_for(self, min_version: Callable[[], int], stop: threading.Event) -> tuple[Any, int]:
        """The latest (params, version) once its version is >= `min_version()` (asked again at
        every wake-up: the bound may fall while waiting); raises `Stopped` if `stop` is set first."""
        with self._changed:
            while self._slot is None or self._slot[1] < min_version():
                if stop.is_set():
                    raise Stopped
                self._changed.wait(POLL_S)
            return self._slot


class BusyClock:
    """Busy intervals of one side (the sampler), so the trainer can ask what share of a window
    of its own the sampler spent working: the overlap of the two is the point of the async mode."""

    def __init__(self):
        self._lock = threading.Lock()
        self._done: list[tuple[float, float]] = []
        self._since: float | None = None

    def begin(self) -> None:
        with self._lock:
            self._since = time.perf_counter()

    def end(self) -> None:
        with self._lock:
            self._done.append((self._since, time.perf_counter()))
            self._since = None

    def busy_seconds(self, start: float, stop: float) -> float:
        """Seconds of [start, stop] the side was busy; forgets intervals that ended before start."""
        with self._lock:
            self._done = [(a, b) for a, b in self._done if b > start]
            spans = list(self._done) + ([(self._since, stop)] if self._since is not None else [])
        return sum(max(0.0, min(b, stop) - max(a, start)) for a, b in spans)
