"""The `python3` of a fake GPU host (tests/launch_fakes/ssh) or of a fake shared venv (the
SLURM test): the test's venv python, except that `python3 -m pip install` installs into the
host's own site/ directory, first on its PYTHONPATH, so the host imports the rljax wheel it was
given rather than the checkout.

    _gpu_python.py make DIR    writes DIR/bin/python3, DIR/bin/activate and DIR/site/
    _gpu_python.py pip SITE [pip install arguments...]

`jax[cuda...]` specs are skipped (no GPU here; the venv's jax stands in) and say so, and
dependencies are not installed (`--no-deps`): the venv has them, and the machine is offline.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path


def make(home: Path) -> None:
    (home / "bin").mkdir(parents=True, exist_ok=True)
    (home / "site").mkdir(exist_ok=True)
    python, me, site = (shlex.quote(str(p)) for p in (sys.executable, Path(__file__).resolve(), home / "site"))
    wrapper = home / "bin" / "python3"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "${1:-} ${2:-} ${3:-}" == "-m pip install" ]]; then\n'
        f'  exec {python} {me} pip {site} "${{@:4}}"\n'
        "fi\n"
        f'exec {python} "$@"\n')
    wrapper.chmod(0o755)
    (home / "bin" / "activate").write_text(
        f'export PATH={shlex.quote(str(home / "bin"))}:"$PATH" PYTHONPATH={site}\n')


def pip(site: str, args: list[str]) -> int:
    specs = []
    for arg in args:
        if arg in ("--upgrade", "-U"):
            continue
        if arg.startswith("jax["):
            print(f"fake GPU host: skipped {arg} (no GPU here; the test venv's jax stands in)")
            continue
        specs.append(arg)
    return subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--upgrade", "--target", site, *specs]).returncode


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]))
    else:
        sys.exit(pip(sys.argv[2], sys.argv[3:]))
