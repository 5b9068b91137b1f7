"""`python3 -m pip install ...` on a fake TPU worker (tests/launch_fakes/gcloud): installs what
it is given into the worker's own site directory, so that worker imports it from there.

    _tpu_pip.py SITE [pip install arguments...]

`jax[tpu]` is skipped (there is no TPU here; the test venv's jax stands in for it) and says so.
Dependencies are not installed (`--no-deps`): the venv has them, and the machine is offline.
"""

from __future__ import annotations

import subprocess
import sys


def main(site: str, args: list[str]) -> int:
    specs = []
    for arg in args:
        if arg in ("--upgrade", "-U"):
            continue
        if arg.startswith("jax[tpu]"):
            sys.stdout.write(f"fake pod: skipped {arg} (no TPU here; the test venv's jax stands in)\n")
            continue
        specs.append(arg)
    return subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
                           "--target", site, *specs]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
