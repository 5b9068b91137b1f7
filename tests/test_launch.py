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


def test_gpu_ssh_dry_run_installs_checks_then_runs_each_host_as_a_process_group():
    """Over SSH: a wheel of this checkout, copied into every host's workdir and installed there
    with jax[cuda12] and the [gcs] extra; a version check on every host; then process i gets the
    coordinator (first host, without user@), the process count and its id, runs in its own process
    group (setsid) whose id goes to rljax-train.pid with this invocation's run id, and refuses to
    start beside a live earlier run. `--stop` kills each host's recorded group, whichever run it
    is. Catches: installing from PyPI, an install that misses a host, a run the cleanup cannot
    find (no pid file, no own group)."""
    cmds = _dry_run("launch/gpu_ssh.sh", "--hosts", "me@gpu0,gpu1", "--port", "4242", "--workdir", "runs/a",
                    "--activate", "venv/bin/activate", "--dry-run", "--", "--config", "c.toml")
    wheel = os.path.join(ROOT, "build", "launch", f"rljax-{_version()}-py3-none-any.whl")
    prefix = "cd runs/a && source venv/bin/activate && "
    assert cmds[0] == ["python3", "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
                       os.path.join(ROOT, "build", "launch"), ROOT]
    for i, host in enumerate(["me@gpu0", "gpu1"]):
        assert cmds[1 + 3 * i: 4 + 3 * i] == [
            ["ssh", "-o", "BatchMode=yes", host, "mkdir -p runs/a"],
            ["scp", "-q", "-o", "BatchMode=yes", wheel, f"{host}:runs/a/"],
            ["ssh", "-o", "BatchMode=yes", host, f"{prefix}python3 -m pip install --upgrade "
             f"'jax[cuda12]>=0.10.2,<0.11' './{os.path.basename(wheel)}[gcs]'"]]
        assert cmds[7 + i][:4] == ["ssh", "-o", "BatchMode=yes", host] and "rljax-versions" in cmds[7 + i][4]
        train = cmds[9 + i]
        assert train[:4] == ["ssh", "-o", "BatchMode=yes", host] and train[4].startswith(
            f"{prefix}{{ if [ -f rljax-train.pid ] && read -r pg _ < rljax-train.pid "
            "&& kill -0 -- -$pg 2>/dev/null; then")
        assert (f"; env RLJAX_COORDINATOR_ADDRESS=gpu0:4242 RLJAX_NUM_PROCESSES=2 RLJAX_PROCESS_ID={i} setsid "
                "python3 -m rljax train --config c.toml < /dev/null 2>&1 & echo \"$! ") in train[4]
        assert train[4].endswith('" > rljax-train.pid; wait $!; status=$?; rm -f rljax-train.pid; exit $status; }')
    assert len(cmds) == 11
    stop = _dry_run("launch/gpu_ssh.sh", "--hosts", "me@gpu0,gpu1", "--workdir", "runs/a", "--stop", "--dry-run")
    assert [c[:4] for c in stop] == [["ssh", "-o", "BatchMode=yes", h] for h in ("me@gpu0", "gpu1")]
    assert all(c[4].startswith("cd runs/a && if [ -f rljax-train.pid ]; then read -r pg id < rljax-train.pid; "
                               "if [ -z '' ] || [ \"$id\" = '' ]; then kill -s TERM -- -$pg") for c in stop)


def test_gpu_ssh_pip_spec_and_the_pypi_name():
    """--pip-spec installs that spec on every host (no wheel built or copied); PyPI's unrelated
    `rljax`, with or without an extra or a version, is refused with one line before any ssh."""
    cmds = _dry_run("launch/gpu_ssh.sh", "--hosts", "a,b", "--pip-spec", "git+https://example.com/me/rljax@v1",
                    "--jax", "", "--dry-run")
    assert cmds[:2] == [["ssh", "-o", "BatchMode=yes", h, "python3 -m pip install --upgrade "
                         "git+https://example.com/me/rljax@v1"] for h in ("a", "b")]
    for spec in ("rljax", "rljax[gcs]", "rljax==0.0.4"):
        result = subprocess.run(["bash", "launch/gpu_ssh.sh", "--hosts", "a,b", "--pip-spec", spec], cwd=ROOT,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 2 and result.stderr.count("\n") == 1
        assert "unrelated PyPI project named rljax" in result.stderr


def test_slurm_dry_run_installs_checks_versions_then_sruns_one_task_per_node_with_all_gpus():
    """The sbatch script builds the submit directory's wheel and installs it once into the
    --activate environment, checks versions on every node with srun, then runs one task per node
    whose JAX_LOCAL_DEVICE_IDS lists every GPU it sees (the device ids themselves:
    tests/test_launch_gpu.py). Catches: installing on every node into one shared venv at once,
    one task per node without all of its GPUs."""
    cmds = _dry_run("launch/gpu_slurm.sbatch", "--dry-run", "--activate", "/shared/venv/bin/activate", "--",
                    "--config", "c.toml", env={"SLURM_JOB_NUM_NODES": "4", "SLURM_SUBMIT_DIR": ROOT})
    wheel = os.path.join(ROOT, "build", "launch", f"rljax-{_version()}-py3-none-any.whl")
    step = ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"]
    assert cmds[0] == ["python3", "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
                       os.path.join(ROOT, "build", "launch"), ROOT]
    assert cmds[1] == ["bash", "-c", "source /shared/venv/bin/activate && python3 -m pip install --upgrade "
                       f"'jax[cuda12]>=0.10.2,<0.11' '{wheel}[gcs]'"]
    assert cmds[2][:-1] == step and "rljax-versions" in cmds[2][-1]
    assert cmds[3][:-1] == step
    assert cmds[3][-1].startswith('[ -n "${JAX_LOCAL_DEVICE_IDS:-}" ] || export JAX_LOCAL_DEVICE_IDS=')
    assert cmds[3][-1].endswith("; source /shared/venv/bin/activate && RLJAX_DISTRIBUTED=auto exec python3 -m rljax "
                                "train --config c.toml")
    assert len(cmds) == 4


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
