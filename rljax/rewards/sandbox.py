"""Run model-written Python against unit tests, in a separate, locked-down process.

Code rewards score the fraction of unit tests passed (AceReason-Nemotron, 2025; Absolute Zero,
2025). The code never runs in the caller's process. Each run is a fresh ``python -I`` process with:

- its own session and process group (it cannot signal ours; the whole group is SIGKILLed at the
  wall-clock limit or when stdout passes its cap);
- network, PID and mount namespaces where the kernel allows (no network; its forks die with it;
  the parent's PID is not visible);
- user ``nobody`` when we are root, so it cannot write our files or read ``/proc/<pid>/environ``;
- RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, a fresh temp dir as cwd, a scrubbed
  environment, and an audit hook that refuses sockets, process creation, signals and writes
  outside the temp dir (see ``_sandbox_child.py``).

``info["isolation"]`` lists the layers the kernel granted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from rljax.errors import DataError

_HERE = Path(__file__).parent
_LAUNCHER = _HERE / "_sandbox_launch.py"
_HARNESS_TEXT = (_HERE / "_sandbox_child.py").read_text()
_NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-process limits; ``total_s`` bounds a whole `run_code` call (all its processes)."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    file_mb: int = 8
    nproc: int = 64  # per uid: binds only after dropping root to nobody
    output_bytes: int = 1 << 16
    total_s: float = 20.0

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "file_mb", "nproc", "output_bytes", "total_s"):
            if getattr(self, name) <= 0:
                raise DataError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class _Run:
    stdout: bytes
    stderr: bytes
    returncode: int
    flag: str | None  # "timeout" | "output_limit" | None
    isolation: tuple[str, ...]


def _run_process(root: str, work: str, mode: str, stdin: bytes, limits: SandboxLimits,
                 wall_s: float) -> _Run:
    cfg = {"root": root, "work": work, "mode": mode, "harness": os.path.join(root, "harness.py"),
           "limits": {"cpu_s": limits.cpu_s, "as_bytes": limits.memory_mb << 20,
                      "file_bytes": limits.file_mb << 20, "nproc": limits.nproc}}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-B", str(_LAUNCHER), json.dumps(cfg)], cwd=work,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True)

    def feed() -> None:
        try:
            proc.stdin.write(stdin)
            proc.stdin.close()
        except OSError:
            pass  # the child exited or closed stdin: its loss

    threading.Thread(target=feed, daemon=True).start()
    out, err, flag = bytearray(), bytearray(), None
    deadline = time.monotonic() + wall_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                flag = "timeout"
                break
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(key.data) > limits.output_bytes:
                    flag = "output_limit"
            if flag:
                break
    if flag is None:  # pipes closed: the child is done; collect the launcher's relayed status
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            flag = "timeout"
    _kill_group(proc)
    proc.stdout.close()
    proc.stderr.close()
    first, _, rest = bytes(err).partition(b"\n")
    isolation = tuple(first.decode(errors="replace").removeprefix("rljax-sandbox: ").split(","))
    if flag is None and proc.returncode > 128:  # the launcher relays 128 + the signal that killed it
        flag = f"killed:signal {proc.returncode - 128}"
    return _Run(bytes(out[:limits.output_bytes]), rest[:4096], proc.returncode, flag,
                tuple(i for i in isolation if i))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _normalize(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def run_code(code: str, tests: Sequence[str] | Sequence[Mapping[str, str]],
             limits: SandboxLimits = SandboxLimits()) -> tuple[float, dict]:
    """Runs ``code`` against ``tests`` in the sandbox; returns ``(fraction passed, info)``.

    ``tests`` is either assert-style snippets (``["assert f(2) == 4", ...]``, run after the code in
    one process) or stdin/stdout cases (``[{"input": "1 2\\n", "output": "3"}, ...]``, one process
    each; a case passes when the exit status is 0 and the output matches line by line, trailing
    whitespace ignored). ``info``: ``passed``, ``total``, ``results`` (bool per test), ``flags``
    (``"timeout"``/``"output_limit"``/``"budget"`` events) and ``isolation``.
    """
    tests = list(tests)
    if not tests:
        raise DataError("run_code needs at least one test; got an empty list")
    asserts = all(isinstance(t, str) for t in tests)
    if not asserts and not all(isinstance(t, Mapping) and {"input", "output"} <= set(t)
                               for t in tests):
        raise DataError("tests must be all assert strings or all {'input', 'output'} dicts")
    with _sandbox_dirs() as (root, work):
        if asserts:
            results, flags, isolation = _run_asserts(root, work, code, tests, limits)
        else:
            results, flags, isolation = _run_io(root, work, code, tests, limits)
    passed = sum(results)
    return passed / len(tests), {"passed": passed, "total": len(tests), "results": results,
                                 "flags": flags, "isolation": list(isolation)}


@dataclasses.dataclass(frozen=True)
class ProgramRun:
    """What one sandboxed program did: its stdout (cut at ``output_bytes``), exit status, and the
    flag that stopped it (``"timeout"``, ``"output_limit"``, ``"killed:signal N"``) or None."""

    stdout: str
    returncode: int
    flag: str | None
    isolation: tuple[str, ...]


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> ProgramRun:
    """Runs ``code`` as ``__main__`` in the sandbox once, with ``stdin``; returns its output.

    For tools that show the program's output to a model (``rljax.envs``' Python tool), where
    `run_code` only says which tests passed. Same process, limits and audit hook as `run_code`;
    the exit status is 1 when the program raised, and then the harness neither prints a traceback
    nor flushes stdout: code that wants its output and errors seen catches and flushes them itself.
    """
    with _sandbox_dirs() as (root, work):
        solution = Path(work, "solution.py")
        solution.write_text(code)
        if os.getuid() == 0:
            os.chown(solution, _NOBODY, _NOBODY)
        run = _run_process(root, work, "io", stdin.encode(), limits, min(limits.wall_s, limits.total_s))
    return ProgramRun(run.stdout.decode(errors="replace"), run.returncode, run.flag, run.isolation)


@contextlib.contextmanager
def _sandbox_dirs() -> Iterator[tuple[str, str]]:
    """A fresh sandbox root holding the harness and an empty work dir (owned by nobody when we are
    root), removed afterwards."""
    root = tempfile.mkdtemp(prefix="rljax-sandbox-")
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        os.mkdir(os.path.join(root, "python"))
        Path(root, "harness.py").write_text(_HARNESS_TEXT)
        os.chmod(root, 0o755)
        if os.getuid() == 0:
            os.chown(work, _NOBODY, _NOBODY)
        yield root, work
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_asserts(root: str, work: str, code: str, tests: list[str],
                 limits: SandboxLimits) -> tuple[list[bool], list[str], tuple[str, ...]]:
    nonce = secrets.token_hex(16)
    payload = json.dumps({"nonce": nonce, "code": code, "tests": tests}).encode() + b"\n"
    run = _run_process(root, work, "asserts", payload, limits, min(limits.wall_s, limits.total_s))
    passed = set()
    for line in run.stdout.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[2] == "pass" and parts[1].isdigit():
            passed.add(int(parts[1]))
    return [i in passed for i in range(len(tests))], [run.flag] if run.flag else [], run.isolation


def _run_io(root: str, work: str, code: str, tests: list[Mapping[str, str]],
            limits: SandboxLimits) -> tuple[list[bool], list[str], tuple[str, ...]]:
    solution = Path(work, "solution.py")
    solution.write_text(code)
    if os.getuid() == 0:
        os.chown(solution, _NOBODY, _NOBODY)
    results, flags, isolation = [], [], ()
    budget_end = time.monotonic() + limits.total_s
    for case in tests:
        left = budget_end - time.monotonic()
        if left <= 0:
            results.append(False)
            flags.append("budget")
            continue
        run = _run_process(root, work, "io", str(case["input"]).encode(), limits,
                           min(limits.wall_s, left))
        isolation = run.isolation
        ok = run.flag is None and run.returncode == 0 and (
            _normalize(run.stdout.decode(errors="replace")) == _normalize(str(case["output"])))
        results.append(ok)
        if run.flag:
            flags.append(run.flag)
    return results, flags, isolation
