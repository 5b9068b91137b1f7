"""Weight transfer between processes for asynchronous RL (`rljax.sharding.transport`, issue 20):
seconds to move a model's params from a trainer process to a sampler process over
jax.experimental.transfer (TCP over loopback here), against one in-memory copy of the same bytes
(`np.array(copy=True)`: the floor of any transport, which must at least write every byte once).

Two local processes joined by jax.distributed, one CPU device each; the params are random arrays
of each model's published parameter shapes' total size (split into 64 leaves), f32 and bf16.
Each size is published `--repeats` times; the sampler pulls every version; the median is reported.

Writes bench/results/transport.json.

    .venv/bin/python bench/bench_transport.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# parameter counts: the default job's model, qwen2-small (bench_sampling), Qwen2.5-0.5B
MODELS = {"default (0.45M)": 450_000, "qwen2-small (27.4M)": 27_400_000, "Qwen2.5-0.5B (494M)": 494_000_000}


def _leaves(n_params: int, dtype):
    import jax.numpy as jnp
    import numpy as np
    per = -(-n_params // 64)
    return [jnp.asarray(np.random.default_rng(i).standard_normal(per, dtype=np.float32)).astype(dtype)
            for i in range(64)]


def peer(process: int, repeats: int, dtypes: list[str]) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rljax.sharding import initialize
    from rljax.sharding.distributed import DistributedConfig
    from rljax.sharding.transport import Transport

    initialize(DistributedConfig.from_env())
    transport = Transport.start(timeout_s=600)
    for name, n in MODELS.items():
        for dt in dtypes:
            dtype = getattr(jnp, dt)
            tree = _leaves(n, dtype)
            channel = f"w-{n}-{dt}"
            if process == 0:
                for v in range(repeats):
                    transport.publish(channel, v, tree, readers=(1,))
                    transport.get(f"ack-{channel}", v, jnp.zeros((), jnp.int32))  # the sampler has it
                host = []
                for _ in range(repeats):  # one memory copy of the same bytes
                    t = time.perf_counter()
                    copies = [np.array(x, copy=True) for x in tree]
                    host.append(time.perf_counter() - t)
                    del copies
                print(json.dumps({"model": name, "dtype": dt, "bytes": sum(x.nbytes for x in tree),
                                  "memcpy_s": statistics.median(host)}), flush=True)
            else:
                seconds = []
                for v in range(repeats):
                    t = time.perf_counter()
                    got = transport.latest(channel, tree, block=True)
                    seconds.append(time.perf_counter() - t)
                    assert got is not None and got[0] == v
                    transport.put(f"ack-{channel}", v, jnp.int32(v), consumer=0)
                print(json.dumps({"model": name, "dtype": dt, "transfer_s": statistics.median(seconds),
                                  "all_s": seconds}), flush=True)
            del tree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer is not None:
        return peer(args.peer, args.repeats, args.dtypes)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", RLJAX_COORDINATOR_ADDRESS=f"localhost:{port}", RLJAX_NUM_PROCESSES="2",
               PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, __file__, "--peer", str(i), "--repeats", str(args.repeats),
                               "--dtypes", *args.dtypes], stdout=subprocess.PIPE, text=True,
                              env={**env, "RLJAX_PROCESS_ID": str(i)}) for i in range(2)]
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    trainer = [json.loads(x) for x in outs[0].splitlines() if x.startswith("{")]
    sampler = [json.loads(x) for x in outs[1].splitlines() if x.startswith("{")]
    rows = []
    for t, s in zip(trainer, sampler):
        row = {**t, **s, "GB_per_s": t["bytes"] / s["transfer_s"] / 1e9}
        rows.append(row)
        print(f"{row['model']:>22} {row['dtype']:>8} {row['bytes'] / 2**20:9.1f} MiB  transfer {row['transfer_s']:7.3f} s "
              f"({row['GB_per_s']:.2f} GB/s)  one memory copy {row['memcpy_s']:7.3f} s")
    import jax
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu_model": cpu,
                       "loadavg_at_end": open("/proc/loadavg").read().split()[:3]},
           "versions": {"python": platform.python_version(), "jax": jax.__version__}, "rows": rows}
    with open(os.path.join(HERE, "results", "transport.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
