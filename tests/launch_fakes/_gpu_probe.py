"""Stands in for `python3 -m rljax train` in a fake SLURM step (tests/test_launch_gpu.py): prints
`probe {json}`, what jax.distributed.initialize would resolve for this process with
RLJAX_DISTRIBUTED=auto: JAX_LOCAL_DEVICE_IDS first, then jax's own cluster detection
(`ClusterEnv.auto_detect_unset_distributed_params`, as initialize calls it). Its local device
ids are CUDA ordinals, so the GPUs it uses are those entries of CUDA_VISIBLE_DEVICES; an
ordinal the task cannot see fails here as it would on the GPU.
"""

from __future__ import annotations

import json
import os

from jax._src import clusters

assert os.environ["RLJAX_DISTRIBUTED"] == "auto", "the SLURM script must let jax detect the cluster"
ids = os.environ.get("JAX_LOCAL_DEVICE_IDS")
address, count, process_id, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
    os.environ.get("JAX_COORDINATOR_ADDRESS"), None, None, [int(i) for i in ids.split(",")] if ids else None,
    None, 300)
visible = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
print("probe", json.dumps({"node": int(os.environ["SLURM_NODEID"]), "coordinator": address, "num_processes": count,
                           "process_id": process_id, "gpus": [visible[i] for i in local]}), flush=True)
