"""GPU launch scripts end to end against local stand-ins (tests/launch_fakes): `launch/gpu_ssh.sh`
through a fake `ssh`/`scp` (each host a directory), `launch/gpu_slurm.sbatch` through a fake
`sbatch`/`srun` (each node a set of local processes with SLURM's variables). Both train 2
processes x 1 CPU device with jax.distributed on localhost, from a wheel of a copy of this
checkout installed into each host's own directory. Also: which GPUs jax's SLURM detection gives
each process, SSH cleanup of the remote processes, and the coordinator timeout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "launch_fakes"
VERSION = "0.1.0.dev18"  # the copy's version: a host that reports it imports the wheel, not the checkout
# 2 iterations of a 1-layer model on 2 processes x 1 device, checkpointed at the end. No warm start
# (one program less to compile), and the sampler in its own layout: then only the sampling program
# holds the verifier callback, which JAX never caches, and the second run here reuses the rest
# from the session's compilation cache (tests/conftest.py).
TRAIN = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=1", "model.num_heads=2",
         "model.num_kv_heads=1", "model.head_dim=32", "data.size=64", "data.eval_size=8", "eval.size=8",
         "warm_start.steps=0", "rl.iterations=2", "rl.prompts_per_iteration=4", "sampling.num_samples=2",
         "eval.every=100", "checkpoint.every=100", "mesh.sampler=tensor", "metrics.tensorboard=false",
         "metrics.progress_bar=false"]
_TIMEOUT_S = 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A user's checkout: a copy of this one (its own version), so builds stay out of this tree."""
    root = tmp_path_factory.mktemp("checkout")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, root / name)
    for name in ("rljax", "launch"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', f'version = "{VERSION}"', 1))
    return root


@pytest.fixture(scope="module")
def wheel(checkout) -> Path:
    """The wheel the scripts build by default (lib.sh's checkout_wheel), built once for the module."""
    subprocess.run(["bash", "-c", f"source launch/lib.sh && checkout_wheel {checkout} test"], cwd=checkout,
                   env=_env(), check=True, timeout=300, capture_output=True)
    return checkout / "build" / "launch" / f"rljax-{VERSION}-py3-none-any.whl"


def _env(**extra: str) -> dict[str, str]:
    """The fakes first on PATH, then this venv's python3; one CPU device per process."""
    env = {**os.environ, "PATH": f"{FAKES}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "JAX_PLATFORMS": "cpu",
           # -O0 as the suite (tests/conftest.py): LLVM optimises less, the programs are the same.
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"}
    env.update(extra)
    return env


def _run(args: list[str], *, env: dict[str, str], cwd: Path = ROOT, timeout: float = _TIMEOUT_S) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a launch command. Past `timeout` it gets SIGTERM first,
    as a user's Ctrl-C: the script then stops what it started (a SIGKILL would leave the fake
    hosts' runs behind), and the test fails with the output."""
    proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=30)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
        pytest.fail(f"{args[:2]} ran past {timeout} s:\n{out[-3000:]}")


def _ssh_env(hosts: Path) -> dict[str, str]:
    return _env(FAKE_SSH_HOSTS=str(hosts), FAKE_SSH_PYTHON=sys.executable)


def _assert_trained(out: Path, log: str) -> None:
    """Metrics rows from process 0 only (one per step) and a checkpoint both processes wrote."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2], log[-3000:]
    params = out / "checkpoints" / "2" / "params"
    assert (params / "ocdbt.process_0").is_dir() and (params / "ocdbt.process_1").is_dir()


def test_gpu_ssh_installs_the_wheel_checks_versions_and_trains_on_two_hosts(tmp_path, checkout, wheel):
    """gpu_ssh.sh copies the wheel to both fake hosts' workdir and installs it there (each host
    then reports the copy's version), checks versions, and trains on both hosts: metrics from
    process 0, a checkpoint both wrote, output prefixed per host, pid files gone after the run.
    Then a host whose install is gone (it falls back to another rljax) fails the version check.
    Catches: hosts importing something other than the copied wheel, a missing scp or install
    step, wrong rank variables (no joint checkpoint), a version check that passes a mismatch."""
    hosts, out = tmp_path / "hosts", tmp_path / "shared" / "out"
    script = [str(checkout / "launch" / "gpu_ssh.sh"), "--hosts", "localhost,me@127.0.0.1",
              "--workdir", "run", "--port", str(_free_port())]
    status, log = _run(["bash", *script, "--wheel", str(wheel), "--", *TRAIN, f"output_dir={out}"],
                       env=_ssh_env(hosts))
    assert status == 0, log[-3000:]
    assert f"launch: all workers match: python={sys.version.split()[0]}" in log and f"rljax={VERSION}" in log
    for host in ("localhost", "127.0.0.1"):
        assert (hosts / host / "run" / wheel.name).is_file()
        assert (hosts / host / "site" / "rljax" / "__main__.py").is_file()
        assert not (hosts / host / "run" / "rljax-train.pid").exists()
    assert "[1] rljax: joining localhost:" in log and "as process 1 of 2" in log
    _assert_trained(out, log)

    shutil.rmtree(hosts / "127.0.0.1" / "site")  # this host now imports the venv's rljax 0.1.0
    check = subprocess.run(["bash", *script, "--check-only"], env=_ssh_env(hosts), capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 1
    line, = check.stderr.splitlines()
    assert line.startswith("launch: workers disagree on rljax ")
    assert line.split(":")[1].split("rljax ")[1].split(" vs ") == sorted(["0.1.0", VERSION])


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie no longer counts: nothing may reap it in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


_HOSTS = ("localhost", "127.0.0.1")


@pytest.mark.parametrize("ending", ["sigterm", "a_host_fails"])
def test_gpu_ssh_stops_the_remote_runs_and_their_children(tmp_path, ending):
    """Each host's `python3 -m rljax train` is a stand-in that waits on a child `sleep`. SIGTERM
    to gpu_ssh.sh (exit 143), or the second host's run failing (exit 1), kills the run and its
    child on every host within seconds, and the pid files go. A second launch while the first
    runs is refused on the hosts and leaves the first run alone. Catches: cleanup that kills only
    the local ssh|sed pipes (the remote runs outlive the script), killing the run's pid but not its
    process group (the child survives), waiting on the first host while another has failed, a
    refused launch whose failure cleanup stops the earlier run."""
    hosts = tmp_path / "hosts"
    for host in _HOSTS:
        (hosts / host / "bin").mkdir(parents=True)
        fails = ending == "a_host_fails" and host == "127.0.0.1"
        train = ('while [ ! -f "$HOME/../localhost/pids" ]; do sleep 0.1; done; echo "bad config" >&2; exit 1'
                 if fails else 'sleep 300 & echo "$$ $!" > "$HOME/pids.tmp"; mv "$HOME/pids.tmp" "$HOME/pids"; wait')
        stand_in = hosts / host / "bin" / "python3"
        stand_in.write_text("#!/usr/bin/env bash\n"
                            f'if [[ "$*" == "-m rljax train"* ]]; then {train}; exit; fi\n'
                            f'exec {sys.executable} "$@"\n')
        stand_in.chmod(0o755)
    script = subprocess.Popen(["bash", str(ROOT / "launch" / "gpu_ssh.sh"), "--hosts", ",".join(_HOSTS),
                               "--no-install"], env=_ssh_env(hosts), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    running = [h for h in _HOSTS if not (ending == "a_host_fails" and h == "127.0.0.1")]
    try:
        deadline = time.monotonic() + 60
        while not all((hosts / h / "pids").exists() for h in running):
            assert script.poll() is None and time.monotonic() < deadline, script.communicate()[0]
            time.sleep(0.1)
        pids = [int(p) for h in running for p in (hosts / h / "pids").read_text().split()]
        if ending == "sigterm":
            second = subprocess.run(["bash", str(ROOT / "launch" / "gpu_ssh.sh"), "--hosts", ",".join(_HOSTS),
                                     "--no-install"], env=_ssh_env(hosts), capture_output=True, text=True,
                                    timeout=60)
            assert second.returncode == 1 and "an earlier run is still running here" in second.stdout
            assert all(_alive(p) for p in pids), "a refused second launch stopped the first run"
            script.send_signal(signal.SIGTERM)
        log = script.communicate(timeout=30)[0]
    finally:
        if script.poll() is None:
            script.kill()
    if ending == "sigterm":
        assert script.returncode == 143 and "terminated; stopping the runs on every host" in log, log
    else:
        assert script.returncode == 1 and "[1] bad config" in log, log
        assert "a host's run failed (its [i] lines above); stopping the runs on every host" in log
    assert not any(_alive(p) for p in pids), log
    assert not any((hosts / h / "rljax-train.pid").exists() for h in _HOSTS)


def test_slurm_gives_each_node_all_of_its_gpus(tmp_path):
    """Through the fake sbatch/srun (2 nodes x 8 GPUs), each training process resolves what
    jax.distributed.initialize would (JAX_LOCAL_DEVICE_IDS, then jax's SLURM detection): the
    processes of each node use GPUs 0..7 exactly once, the coordinator is the first node at the
    job id's port, and process ids are SLURM's. Catches: one task per node left to jax's
    detection (each process gets only GPU SLURM_LOCALID: 1 of 8), GPU ids outside what a task
    sees."""
    probe = tmp_path / "bin" / "python3"  # `python3 -m rljax train` -> the probe; anything else: python
    probe.parent.mkdir()
    probe.write_text("#!/usr/bin/env bash\n"
                     f'[[ "$*" == "-m rljax train"* ]] && exec {sys.executable} {FAKES / "_gpu_probe.py"}\n'
                     f'exec {sys.executable} "$@"\n')
    probe.chmod(0o755)
    env = _env(PATH=f"{probe.parent}:{_env()['PATH']}", FAKE_SLURM_JOB_ID="4242")
    status, out = _run(["sbatch", f"--output={tmp_path}/rljax-%j.log", "launch/gpu_slurm.sbatch", "--no-install"],
                       env=env, timeout=120)
    log = (tmp_path / "rljax-4242.log").read_text()
    assert status == 0 and out == "Submitted batch job 4242\n", log
    seen = [json.loads(line.split(" ", 1)[1]) for line in log.splitlines() if line.startswith("probe ")]
    assert sorted(p["process_id"] for p in seen) == [0, 1] and {p["num_processes"] for p in seen} == {2}
    assert {p["coordinator"] for p in seen} == {f"localhost:{4242 % 4096 + 61440}"}
    for node in (0, 1):
        gpus = [g for p in seen if p["node"] == node for g in p["gpus"]]
        assert sorted(gpus) == [str(i) for i in range(8)], seen


def test_slurm_installs_the_wheel_once_and_trains_on_two_nodes(tmp_path, checkout, wheel):
    """gpu_slurm.sbatch, submitted from the checkout through the fake sbatch (2 nodes), installs
    the wheel into the --activate venv on the "shared filesystem", checks versions on every node
    with srun, and trains one task per node joined by jax's own SLURM detection
    (RLJAX_DISTRIBUTED=auto): metrics from process 0, a checkpoint both wrote.
    Catches: a job that needs the script's own directory (sbatch runs a spool copy), nodes not
    importing the installed wheel, SLURM detection not reaching jax.distributed."""
    venv, out = tmp_path / "venv", tmp_path / "out"
    subprocess.run([sys.executable, str(FAKES / "_gpu_python.py"), "make", str(venv)], check=True)
    env = _env(FAKE_SLURM_JOB_ID="77", JAX_COORDINATOR_PORT=str(_free_port()))
    status, _ = _run(["sbatch", "--nodes=2", "launch/gpu_slurm.sbatch", "--activate", str(venv / "bin" / "activate"),
                      "--wheel", str(wheel), "--", *TRAIN, f"output_dir={out}"], env=env, cwd=checkout)
    log = (checkout / "rljax-77.log").read_text()
    assert status == 0, log[-3000:]
    assert (venv / "site" / f"rljax-{VERSION}.dist-info").is_dir()
    assert f"launch: all workers match: python={sys.version.split()[0]}" in log and f"rljax={VERSION}" in log
    assert f"rljax: joining localhost:{env['JAX_COORDINATOR_PORT']} as process 1 of 2" in log
    _assert_trained(out, log)


def test_unreachable_coordinator_fails_with_one_line_within_the_timeout():
    """A worker whose coordinator port is closed exits (code 2) after RLJAX_INIT_TIMEOUT=3 s with
    one line naming the address and the fixes, not jax's C++ abort and stack trace.
    Catches: no pre-check (jax aborts with SIGABRT), a timeout that is not read from the
    environment, a multi-line error."""
    port = _free_port()
    env = {**os.environ, "RLJAX_COORDINATOR_ADDRESS": f"localhost:{port}", "RLJAX_NUM_PROCESSES": "2",
           "RLJAX_PROCESS_ID": "1", "RLJAX_INIT_TIMEOUT": "3"}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "rljax", "train"], env=env, capture_output=True, text=True,
                            timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error == (f"rljax train: error: cannot reach the coordinator localhost:{port} within 3 s: is process 0 "
                     "running? is the port open between hosts (firewall)? set RLJAX_INIT_TIMEOUT=SECONDS to wait "
                     "longer")
    assert result.stderr.strip().splitlines()[:-1] == [
        f"rljax: joining localhost:{port} as process 1 of 2; every process must join within 3 s "
        "(RLJAX_INIT_TIMEOUT)"]
    assert 3 <= elapsed < 15
