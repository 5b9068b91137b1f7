"""`rl.mode = "async"` across processes (`rljax.drivers.remote`): two local processes with one CPU
device each, joined by jax.distributed, run `rljax train` with `mesh.sampler_processes=1`:
process 0 trains, process 1 samples, and weights and rollouts cross over the transport."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rljax.models.setup import build_policy, build_tokenizer
from rljax.checkpoint import Checkpointer
from rljax.errors import ConfigError
from rljax.train.config import load_config
from rljax.drivers.remote import Roles

_TIMEOUT_S = 240
_ETA = 1
_RUN = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=32", "data.size=400", "data.eval_size=16", "eval.size=16",
        "warm_start.steps=10", "warm_start.batch_size=64", "warm_start.learning_rate=3e-3",
        "rl.prompts_per_iteration=16", "sampling.num_samples=4", "optim.learning_rate=3e-3",
        "metrics.tensorboard=false", "metrics.progress_bar=false", "eval.every=100", "checkpoint.every=1", "checkpoint.keep_last=3",
        "metrics.samples_every=0", "rl.mode=async", "mesh.sampler_processes=1", f"rl.max_staleness={_ETA}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(out_dir, *overrides) -> list[subprocess.Popen]:
    """`rljax train` in two processes (one CPU device each) joined through the RLJAX_* variables."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # -O0 as the suite (tests/conftest.py): LLVM optimises less, the programs are the same.
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0",
               RLJAX_COORDINATOR_ADDRESS=f"localhost:{port}", RLJAX_NUM_PROCESSES="2")
    return [subprocess.Popen([sys.executable, "-m", "rljax.cli", "train", *_RUN, *overrides, f"output_dir='{out_dir}'"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**env, "RLJAX_PROCESS_ID": str(i)}) for i in range(2)]


def _communicate(procs: list[subprocess.Popen], timeout_s: float = _TIMEOUT_S) -> list[str]:
    """Each process's log; kills whatever is left after `timeout_s` (no process outlives a test)."""
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return logs


def _rows(out_dir) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """(output dir, seconds) of a 3-iteration two-process run that both processes finished with 0."""
    out = tmp_path_factory.mktemp("remote") / "run"
    start = time.perf_counter()
    procs = _start(out, "rl.iterations=3", "mesh.transport_timeout_s=60")
    logs = _communicate(procs)
    seconds = time.perf_counter() - start
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    assert "sampler process 1: " in logs[1]
    assert "sampler host done" in logs[1] and "held-out greedy accuracy: " in logs[0]  # only the trainer reports it
    return out, seconds


def test_trainer_and_sampler_processes_train_with_bounded_staleness(three_steps, tmp_path):
    """Process 0 trains 3 iterations on rollouts that process 1 samples with the weights it pulls.
    Both exit 0; the trainer writes one row per step with staleness <= eta, in which a row was
    sampled with weights the trainer published after an update (batch 2 must be drawn with
    version 1: a sampler stuck on version 0 waits for it and times out, and a version label
    not taken from the pulled weights gives another staleness),
    the transport's publish and pull times are reported, and the params checkpointed after step 3
    differ from those after step 1 (whose update runs at learning rate 0: the warmup's first step).
    Catches: a sampler that never receives new weights (staleness grows past eta: rows dropped),
    a trainer that trains on nothing (params equal the initial ones), a missing stop key (the
    sampler waits out its timeout and exits non-zero), a checkpoint that every process must join
    (orbax's barrier hangs: the test times out)."""
    out, seconds = three_steps
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    trained = rows[1:]
    assert max(r["async/staleness_max"] for r in trained) <= _ETA
    assert sum(r["async/dropped_rows"] for r in trained) == 0
    # batch 0 can only be drawn with version 0 (trained at 0), batch 2 only with version 1 (it must be
    # >= 2 - eta, and version 2 needs batch 2 trained): staleness 1 at step 3 means version 1 arrived
    assert trained[0]["async/staleness_max"] == 0 and trained[2]["async/staleness_max"] == 1
    assert all(r["time/weight_sync_s"] > 0 for r in trained)
    assert sum(r["time/weight_pull_s"] for r in trained) > 0
    print(f"\nwall {seconds:.1f} s; per iteration after compile {np.mean([r['time/iteration_s'] for r in trained[1:]]):.4f}"
          f" s; pull {[round(r['time/weight_pull_s'], 4) for r in trained]} s")

    cfg = load_config(None, _RUN + [f"output_dir='{tmp_path / 'unused'}'"])
    _, template = build_policy(cfg.model, build_tokenizer(cfg.model), jax.random.key(0))
    template = jax.tree.map(np.asarray, template)
    with Checkpointer(out / "checkpoints", read_only=True) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3]
        first, last = (jax.tree.map(np.asarray, ckpt.restore(s, params=template).params) for s in (1, 3))
    assert max(r["grad_norm"] for r in trained[1:]) > 0  # the warm start left rewards that differ
    moved = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(last), jax.tree.leaves(first), strict=True)]
    assert max(moved) > 1e-4


def test_a_resumed_run_restarts_the_queue_empty(three_steps, tmp_path):
    """The 3-step run resumed to 4 steps in two new processes: the trainer restores its checkpoint
    (saved from host copies), the sampler restarts at the trainer's next batch with the restored
    weights, and step 4 reports the restarted queue, with staleness 0 (its batch can only be drawn
    with version 3, the one the resumed trainer publishes first).
    Catches: a resumed sampler that starts from batch 0 (the trainer refuses the wrong index), a
    checkpoint that does not restore across processes, a restart not reported."""
    out = tmp_path / "run"
    shutil.copytree(three_steps[0], out)
    procs = _start(out, "rl.iterations=4", "mesh.transport_timeout_s=60", "--resume")
    for p, log in zip(procs, _communicate(procs)):
        assert p.returncode == 0, log[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["async/restarted_queue"] for r in rows[1:]] == [0, 0, 0, 1]
    assert rows[4]["async/staleness_max"] == 0


def test_a_killed_sampler_stops_the_trainer_with_the_transport_timeout(tmp_path):
    """The sampler process is killed (SIGKILL) once the trainer has written step 1; the trainer,
    waiting for the next rollout, fails within its 3 s transport timeout (TransportTimeout naming
    the rollout channel) or at once when the kill broke a pull in flight (SamplerLost, one line),
    and exits without waiting out jax.distributed's shutdown barrier on the dead process.
    Catches: a trainer wait without a deadline (the test's kill timer fires instead), a wait
    that swallows the timeout and retries, an exit through the shutdown barrier (100 s, then
    SIGABRT)."""
    out = tmp_path / "run"
    procs = _start(out, "rl.iterations=1000", "mesh.transport_timeout_s=3", "warm_start.steps=0",
                   "checkpoint.every=1000")
    try:
        deadline = time.monotonic() + _TIMEOUT_S
        while len(_rows(out)) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        log = procs[0].communicate(timeout=60)[0]
        stopped_after = time.monotonic() - killed
    finally:
        _communicate(procs, timeout_s=1)
    assert procs[0].returncode != 0
    lost = [x for x in log.splitlines() if x.startswith(("rljax.sharding.transport.TransportTimeout: no item",
                                                          "rljax.drivers.remote.SamplerLost: "))]
    assert len(lost) == 1 and "rollouts/1" in lost[0], log[-3000:]
    print(f"\ntrainer stopped {stopped_after:.1f} s after the kill")
    assert stopped_after < 30


@pytest.mark.parametrize("overrides, match", [
    (["mesh.sampler_processes=1"], "rl.mode=async"),
    (["mesh.sampler_processes=1", "rl.mode=async", "mesh.sampler_devices=1"], "mesh.sampler_devices"),
    (["mesh.sampler_processes=-1"], "mesh.sampler_processes"),
    (["mesh.transport_timeout_s=0"], "transport_timeout_s"),
    (["mesh.sampler_processes=1", "rl.mode=async", "data.prompt_buckets=[32]"], "data.prompt_buckets"),
])
def test_sampler_processes_config_errors(overrides, match):
    """Catches: a sampler host in sync mode, sampler processes combined with sampler devices or
    prompt buckets (rollouts cross hosts with one shape), or a negative count / zero timeout
    accepted at load instead of refused with one line."""
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_sampler_processes_need_more_processes_and_one_trainer():
    """In one process there is no host left to train: refused with a one-line ConfigError naming
    RLJAX_NUM_PROCESSES.
    Catches: a one-process run that makes process 0 a sampler host (it would wait for a trainer
    that never comes)."""
    cfg = load_config(None, ["rl.mode=async", "mesh.sampler_processes=1"])
    with pytest.raises(ConfigError, match="RLJAX_NUM_PROCESSES"):
        Roles.from_mesh(cfg.mesh)
