"""Two local processes x 4 CPU devices, joined by jax.distributed with gloo collectives, train
like one process with 8 devices; their collective orbax checkpoint restores in one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

import multihost_worker as w
from rljax import sharding

_LAYOUT, _STEPS, _TIMEOUT_S = "dp2_fsdp2_tp2", 2, 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_workers(out_dir: str) -> list[str]:
    """Starts both workers, waits at most _TIMEOUT_S, always kills them; returns their logs."""
    port = str(_free_port())
    script = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, script, str(i), "2", port, out_dir, _LAYOUT, str(_STEPS)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
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
    return logs


def test_two_processes_train_like_one_and_checkpoint_restores_in_one(tmp_path):
    """DP=2 x FSDP=2 x TP=2 over 2 processes (each loading only its rows of every batch) gives the
    losses of one 8-device process (<= 1e-5); the checkpoint both processes wrote collectively
    restores here, into another layout (FSDP=8), equal to the one-process params and Adam state."""
    _run_workers(str(tmp_path))
    with open(tmp_path / "losses.json") as f:
        losses = json.load(f)

    layout, step = w.sharded_step(_LAYOUT)  # the same compiled step, one process, 8 devices
    params, opt_state = w.initial_state(layout)
    ref_losses = []
    for i in range(_STEPS):
        params, opt_state, loss = step(params, opt_state, *w.batch(i))
        ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)

    target = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(fsdp=8)))
    p0, _ = w.initial_state()
    shardings = {"params": target.params(p0), "opt_state": target.opt_state(w.optimizer(), p0)}
    abstract = sharding.abstract_like({"params": params, "opt_state": opt_state}, shardings)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt", abstract)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves({"params": params, "opt_state": opt_state})):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert restored["params"]["layers"]["q"].sharding == shardings["params"]["layers"]["q"]
