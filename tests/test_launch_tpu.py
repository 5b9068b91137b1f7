"""launch/tpu.sh, run for real against tests/launch_fakes/gcloud: a stand-in for gcloud that
makes a TPU slice of local processes (one working directory per worker, `--worker=all` commands
run concurrently, each worker with its coordinator address, process id and 4 CPU devices as
its 4 chips). So the script's whole life runs here: create, wheel install, checks, a 2-host
`rljax train` joined by jax.distributed on localhost, logs, resume, stop and delete.

The run writes to a directory both fake workers share (they are one machine), standing in for
the pod's gs:// bucket: through tests/gcs_emulator.py's one-request-at-a-time server, a run here
hung inside orbax's two-process save (a checkpoint half written), so the bucket is tested where
that cannot happen: --bucket reaching output_dir (test_launch.py), gs:// in rljax (test_storage.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import jax
import pytest

from test_loop import TINY

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "launch_fakes"
ZONE = "us-central2-b"
# v4-16: 8 chips on 2 hosts, 4 per host; the run's mesh (DP=2 x FSDP=2 x TP=2) spans both.
_RUN = TINY + ["data.size=400", "data.eval_size=16", "eval.size=16", "warm_start.steps=0",
               "rl.prompts_per_iteration=16", "eval.every=100", "checkpoint.every=100",
               "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
_TIMEOUT_S = 600


@pytest.fixture
def pod(tmp_path):
    """The environment tpu.sh runs in (the fake gcloud first on PATH, its state under tmp_path);
    afterwards whatever is left of the slice is deleted, which ends its processes."""
    env = {**os.environ, "PATH": f"{FAKES}:{os.environ['PATH']}", "FAKE_GCLOUD_STATE": str(tmp_path / "gcloud"),
           "FAKE_GCLOUD_PYTHON": sys.executable,
           # XLA:CPU's cheapest compile (59 s -> 37 s of CPU for the two processes of one run here);
           # the programs stay the same, only LLVM optimises less.
           "FAKE_GCLOUD_XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    yield env
    if (tmp_path / "gcloud" / "tpus" / "pod").exists():
        subprocess.run([str(FAKES / "gcloud"), "compute", "tpus", "tpu-vm", "delete", "pod", f"--zone={ZONE}",
                        "--quiet"], env=env, capture_output=True, timeout=60)


def _tpu(env: dict, action: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`launch/tpu.sh ACTION --name pod --zone ZONE ARGS`; on a timeout, its whole process group ends."""
    proc = subprocess.Popen(["bash", "launch/tpu.sh", action, "--name", "pod", "--zone", ZONE, *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        assert result.returncode == 0, f"tpu.sh {action} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return result


def _worker(env: dict, i: int) -> Path:
    return Path(env["FAKE_GCLOUD_STATE"]) / "tpus" / "pod" / f"worker-{i}"


def _calls(env: dict) -> list[str]:
    return (Path(env["FAKE_GCLOUD_STATE"]) / "calls.log").read_text().splitlines()


def test_pod_lifecycle_trains_checkpoints_resumes_and_tears_down(pod, tmp_path):
    """The real script drives a 2-host v4-16 through its life. create asks gcloud whether the zone
    offers the type, then creates it with v4's runtime. setup builds this checkout's wheel and
    installs it on both workers, which then import rljax from it (not from the checkout). train
    checks (matching versions, 4 devices per host), then runs 2 iterations on both hosts as one
    jax.distributed job: process 0 alone writes metrics (rows 0, 1, 2 once), both processes write
    their shards of the checkpoint, and train returns the run's exit status (a second run into the
    same output_dir without --resume fails with rljax's one line). train --resume continues to
    step 3 with the first rows unchanged. logs, stop and delete finish the slice. Catches: wrong
    runtime or worker count, a wheel name pip did not write or a wheel without rljax/__main__.py,
    a worker importing the checkout, workers that do not form one job, a checkpoint on one host
    only, a resume that restarts, an exit status lost in the detached run.
    """
    out = tmp_path / "shared-run"  # the fake pod's workers share this machine's disk, as a bucket
    _tpu(pod, "create", "--type", "v4-16")
    assert _calls(pod) == [f"gcloud compute tpus accelerator-types describe v4-16 --zone={ZONE}",
                           f"gcloud compute tpus tpu-vm create pod --zone={ZONE} --accelerator-type=v4-16 "
                           "--version=tpu-ubuntu2204-base"]

    setup = _tpu(pod, "setup")
    assert setup.stdout.count("fake pod: skipped jax[tpu]") == 2
    print_rljax_file = """python3 -c 'import rljax, sys; sys.stdout.write(rljax.__file__ + "\\n")'"""  # one write
    where = subprocess.run([str(FAKES / "gcloud"), "compute", "tpus", "tpu-vm", "ssh", "pod", f"--zone={ZONE}",
                            "--worker=all", f"--command={print_rljax_file}"],
                           env=pod, capture_output=True, text=True, timeout=60, check=True)
    assert sorted(where.stdout.split()) == [str(_worker(pod, i) / "site" / "rljax" / "__init__.py") for i in (0, 1)]

    first = _tpu(pod, "train", "--", *_RUN, "rl.iterations=2", f"output_dir={out}")
    check, log = first.stdout.split("launch: 2 workers x 4 JAX devices, as v4-16 implies\n")  # train checks first
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert "launch: all workers match: " in check and f"rljax={version}" in check
    assert f"checkpoints: {out}/checkpoints" in log  # worker 0's log, streamed until the run ended
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [0, 1, 2]
    for tree in ("params", "opt_state"):
        shards = sorted(p.name for p in (out / "checkpoints" / "2" / tree).glob("ocdbt.process_*"))
        assert shards == ["ocdbt.process_0", "ocdbt.process_1"], tree

    again = _tpu(pod, "train", "--", *_RUN, "rl.iterations=2", f"output_dir={out}", check=False)
    assert again.returncode == 2 and "already holds checkpoints; pass --resume" in again.stdout

    resumed = _tpu(pod, "train", "--resume", "--", *_RUN, "rl.iterations=3", f"output_dir={out}")
    assert f"resumed from {out}/checkpoints/2" in resumed.stdout
    after = (out / "metrics.jsonl").read_text().splitlines()
    assert after[:3] == rows and json.loads(after[3])["step"] == 3 and len(after) == 4
    assert (out / "checkpoints" / "3" / "params" / "ocdbt.process_1").is_dir()

    logs = _tpu(pod, "logs")
    assert f"resumed from {out}/checkpoints/2" in logs.stdout
    _tpu(pod, "stop")
    assert not (_worker(pod, 0) / "rljax-train.log.pid").exists()
    _tpu(pod, "delete")
    assert not _worker(pod, 0).parent.exists()


def _processes_in(directory: Path) -> list[int]:
    """Pids of the processes whose working directory is under `directory`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "cwd").startswith(str(directory)):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_stop_ends_the_whole_run_and_logs_report_it(pod):
    """`stop` ends every process of a detached run on every worker, not only the shell wrapping
    it, and also one that ignores SIGTERM, as a process does once jax.distributed is up (JAX takes
    SIGTERM as a preemption notice); the `train` streaming the log then ends with one line saying
    the run was stopped (exit 1). The run is a stand-in: `python3 -m rljax` is a sleep ignoring
    SIGTERM. Catches: killing the wrapper's pid alone, or SIGTERM without SIGKILL, either of which
    leaves the training process running on the TPU."""
    pod = {**pod, "RLJAX_TPU_STOP_GRACE_S": "1"}
    _tpu(pod, "create", "--type", "v4-16")
    for i in (0, 1):
        python3 = _worker(pod, i) / "bin" / "python3"
        stand_in = '\nif [[ "${1:-} ${2:-}" == "-m rljax" ]]; then trap "" TERM; exec sleep 300; fi\nexec '
        python3.write_text(python3.read_text().replace("\nexec ", stand_in, 1))
    train = subprocess.Popen(["bash", "launch/tpu.sh", "train", "--name", "pod", "--zone", ZONE], cwd=ROOT, env=pod,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not all((_worker(pod, i) / "rljax-train.log.pid").exists() for i in (0, 1)):
            assert time.time() < deadline and train.poll() is None, train.communicate()
            time.sleep(0.2)
        workers = _worker(pod, 0).parent
        # Per worker: the setsid'd bash and the sleep in it. The pid file is written as the detached
        # shell is spawned, before it has started the sleep (a CI run on a loaded machine saw 2 of
        # the 4 processes at that moment), so wait for them rather than count at once.
        while len(_processes_in(workers)) < 4:
            assert time.time() < deadline, _processes_in(workers)
            time.sleep(0.1)
        _tpu(pod, "stop")
        _, err = train.communicate(timeout=60)
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
            train.wait()
    deadline = time.time() + 10
    while _processes_in(workers) and time.time() < deadline:
        time.sleep(0.1)
    assert _processes_in(workers) == []
    assert train.returncode == 1
    assert err.splitlines()[-1] == "tpu.sh: the run has no exit status: it was stopped or killed"


def test_check_refuses_a_worker_with_another_jax_and_launches_nothing(pod):
    """One worker with another jax (a jax 0.0.1 first on its path) fails `train` at the check with
    the line naming the fix and both workers' versions, and nothing starts. Catches: a check that
    compares fewer fields or workers, a train that launches after a failed check."""
    _tpu(pod, "create", "--type", "v4-16")
    dist_info = _worker(pod, 1) / "site" / "jax-0.0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: jax\nVersion: 0.0.1\n")
    result = _tpu(pod, "train", "--", "--config", "never-launched.toml", check=False)  # fails fast if launched
    lines = result.stderr.splitlines()
    assert result.returncode == 1
    assert lines == [f"launch: workers disagree on jax 0.0.1 vs {jax.__version__}: run setup again so every "
                     "worker installs the same wheel and jax"]
    assert not any((_worker(pod, i) / "rljax-train.log").exists() for i in (0, 1))


def test_check_refuses_a_worker_that_sees_the_wrong_device_count(pod):
    """Workers whose jax sees 1 device where v4-16 has 4 chips per host (jax without TPU support)
    fail `check` with one line naming the fix. Catches: a check of versions alone, which passes
    a slice that would train on CPU."""
    _tpu(pod, "create", "--type", "v4-16")
    result = _tpu({**pod, "FAKE_GCLOUD_DEVICES_PER_HOST": "1"}, "check", check=False)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("launch: a worker sees the wrong number of JAX devices (local=1 platform=cpu ")
    assert "for v4-16, which has 4 per host; install jax[tpu] on every worker (setup)" in result.stderr


def test_queued_create_waits_for_active_and_delete_frees_it(pod):
    """`create --queued` polls the queued resource until ACTIVE, then the slice answers ssh;
    FAILED stops with one line; `delete --queued` removes the request and its slice. Catches: ssh
    before the slice exists, polling forever on FAILED, a queued resource left holding quota."""
    env = {**pod, "RLJAX_TPU_POLL_S": "0", "FAKE_GCLOUD_QUEUED_STATES": "WAITING_FOR_RESOURCES,PROVISIONING,ACTIVE"}
    created = _tpu(env, "create", "--type", "v5p-16", "--queued", "--spot")
    assert created.stdout.splitlines()[-1] == "tpu.sh: queued resource pod is ACTIVE"
    describes = [c for c in _calls(env) if "queued-resources describe" in c]
    assert len(describes) == 3
    assert _worker(env, 1).is_dir() and not _worker(env, 2).exists()  # v5p-16: 8 chips on 2 hosts
    _tpu(env, "delete", "--queued")
    assert not _worker(env, 0).exists() and not (Path(env["FAKE_GCLOUD_STATE"]) / "queued" / "pod.json").exists()

    failed = _tpu({**env, "FAKE_GCLOUD_QUEUED_STATES": "WAITING_FOR_RESOURCES,FAILED"}, "create", "--type", "v5p-16",
                  "--queued", check=False)
    assert failed.returncode == 1 and failed.stderr == (
        "tpu.sh: queued resource pod is FAILED; free it with tpu.sh delete --queued, then retry (another zone or "
        "--spot may have capacity)\n")


def test_create_refuses_a_type_the_zone_does_not_offer(pod):
    """In a real run, create asks gcloud whether the zone offers the type and turns a refusal into
    one line, creating nothing. Catches: gcloud's create error (or a half-made slice) instead."""
    result = _tpu({**pod, "FAKE_GCLOUD_UNOFFERED": f"v6e-16@{ZONE}"}, "create", "--type", "v6e-16", check=False)
    assert result.returncode == 1 and result.stderr == (
        f"tpu.sh: {ZONE} offers no v6e-16 (or this project cannot use the TPU API there); see gcloud compute tpus "
        f"accelerator-types list --zone={ZONE}\n")
    assert _calls(pod) == [f"gcloud compute tpus accelerator-types describe v6e-16 --zone={ZONE}"]
