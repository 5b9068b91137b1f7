"""Launch scripts: shellcheck-clean, and --dry-run prints the exact gcloud/ssh/srun commands."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["launch/lib.sh", "launch/tpu.sh", "launch/gpu_ssh.sh", "launch/gpu_slurm.sbatch"]


def _dry_run(*args: str, env: dict | None = None) -> list[list[str]]:
    out = subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=30,
                         env={**os.environ, **(env or {})}, check=True).stdout
    return [shlex.split(line) for line in out.splitlines()]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (CI installs it)")
def test_scripts_pass_shellcheck():
    """Every launch script passes shellcheck, following the sourced lib.sh."""
    result = subprocess.run(["shellcheck", "-x", *SCRIPTS], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def test_tpu_up_dry_run_prints_the_gcloud_commands():
    """`up` creates the slice, builds a wheel from this checkout, copies it to all workers and
    installs it there, checks versions on all workers, starts `python3 -m rljax train` detached on
    all workers with the given args (no PATH lookup of an `rljax` script), then streams worker 0's
    log. Catches: installing `rljax` from PyPI (another project), a remote command that needs
    ~/.local/bin on PATH."""
    cmds = _dry_run("launch/tpu.sh", "up", "--name", "rl-pod", "--zone", "us-central2-b", "--type", "v4-32",
                    "--project", "proj", "--spot", "--dry-run", "--", "--config", "my run.toml")
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "rl-pod", "--zone=us-central2-b", "--project=proj"]
    assert cmds[0] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "rl-pod", "--zone=us-central2-b",
                       "--project=proj", "--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base", "--spot"]
    wheel = os.path.join(ROOT, "build", "launch", f"rljax-{_version()}-py3-none-any.whl")
    assert cmds[1] == ["python3", "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
                       os.path.join(ROOT, "build", "launch"), ROOT]
    assert cmds[2] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", wheel, "rl-pod:", "--zone=us-central2-b",
                       "--project=proj", "--worker=all"]
    assert cmds[3] == [*ssh, "--worker=all", "--command=python3 -m pip install --upgrade 'jax[tpu]>=0.10.2,<0.11' "
                       f"./{os.path.basename(wheel)}"]
    assert cmds[4][:-1] == [*ssh, "--worker=all"] and "rljax-versions" in cmds[4][-1]
    assert "libtpu" in cmds[4][-1] and "jaxlib" in cmds[4][-1]
    assert cmds[5] == [*ssh, "--worker=all", "--command=RLJAX_DISTRIBUTED=auto nohup python3 -m rljax train "
                       "--config 'my run.toml' > rljax-train.log 2>&1 < /dev/null & echo $! > rljax-train.log.pid"]
    assert cmds[6] == [*ssh, "--worker=0", "--command=tail -n +1 -F rljax-train.log"]
    assert len(cmds) == 7


def _version() -> str:
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_tpu_setup_builds_copies_and_installs_the_checkouts_wheel(tmp_path):
    """`setup` (not a dry run) builds a wheel of this checkout and hands a fake `gcloud` on PATH
    the file it copies; that wheel exists, holds `rljax/__main__.py` (so `python3 -m rljax` works
    on the worker), and the install command installs that same file. Catches: a wheel name that
    does not match what `pip wheel` writes, a wheel without the CLI entry module, installing
    something other than the copied file."""
    import zipfile
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "bin" / "gcloud"
    fake.parent.mkdir()
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {calls}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", "launch/tpu.sh", "setup", "--name", "p", "--zone", "z"], cwd=ROOT, env=env,
                   check=True, timeout=300, capture_output=True)
    scp, install = calls.read_text().splitlines()
    wheel = scp.split()[4]
    assert scp.split()[:4] == ["compute", "tpus", "tpu-vm", "scp"] and scp.endswith("p: --zone=z --worker=all")
    assert "rljax/__main__.py" in zipfile.ZipFile(wheel).namelist()
    assert install.endswith(f"python3 -m pip install --upgrade 'jax[tpu]>=0.10.2,<0.11' ./{os.path.basename(wheel)}")


def test_tpu_refuses_the_pypi_name():
    """`--pip-spec rljax` would install the unrelated PyPI project of that name: one line, exit 2."""
    result = subprocess.run(["bash", "launch/tpu.sh", "setup", "--name", "p", "--zone", "z", "--pip-spec",
                             "rljax==0.0.4"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "unrelated PyPI project" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_tpu_stop_and_delete_dry_run():
    """`stop` kills the recorded training pid on all workers; `delete` deletes the slice quietly."""
    stop = _dry_run("launch/tpu.sh", "stop", "--name", "p", "--zone", "z", "--dry-run")
    assert stop[0][:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "p", "--zone=z", "--worker=all"]
    assert "kill $(cat rljax-train.log.pid)" in stop[0][8]
    delete = _dry_run("launch/tpu.sh", "delete", "--name", "p", "--zone", "z", "--dry-run")
    assert delete == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "p", "--zone=z", "--quiet"]]


def test_tpu_missing_name_is_one_clear_line():
    """A missing required option fails with exit code 2 and one line naming it."""
    result = subprocess.run(["bash", "launch/tpu.sh", "create", "--zone", "z"], cwd=ROOT, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and result.stderr.strip() == "tpu.sh: --name is required"


def test_gpu_ssh_dry_run_sets_rank_env_per_host():
    """Over SSH, every host gets a version check, then process i gets the coordinator (first host,
    without user@), the process count and its id."""
    cmds = _dry_run("launch/gpu_ssh.sh", "--hosts", "me@gpu0,gpu1", "--port", "4242", "--dry-run",
                    "--", "--config", "c.toml")
    assert [c[:3] for c in cmds[:2]] == [["ssh", "-o", "BatchMode=yes"]] * 2
    assert all("rljax-versions" in c[-1] for c in cmds[:2])
    for i, host in enumerate(["me@gpu0", "gpu1"]):
        assert cmds[2 + i] == ["ssh", "-tt", "-o", "BatchMode=yes", host,
                               f"env RLJAX_COORDINATOR_ADDRESS=gpu0:4242 RLJAX_NUM_PROCESSES=2 "
                               f"RLJAX_PROCESS_ID={i} python3 -m rljax train --config c.toml"]


def test_slurm_dry_run_checks_versions_then_sruns_train():
    """The sbatch script checks versions on every node with srun, then runs one task per node."""
    cmds = _dry_run("launch/gpu_slurm.sbatch", "--dry-run", "--", "--config", "c.toml",
                    env={"SLURM_JOB_NUM_NODES": "4"})
    step = ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"]
    assert cmds[0][:-1] == step and "rljax-versions" in cmds[0][-1]
    assert cmds[1] == [*step, "RLJAX_DISTRIBUTED=auto exec python3 -m rljax train --config c.toml"]


def test_version_check_fails_on_mismatch():
    """same_versions passes identical worker reports and fails, listing both, on a mismatch."""
    ok = "rljax-versions jax=0.10.2 libtpu=1\nrljax-versions jax=0.10.2 libtpu=1\n"
    bad = "rljax-versions jax=0.10.2 libtpu=1\nrljax-versions jax=0.10.1 libtpu=1\n"
    def check(text):
        return subprocess.run(["bash", "-c", "source launch/lib.sh && same_versions"], cwd=ROOT, input=text,
                              capture_output=True, text=True, timeout=30)
    assert check(ok).returncode == 0
    result = check(bad)
    assert result.returncode == 1 and "jax=0.10.1" in result.stderr and "disagree" in result.stderr
