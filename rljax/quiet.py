"""Quiet command-line output: library notices a user cannot act on are dropped (`--verbose` keeps them).

They come from two places, so there are two filters:

- **absl (Python logging).** orbax warns on every read-only open of a checkpoint directory
  ("Given directory is read only=...", "CheckpointManagerOptions.read_only=True, setting
  save_interval_steps=0"), four lines per `rljax eval` or `export`. A `logging.Filter` on the
  absl logger drops them.
- **XLA's C++ logging**, written straight to file descriptor 2, where no Python filter sees it:
  the SPMD partitioner's "Involuntary full rematerialization" notice, which `rljax plan` triggers
  by compiling for a simulated mesh. File descriptor 2 is pointed at a pipe and a thread copies
  it to the real stderr, dropping those lines. Text without a newline yet (a progress bar's `\\r`
  updates) is passed on at once unless it starts like an XLA log line, so live output stays live.

`quiet()` installs both and returns the function that undoes them; `rljax.cli.main` calls it
around every command unless `--verbose` is given.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable

# What is dropped: each pattern is searched in one line of text.
ABSL_NOISE = (re.compile(r"Given directory is read only"), re.compile(r"read_only=True, setting save_interval_steps"))
XLA_NOISE = (re.compile(rb"Involuntary full rematerialization"),)
# The start of an absl C++ log line ("W1126 05:10:11.123456   123 file.cc:652] ..."): held until its
# newline arrives, so a notice written in pieces is still dropped whole.
_XLA_LINE_START = re.compile(rb"^[IWEF]\d{0,4}(\s|$)")
# Written through the pipe by the restore: the reader has forwarded everything before it.
_DRAINED = b"\0rljax: stderr drained\0"


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in ABSL_NOISE)


def _filter_fd2(patterns: tuple[re.Pattern, ...]) -> Callable[[], None]:
    """Points file descriptor 2 at a pipe whose reader forwards every line to the original stderr
    except those matching `patterns`; returns the function that drains the pipe and restores fd 2.

    Child processes started meanwhile (reward workers) keep the pipe as their stderr, so the reader
    lives on after the restore, as a daemon, until the last of them closes it."""
    sys.stderr.flush()
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    drained = threading.Event()

    def forward(data: bytes) -> None:
        with contextlib.suppress(OSError):
            os.write(original, data)

    def pump() -> None:
        pending = b""
        while chunk := os.read(read_end, 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b""
            for line in lines:
                if line.endswith(_DRAINED):  # after any unfinished text that was held back
                    forward(kept + line[:-len(_DRAINED)])
                    kept = b""
                    drained.set()
                elif not any(p.search(line) for p in patterns):
                    kept += line + b"\n"
            if pending and not _XLA_LINE_START.match(pending):
                kept, pending = kept + pending, b""
            if kept:
                forward(kept)
        if pending and not any(p.search(pending) for p in patterns):
            forward(pending)
        os.close(read_end)
        os.close(original)

    threading.Thread(target=pump, name="rljax-stderr-filter", daemon=True).start()

    def restore() -> None:
        sys.stderr.flush()
        os.write(2, _DRAINED + b"\n")  # everything before it has been forwarded once the pump sees it
        drained.wait(timeout=10)
        os.dup2(original, 2)

    return restore


def quiet() -> Callable[[], None]:
    """Drops the notices listed above from this process's output; returns the undo function."""
    absl_logger = logging.getLogger("absl")
    noise = _DropNoise()
    absl_logger.addFilter(noise)
    try:
        restore_fd2 = _filter_fd2(XLA_NOISE)
    except OSError:  # no usable fd 2 (a closed stderr): the Python filter alone
        restore_fd2 = lambda: None  # noqa: E731

    def undo() -> None:
        absl_logger.removeFilter(noise)
        restore_fd2()

    return undo
