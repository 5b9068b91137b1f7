"""One side of tests/sharding/test_transport.py's two-process run (process 0: trainer, 1: sampler).

The trainer publishes params versions 0..K-1 on the latest-value channel "weights" and takes
rollout k from the queue channel "rollouts" before publishing version k+1; the sampler pulls the
newest weights it has been offered before each rollout and puts rollout k = (version used,
sum of the params it holds, k). Process 0 prints one JSON line with what it received.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.sharding import initialize
from rljax.sharding.distributed import DistributedConfig
from rljax.sharding.transport import Transport

K = 4


def params_of(version: int, device):
    base = np.arange(6 * 1024, dtype=np.float32).reshape(6, 1024)
    tree = {"w": base + version, "b": {"bias": np.full((3,), version, np.int32)}}
    return jax.device_put(tree, device)


def main() -> None:
    process = int(os.environ["RLJAX_PROCESS_ID"])
    initialize(DistributedConfig.from_env())
    device = jax.local_devices()[0]
    transport = Transport.start(timeout_s=float(os.environ.get("PEER_TIMEOUT_S", "60")))
    rollout_like = {"version": jnp.zeros((), jnp.int32), "total": jnp.zeros((), jnp.float32),
                    "index": jnp.zeros((), jnp.int32)}
    rollout_like = jax.device_put(rollout_like, device)
    if os.environ.get("PEER_ROLE") == "silent" and process == 1:
        return  # never answers: the other side must time out
    if process == 0:
        got = []
        for k in range(K):
            transport.publish("weights", k, params_of(k, device), readers=(1,))
            item = transport.get("rollouts", k, rollout_like)
            got.append({key: float(v) for key, v in jax.device_get(item).items()})
        print(json.dumps({"received": got}), flush=True)
    else:
        time.sleep(float(os.environ.get("PEER_SAMPLER_DELAY_S", "0")))  # the trainer publishes first
        like = params_of(0, device)
        version, params = transport.latest("weights", like, block=True)
        for k in range(K):
            newer = transport.latest("weights", like, block=k > version)  # wait for version k once it is due
            if newer is not None:
                version, params = newer
            total = sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(params))
            transport.put("rollouts", k, {"version": jnp.int32(version), "total": total, "index": jnp.int32(k)},
                          consumer=0)
        jax.block_until_ready(params)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
