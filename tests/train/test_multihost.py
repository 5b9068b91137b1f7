"""Two local processes x 4 CPU devices, joined by jax.distributed with gloo collectives, run
`rljax train` like one process with 8 devices; their collective orbax checkpoint restores in one
process, and only process 0 writes metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np

from rljax import sharding
from rljax.checkpoint import Checkpointer
from rljax.train.config import load_config
from rljax.train.loop import train
from test_loop import TINY

_TIMEOUT_S = 300
# DP=2 x FSDP=2 x TP=2: the data axis spans the two processes (each loads its half of every batch).
_RUN = TINY + ["data.size=400", "data.eval_size=16", "eval.size=16", "warm_start.steps=10", "rl.iterations=2",
               "rl.prompts_per_iteration=16", "eval.every=100", "checkpoint.every=100",
               "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
               # k_bias has an exactly-zero gradient (softmax ignores a shift shared by all keys), so
               # Adam's g / (sqrt(v) + eps) turns its rounding noise into steps of up to lr. The
               # warm start runs on one device of each process, and XLA:CPU rounds differently in
               # a 4-device and an 8-device process: its lr 3e-3 would leave k_bias 1e-5 apart
               # before RL starts; 1e-3 leaves 7e-7. In RL, eps=1e-6 keeps the noise out of steps.
               "warm_start.learning_rate=1e-3", "optim.eps=1e-6"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_train(out_dir) -> list[subprocess.Popen]:
    """`rljax train` in two processes joined through the RLJAX_* variables (4 CPU devices each)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # -O0 as the suite (tests/conftest.py): the one-process reference here compiles so too.
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
               JAX_PLATFORMS="cpu",
               JAX_DEFAULT_MATMUL_PRECISION="highest", RLJAX_COORDINATOR_ADDRESS=f"localhost:{port}",
               RLJAX_NUM_PROCESSES="2")
    return [subprocess.Popen([sys.executable, "-m", "rljax.cli", "train", *_RUN, f"output_dir='{out_dir}'"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**env, "RLJAX_PROCESS_ID": str(i)}) for i in range(2)]


def _wait(procs: list[subprocess.Popen]) -> None:
    """Waits at most _TIMEOUT_S, always kills what is left; fails with the log of a failed process."""
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=_TIMEOUT_S)
            logs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time")}


def test_two_process_rljax_train_equals_one_process_and_checkpoint_restores_in_one(tmp_path):
    """Two processes (each loading only its rows, rewards verified by the io_callback on process 0)
    run 2 iterations of `rljax train` (one fused program per iteration) and give the metrics,
    params and Adam state (<= 1e-5) of one 8-device process, run here with the split sampler layout
    (itself equal to the fused program: tests/train/test_loop.py; it compiles faster). Only process 0
    writes metrics: one row per step. The checkpoint both processes wrote collectively restores
    here, into another layout (FSDP=8)."""
    procs = _start_train(tmp_path / "two")
    try:  # the one-process reference runs meanwhile (the workers mostly wait on each other)
        one = train(load_config(None, _RUN + ["mesh.sampler=tensor", f"output_dir='{tmp_path / 'one'}'"]),
                    log=lambda *_: None)
    finally:
        _wait(procs)

    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "time/sample_and_update_s" in rows[1]  # the fused program ran
    assert max(r["adv/std"] for r in rows[1:]) > 0  # rewards differ: the update did learn something
    for got, want in zip(rows, one.history, strict=True):
        got, want = _untimed(got), _untimed(want)
        assert sorted(got) == sorted(want)
        np.testing.assert_allclose([got[k] for k in sorted(want)], [want[k] for k in sorted(want)], atol=1e-5, rtol=0)

    target = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(fsdp=8)))
    templates = {"params": one.state.params, "opt_state": one.state.opt_state}
    templates = jax.device_put(templates, target.tree(templates))
    with Checkpointer(tmp_path / "two" / "checkpoints", read_only=True) as ckpt:
        assert ckpt.latest_step() == 2
        restored = ckpt.restore(params=templates["params"], opt_state=templates["opt_state"],
                                model_config=one.state.model_cfg)
    want_leaves = jax.tree_util.tree_leaves_with_path((one.state.params, one.state.opt_state))
    for got, (path, want) in zip(jax.tree.leaves((restored.params, restored.opt_state)), want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0,
                                   err_msg=jax.tree_util.keystr(path))
    q = restored.params["layers"]["q"]
    assert q.sharding.is_equivalent_to(templates["params"]["layers"]["q"].sharding, q.ndim)
