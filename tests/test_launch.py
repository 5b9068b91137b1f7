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
    installs it there with its [gcs] extra, checks versions and device counts on all workers,
    starts `python3 -m rljax train` detached (its own process group, exit status kept) on all
    workers with the given args and the bucket as output_dir, then streams worker 0's log until
    the run ends. Catches: installing `rljax` from PyPI (another project), a remote command that
    needs ~/.local/bin on PATH, a wheel installed without gcsfs, --bucket not reaching output_dir."""
    cmds = _dry_run("launch/tpu.sh", "up", "--name", "rl-pod", "--zone", "us-central2-b", "--type", "v4-32",
                    "--project", "proj", "--spot", "--bucket", "gs://bkt/runs/a", "--dry-run", "--",
                    "--config", "my run.toml")
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "rl-pod", "--zone=us-central2-b", "--project=proj"]
    assert cmds[0] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "rl-pod", "--zone=us-central2-b",
                       "--project=proj", "--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base", "--spot"]
    wheel = os.path.join(ROOT, "build", "launch", f"rljax-{_version()}-py3-none-any.whl")
    assert cmds[1] == ["python3", "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
                       os.path.join(ROOT, "build", "launch"), ROOT]
    assert cmds[2] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", wheel, "rl-pod:", "--zone=us-central2-b",
                       "--project=proj", "--worker=all"]
    assert cmds[3] == [*ssh, "--worker=all", "--command=python3 -m pip install --upgrade 'jax[tpu]>=0.10.2,<0.11' "
                       f"'./{os.path.basename(wheel)}[gcs]'"]
    assert cmds[4][:-1] == [*ssh, "--worker=all"] and "rljax-versions" in cmds[4][-1]
    assert "libtpu" in cmds[4][-1] and "jax.local_device_count()" in cmds[4][-1]
    assert cmds[5][:-1] == [*ssh, "--worker=all"]
    launch = shlex.split(cmds[5][-1].removeprefix("--command="))
    assert launch == ["rm", "-f", "rljax-train.log.exit;", "RLJAX_DISTRIBUTED=auto", "setsid", "nohup", "bash", "-c",
                      "python3 -m rljax train --config 'my run.toml' output_dir=gs://bkt/runs/a; "
                      "echo $? > rljax-train.log.exit", ">", "rljax-train.log", "2>&1", "<", "/dev/null", "&", "echo",
                      "$!", ">", "rljax-train.log.pid"]
    assert cmds[6][:-1] == [*ssh, "--worker=0"]
    assert 'tail -n +1 -F --pid="$(cat rljax-train.log.pid)" rljax-train.log' in cmds[6][-1]
    assert 'exit "$(cat rljax-train.log.exit)"' in cmds[6][-1]
    assert len(cmds) == 7


@pytest.mark.parametrize("accelerator, version", [
    ("v4-16", "tpu-ubuntu2204-base"), ("v5litepod-16", "v2-alpha-tpuv5-lite"), ("v5p-8", "v2-alpha-tpuv5"),
    ("v6e-8", "v2-alpha-tpuv6e")])
def test_tpu_runtime_version_follows_the_generation(accelerator, version):
    """Each generation gets the runtime Google lists for JAX on it (cloud.google.com/tpu/docs/
    runtimes). Catches: v4's tpu-ubuntu2204-base for every generation (Google lists others for v5e,
    v5p and v6e)."""
    cmds = _dry_run("launch/tpu.sh", "create", "--name", "p", "--zone", "us-central2-b", "--type", accelerator,
                    "--dry-run")
    assert cmds == [["gcloud", "compute", "tpus", "tpu-vm", "create", "p", "--zone=us-central2-b",
                     f"--accelerator-type={accelerator}", f"--version={version}"]]


def test_tpu_version_override_output_dir_and_resume_dry_run():
    """--version wins over the generation's default; an output_dir= in the train args wins over
    --bucket; --resume reaches `rljax train` last (argparse reads it there). Without --type,
    `train` first asks gcloud for the slice's type. Catches: --version ignored, --bucket
    clobbering the user's output_dir, a dropped --resume, a check that assumes create's v4-8."""
    create = _dry_run("launch/tpu.sh", "create", "--name", "p", "--zone", "us-east5-b", "--type", "v6e-16",
                      "--version", "v2-alpha-tpuv6e-custom", "--dry-run")
    assert create[0][-1] == "--version=v2-alpha-tpuv6e-custom"
    train = _dry_run("launch/tpu.sh", "train", "--name", "p", "--zone", "us-east5-b", "--bucket", "gs://b/x",
                     "--resume", "--dry-run", "--", "rl.iterations=9", "output_dir=gs://b/mine")
    assert train[0] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "p", "--zone=us-east5-b",
                        "--format=value(acceleratorType)"]
    assert "python3 -m rljax train rl.iterations=9 output_dir=gs://b/mine --resume; " in train[2][-1]


def test_tpu_queued_spot_dry_run():
    """--queued creates through a queued resource named like its node (with --spot), then polls
    its state; `delete --queued` deletes the queued resource and its node (--force). Catches: a
    tpu-vm create where capacity comes through the queue, a delete that leaves the queued
    resource (and its quota) behind."""
    cmds = _dry_run("launch/tpu.sh", "create", "--name", "q", "--zone", "us-east5-a", "--type", "v5p-16",
                    "--queued", "--spot", "--project", "pr", "--dry-run")
    assert cmds == [["gcloud", "compute", "tpus", "queued-resources", "create", "q", "--node-id=q",
                     "--zone=us-east5-a", "--project=pr", "--accelerator-type=v5p-16",
                     "--runtime-version=v2-alpha-tpuv5", "--spot"],
                    ["gcloud", "compute", "tpus", "queued-resources", "describe", "q", "--zone=us-east5-a",
                     "--project=pr", "--format=value(state.state)"]]
    delete = _dry_run("launch/tpu.sh", "delete", "--name", "q", "--zone", "us-east5-a", "--queued", "--dry-run")
    assert delete == [["gcloud", "compute", "tpus", "queued-resources", "delete", "q", "--zone=us-east5-a",
                       "--force", "--quiet"]]


@pytest.mark.parametrize("args, line", [
    (["--zone", "us-central2b"], "tpu.sh: --zone us-central2b is not a zone name; pass REGION-ZONE, e.g. "
                                 "us-central2-b (gcloud compute zones list)"),
    (["--type", "v4-7"], "tpu.sh: --type v4-7: v4 sizes count TensorCores (2 per chip, 4 chips per host): v4-8, "
                         "v4-16, v4-32, ..."),
    (["--type", "v9-8"], "tpu.sh: --type v9-8: generation v9 is not one this script knows; use v4-N, v5p-N, "
                         "v5litepod-N or v6e-N"),
    (["--type", "v6e-12"], "tpu.sh: --type v6e-12: v6e sizes count chips: 1, 4, 8, 16, 32, 64, 128 or 256"),
    (["--type", "tpu"], "tpu.sh: --type tpu is not an accelerator type; pass GENERATION-SIZE, e.g. v4-16, "
                        "v5litepod-8"),
    (["--bucket", "/mnt/runs"], "tpu.sh: --bucket /mnt/runs is a local path, but each worker has its own disk; "
                                "pass gs://BUCKET/PATH"),
])
def test_tpu_bad_input_is_one_line_before_any_gcloud_call(args, line, tmp_path):
    """Bad zones, types and buckets fail with one line naming the fix (exit 2) before gcloud runs:
    in --dry-run, and in a real run, where the fake gcloud on PATH records no call. Catches: a typo
    that reaches gcloud (or a half-created slice) first."""
    env = {**os.environ, "PATH": f"{os.path.join(ROOT, 'tests', 'launch_fakes')}:{os.environ['PATH']}",
           "FAKE_GCLOUD_STATE": str(tmp_path)}
    for dry_run in (["--dry-run"], []):
        result = subprocess.run(["bash", "launch/tpu.sh", "up", "--name", "p", "--zone", "us-central2-b", *args,
                                 *dry_run], cwd=ROOT, capture_output=True, text=True, timeout=30, env=env)
        assert (result.returncode, result.stderr, result.stdout) == (2, line + "\n", "")
    assert not (tmp_path / "calls.log").exists()


def test_tpu_v4_outside_its_zone_warns_in_one_line():
    """v4 outside us-central2-b (the only zone Google lists for it) warns, pointing at the list
    for that zone, and still prints the create (the list may grow). Catches: a silent mismatch
    that fails later inside gcloud, or a hard failure once Google adds a zone."""
    result = subprocess.run(["bash", "launch/tpu.sh", "create", "--name", "p", "--zone", "us-east5-a", "--type",
                             "v4-8", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("gcloud compute tpus tpu-vm create p")
    assert result.stderr == ("tpu.sh: warning: Google lists v4 in us-central2-b only, not us-east5-a; check "
                             "gcloud compute tpus accelerator-types list --zone=us-east5-a\n")


def _version() -> str:
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_tpu_refuses_the_pypi_name():
    """`--pip-spec rljax` would install the unrelated PyPI project of that name: one line, exit 2."""
    result = subprocess.run(["bash", "launch/tpu.sh", "setup", "--name", "p", "--zone", "us-central2-b",
                             "--pip-spec", "rljax==0.0.4"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "unrelated PyPI project" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_tpu_stop_and_delete_dry_run():
    """`stop` ends the recorded run's whole process group on all workers (SIGTERM, then SIGKILL
    after the grace period); `delete` deletes the slice quietly. Catches: a stop that kills the
    wrapper shell only, or sends only SIGTERM, which JAX takes as a preemption notice."""
    stop = _dry_run("launch/tpu.sh", "stop", "--name", "p", "--zone", "us-central2-b", "--dry-run",
                    env={"RLJAX_TPU_STOP_GRACE_S": "7"})
    assert stop[0][:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "p", "--zone=us-central2-b", "--worker=all"]
    assert stop[0][8].startswith('--command=if [ -f rljax-train.log.pid ]; then p="$(cat rljax-train.log.pid)"; '
                                 'kill -TERM -- -"$p" 2>/dev/null; for i in $(seq 7); ')
    assert 'kill -KILL -- -"$p"' in stop[0][8]
    delete = _dry_run("launch/tpu.sh", "delete", "--name", "p", "--zone", "us-central2-b", "--dry-run")
    assert delete == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "p", "--zone=us-central2-b", "--quiet"]]


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


def test_device_check_counts_workers_and_devices_per_host():
    """same_devices passes one line per host with the chips per host, and fails with one line on a
    missing worker or a worker with another device count (jax without TPU support sees 1).
    Catches: a check that passes a slice whose jax fell back to CPU, or a worker that never ran."""
    line = "rljax-devices local={} platform=tpu host=w{}\n"
    def check(text):
        return subprocess.run(["bash", "-c", "source launch/lib.sh && same_devices 2 4 v4-16"], cwd=ROOT,
                              input=text, capture_output=True, text=True, timeout=30)
    ok = check(line.format(4, 0) + line.format(4, 1))
    assert ok.returncode == 0 and ok.stdout == "launch: 2 workers x 4 JAX devices, as v4-16 implies\n"
    missing, cpu = check(line.format(4, 0)), check(line.format(4, 0) + line.format(1, 1))
    assert missing.returncode == 1 and missing.stderr.startswith("launch: 1 workers answered but v4-16 has 2 hosts")
    assert cpu.returncode == 1 and len(cpu.stderr.splitlines()) == 1
    assert "(local=1 platform=tpu host=w1) for v4-16, which has 4 per host; install jax[tpu]" in cpu.stderr


def test_version_check_fails_on_mismatch():
    """same_versions passes identical worker reports and fails with one line naming the package
    that differs and both versions. Catches: a mismatch let through, or a header plus raw lines."""
    ok = "rljax-versions jax=0.10.2 libtpu=1\nrljax-versions jax=0.10.2 libtpu=1\n"
    bad = "rljax-versions jax=0.10.2 libtpu=1\nrljax-versions jax=0.10.1 libtpu=1\n"
    def check(text):
        return subprocess.run(["bash", "-c", "source launch/lib.sh && same_versions"], cwd=ROOT, input=text,
                              capture_output=True, text=True, timeout=30)
    assert check(ok).returncode == 0
    result = check(bad)
    assert result.returncode == 1
    assert result.stderr == ("launch: workers disagree on jax 0.10.1 vs 0.10.2: run setup again so every worker "
                             "installs the same wheel and jax\n")
