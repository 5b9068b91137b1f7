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
    """`up` creates the slice, installs on all workers, checks versions on all workers, starts
    `rljax train` detached on all workers with the given args, then streams worker 0's log."""
    cmds = _dry_run("launch/tpu.sh", "up", "--name", "rl-pod", "--zone", "us-central2-b", "--type", "v4-32",
                    "--project", "proj", "--spot", "--dry-run", "--", "--config", "my run.toml")
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "rl-pod", "--zone=us-central2-b", "--project=proj"]
    assert cmds[0] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "rl-pod", "--zone=us-central2-b",
                       "--project=proj", "--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base", "--spot"]
    assert cmds[1] == [*ssh, "--worker=all",
                       "--command=python3 -m pip install --upgrade 'jax[tpu]>=0.10.2,<0.11' rljax"]
    assert cmds[2][:-1] == [*ssh, "--worker=all"] and "rljax-versions" in cmds[2][-1]
    assert "libtpu" in cmds[2][-1] and "jaxlib" in cmds[2][-1]
    assert cmds[3] == [*ssh, "--worker=all", "--command=RLJAX_DISTRIBUTED=auto nohup rljax train --config "
                       "'my run.toml' > rljax-train.log 2>&1 < /dev/null & echo $! > rljax-train.log.pid"]
    assert cmds[4] == [*ssh, "--worker=0", "--command=tail -n +1 -F rljax-train.log"]
    assert len(cmds) == 5


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
                               f"RLJAX_PROCESS_ID={i} rljax train --config c.toml"]


def test_slurm_dry_run_checks_versions_then_sruns_train():
    """The sbatch script checks versions on every node with srun, then runs one task per node."""
    cmds = _dry_run("launch/gpu_slurm.sbatch", "--dry-run", "--", "--config", "c.toml",
                    env={"SLURM_JOB_NUM_NODES": "4"})
    step = ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"]
    assert cmds[0][:-1] == step and "rljax-versions" in cmds[0][-1]
    assert cmds[1] == [*step, "RLJAX_DISTRIBUTED=auto exec rljax train --config c.toml"]


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
