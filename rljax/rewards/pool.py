"""A process pool with a hard time limit per task.

`concurrent.futures` cannot stop a task that hangs (a sympy simplification that never ends, a
regex that backtracks forever), so this pool owns its workers: each runs one task at a time, and a
worker whose task passes its deadline is killed (SIGKILL) and replaced. The task scores 0 with a
``"timeout"`` flag; a task that raises, or whose worker dies, gets an ``"error"`` flag. Training
never waits on one task longer than that task's limit.

Workers start with the ``spawn`` method: the parent may hold JAX's threads, which ``fork`` would
copy in a broken state. Scripts that use the pool therefore need an ``if __name__ == "__main__":``
guard, as with any spawn-based multiprocessing.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import threading
import time
from typing import Any, Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Task:
    """``fn(*args)`` to run in a worker, killed after ``time_limit_s`` seconds of wall time."""

    fn: Callable[..., Any]
    args: tuple
    time_limit_s: float


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a task produced: ``value`` when ``flag`` is None, else ``flag`` in {"timeout", "error"}."""

    value: Any = None
    flag: str | None = None
    message: str = ""


def default_workers() -> int:
    """One worker per core this process may run on."""
    return max(1, len(os.sched_getaffinity(0)))


# Libraries the verifiers import inside their functions (to keep `import rljax.rewards` light): a
# worker imports them before it reports ready, so no task's time limit pays for them. Left to the
# first `MathAnswer` call in a worker, math-verify's import (0.24 s of CPU, sympy included) took
# 1.2-2.5 s of wall time at load 6-7 on 2 cores, and that call timed out at a 1.5 s limit: in every
# new or respawned worker, an answer could score 0 with a "timeout" flag because the worker was new.
LAZY_DEPENDENCIES = ("math_verify",)


def _import_lazy_dependencies() -> None:
    import importlib

    for name in LAZY_DEPENDENCIES:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional verifier's library: its task reports the error
            pass


def _worker_main(conn: mp_connection.Connection) -> None:
    """Worker loop: announce readiness, then run (fn, args) messages until told to stop."""
    import signal

    import rljax.rewards  # noqa: F401  # import the verifiers once, before the first deadline starts

    _import_lazy_dependencies()

    # Ctrl-C (or a notebook's Interrupt, sent to the whole process group) is for the trainer; an
    # idle worker that died of it would break the pool for the rest of the session.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        fn, args = msg
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001  # a verifier bug must not take the worker down
            reply = ("error", f"{type(e).__name__}: {e}"[:500])
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001  # unpicklable result
            conn.send(("error", f"result could not be sent: {type(e).__name__}: {e}"[:500]))


class _Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.job: tuple[int, float] | None = None  # (task index, deadline)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class VerifierPool:
    """A pool of ``workers`` processes that runs tasks with per-task wall-clock limits.

    ``workers=0`` runs tasks inline in the calling thread, in order, without isolation or time
    limits (for debugging and for measuring the serial cost). The pool is thread-safe: one
    ``run`` at a time.
    """

    def __init__(self, workers: int | None = None) -> None:
        self.workers = default_workers() if workers is None else int(workers)
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        self._ctx = multiprocessing.get_context("spawn")
        self._pool: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def _ensure_started(self) -> None:
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(self._ctx))

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._pool[self._pool.index(worker)] = _Worker(self._ctx)

    def run(self, tasks: Sequence[Task]) -> list[Outcome]:
        """Run every task; returns one `Outcome` per task, in order. Never raises for a task."""
        if self.workers == 0:
            return [_run_inline(t) for t in tasks]
        with self._lock:
            self._ensure_started()
            return self._run_pooled(tasks)

    def _run_pooled(self, tasks: Sequence[Task]) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(tasks)
        pending = collections.deque(range(len(tasks)))
        while pending or any(w.job for w in self._pool):
            for w in self._pool:
                if w.ready and w.job is None and pending:
                    i = pending.popleft()
                    if not w.proc.is_alive():  # died while idle: replace it, retry the task
                        pending.appendleft(i)
                        self._replace(w)
                        continue
                    try:
                        w.conn.send((tasks[i].fn, tasks[i].args))
                    except OSError:  # broken pipe to a dead worker: replace it, retry the task
                        pending.appendleft(i)
                        self._replace(w)
                        continue
                    except Exception as e:  # noqa: BLE001  # unpicklable task
                        results[i] = Outcome(flag="error", message=f"task could not be sent: {e}")
                        continue
                    w.job = (i, time.monotonic() + tasks[i].time_limit_s)
            deadlines = [w.job[1] for w in self._pool if w.job]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0
            live = [w.conn for w in self._pool if w.job or not w.ready]
            ready_conns = mp_connection.wait(live, timeout=wait_s)
            for w in list(self._pool):
                if w.conn in ready_conns:
                    try:
                        kind, value = w.conn.recv()
                    except (EOFError, OSError):
                        if not w.ready:
                            raise RuntimeError("a verifier worker died while starting") from None
                        i = w.job[0]
                        results[i] = Outcome(flag="error", message="worker process died")
                        self._replace(w)
                        continue
                    if kind == "ready":
                        w.ready = True
                        continue
                    i, w.job = w.job[0], None
                    results[i] = (Outcome(value=value) if kind == "ok"
                                  else Outcome(flag="error", message=value))
            now = time.monotonic()
            for w in list(self._pool):
                if w.job and now >= w.job[1]:
                    i = w.job[0]
                    results[i] = Outcome(flag="timeout",
                                         message=f"exceeded {tasks[i].time_limit_s:g} s")
                    self._replace(w)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the workers. Safe to call twice."""
        self._closed = True
        for w in self._pool:
            try:
                w.conn.send(None)
            except Exception:  # noqa: BLE001
                pass
            w.proc.join(timeout=1)
            w.kill()
        self._pool = []

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _run_inline(task: Task) -> Outcome:
    try:
        return Outcome(value=task.fn(*task.args))
    except Exception as e:  # noqa: BLE001
        return Outcome(flag="error", message=f"{type(e).__name__}: {e}"[:500])


_DEFAULT: VerifierPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> VerifierPool:
    """The process-wide pool, sized to the machine, started on first use and closed at exit."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT._closed:
            _DEFAULT = VerifierPool()
            atexit.register(_DEFAULT.close)
        return _DEFAULT
