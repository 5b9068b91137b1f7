"""Sharding: a (data, fsdp, tensor) mesh from config, partition rules, trainer and sampler
layouts, compiled functions with explicit shardings, on-device weight sync, multi-host helpers."""

from rljax.sharding.distributed import (
    DistributedConfig,
    global_batch,
    initialize,
    is_main_process,
    main_process_only,
    process_rows,
)
from rljax.sharding.layout import (
    Layout,
    abstract_like,
    device_bytes,
    make_sharded,
    sampler_layout,
    sync_weights,
    trainer_layout,
)
from rljax.sharding.mesh import AXES, BATCH_AXES, MeshConfig, axis_size, make_mesh, split_devices
from rljax.sharding.rules import (
    DEFAULT_RULES,
    Rule,
    batch_sharding,
    batch_shardings,
    cache_shardings,
    named,
    opt_state_shardings,
    param_shardings,
    shard_params,
    spec_for,
    tree_specs,
)

__all__ = [
    "MeshConfig", "make_mesh", "AXES", "BATCH_AXES", "axis_size", "split_devices",
    "Rule", "DEFAULT_RULES", "spec_for", "tree_specs", "named", "param_shardings", "shard_params",
    "opt_state_shardings", "batch_sharding", "batch_shardings", "cache_shardings",
    "Layout", "trainer_layout", "sampler_layout", "make_sharded", "sync_weights", "device_bytes",
    "abstract_like",
    "DistributedConfig", "initialize", "is_main_process", "main_process_only", "global_batch",
    "process_rows",
]
