"""A fake tool for the environment tests that misbehaves on purpose.

It lives in this light module (no pytest, numpy or jax import) because a pool worker imports the
tool's module to unpickle each step, and a new or respawned worker's first step pays that import
inside the step's time limit (1.5 s here): test_envs.py and its imports took 80 ms of CPU, about a
second of wall time on 2 cores at load 15; this module adds a few ms to `rljax.envs` (15 ms).
"""

import dataclasses
import os
import time

from rljax.envs import ToolOutput


@dataclasses.dataclass(frozen=True)
class MisbehavingTool:
    """A tool whose Python misbehaves in the pool worker itself, outside any sandbox.

    calls: a file that each call appends its input to (one line) before it acts, so a test can
    count how often the tool really ran, in whichever worker."""

    name = "misbehaving"
    argument = "input"
    time_limit_s = 1.5
    calls: str | None = None

    def schema(self):
        return {}

    def __call__(self, arguments, history):
        what = arguments["input"]
        if self.calls is not None:  # one unbuffered O_APPEND write: complete before os._exit
            fd = os.open(self.calls, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, (what + "\n").encode())
            os.close(fd)
        if what == "hang":
            time.sleep(60)
        if what == "die":
            os._exit(3)
        if what == "raise":
            raise RuntimeError("tool bug")
        return ToolOutput(f"ok {what}", False, history)
