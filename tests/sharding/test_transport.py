"""The cross-process transport of asynchronous RL (`rljax.sharding.transport`): two local
processes joined by jax.distributed move params and rollouts over jax.experimental.transfer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from rljax.sharding.transport import transfer_id

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where transport_peer.py is


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_pair(**extra_env) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", RLJAX_COORDINATOR_ADDRESS=f"localhost:{port}", RLJAX_NUM_PROCESSES="2",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")]), **extra_env)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "transport_peer.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**env, "RLJAX_PROCESS_ID": str(i)})
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outs)]


def test_params_and_rollouts_cross_processes_exactly_and_in_version_order():
    """The trainer publishes params versions 0..3; before each rollout the sampler pulls the
    newest version it was offered, and returns (version, sum of its params, index) through the
    queue channel. Every rollout arrives, in order, computed from exactly the version it names
    (its params sum equals the sum of that version's values: a pull into the wrong buffer, a
    stale offer served for a new request, or a lost item changes it).
    The sampler starts 1 s late, so the trainer publishes version 0 before anyone asked and then
    waits for rollout 0: it must answer the late request while it waits.
    Catches: answering a request with an older tree than the version it names (or with the
    version the reader already holds, which leaves it on version 0), a queue item pulled under
    another item's id, a trainer that serves only when it publishes (both sides wait: timeout)."""
    done = _run_pair(PEER_SAMPLER_DELAY_S="1", PEER_TIMEOUT_S="30")
    for p in done:
        assert p.returncode == 0, p.stdout[-3000:]
    line = next(x for x in done[0].stdout.splitlines() if x.startswith("{"))
    received = json.loads(line)["received"]
    base = float(np.arange(6 * 1024, dtype=np.float64).sum())
    assert [r["index"] for r in received] == [0, 1, 2, 3]
    assert [r["version"] for r in received] == [0, 1, 2, 3]
    for r in received:
        v = r["version"]
        assert r["total"] == pytest.approx(base + v * 6 * 1024 + 3 * v, rel=1e-6)


def test_a_silent_peer_times_out_with_one_line_not_a_hang():
    """The sampler process exits without ever pulling or putting: the trainer's wait for rollout 0
    ends with TransportTimeout naming the key within its 3 s timeout.
    Catches: a blocking get without a deadline (the test would hit its 120 s limit)."""
    done = _run_pair(PEER_ROLE="silent", PEER_TIMEOUT_S="3")
    assert done[0].returncode != 0
    assert "TransportTimeout: no item 0 at rljax/transport/rollouts/item/0 within 3 s" in done[0].stdout


def test_offer_ids_separate_channels_readers_and_serials():
    """Catches: an id that collides between the weights and rollouts channels or two readers."""
    ids = {transfer_id(c, r, s) for c in ("weights", "rollouts") for r in range(3) for s in (0, 1, 2**32 - 1)}
    assert len(ids) == 18
    assert all(0 <= i < 2**63 for i in ids)
