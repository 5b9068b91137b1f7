"""Multi-host runs: joining the cluster, per-process data, process-0-only side effects.

JAX is multi-controller: every host runs the same program on its own devices, and compiled
functions over a global mesh communicate between hosts. Each process loads only its rows of the
global batch (grain shards sources by process index) and `global_batch` stitches the pieces
into one global array. Checkpoints are written collectively by orbax (each process saves the
shards it holds). Metrics and logs are written by process 0 only (`main_process_only`).

Joining has a deadline, RLJAX_INIT_TIMEOUT seconds (default 300). jax.distributed.initialize
does not raise when the coordinator is unreachable: after its timeout the C++ client aborts the
process (SIGABRT, "another task died", a stack trace). So a process other than the coordinator
first opens a TCP connection to the coordinator, retrying until the deadline, and fails with one
line naming the address and the fixes instead.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rljax.errors import ConfigError, LaunchError
from rljax.sharding.rules import batch_axes

_ENV = {"coordinator_address": "RLJAX_COORDINATOR_ADDRESS", "num_processes": "RLJAX_NUM_PROCESSES",
        "process_id": "RLJAX_PROCESS_ID"}
_COLLECTIVES = ("gloo", "mpi")
_TIMEOUT_ENV = "RLJAX_INIT_TIMEOUT"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-host run.

    `auto=True` lets JAX detect everything (Cloud TPU pods, SLURM, Open MPI). Otherwise give the
    coordinator's `host:port`, the number of processes and this process's id (0-based).
    `cpu_collectives` picks the cross-process collectives for CPU devices (tests, CPU clusters).
    `initialization_timeout` (seconds, RLJAX_INIT_TIMEOUT) bounds both the wait for the
    coordinator to accept connections and jax's wait for every process to join.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    cpu_collectives: str = "gloo"
    initialization_timeout: int = 300

    def __post_init__(self):
        explicit = (self.coordinator_address, self.num_processes, self.process_id)
        if any(v is not None for v in explicit) and any(v is None for v in explicit):
            raise ConfigError("distributed: set coordinator_address, num_processes and process_id together "
                              f"(got {explicit}), or set auto=true on TPU pods/SLURM")
        if self.num_processes is not None and not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"distributed: process_id={self.process_id} must be in [0, {self.num_processes})")
        if self.initialization_timeout <= 0:
            raise ConfigError(f"distributed: initialization_timeout={self.initialization_timeout} must be a "
                              f"positive number of seconds ({_TIMEOUT_ENV})")
        if self.cpu_collectives not in _COLLECTIVES:
            raise ConfigError(f"distributed: cpu_collectives={self.cpu_collectives!r}; choose one of {_COLLECTIVES}")

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator_address is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistributedConfig:
        """Reads RLJAX_COORDINATOR_ADDRESS, RLJAX_NUM_PROCESSES, RLJAX_PROCESS_ID (explicit) or
        RLJAX_DISTRIBUTED=auto (ignored when the explicit ones are set); none of them set means a
        single-process run. RLJAX_INIT_TIMEOUT sets the joining deadline in seconds."""
        env = os.environ if env is None else env
        kwargs: dict = {}
        if env.get(_TIMEOUT_ENV):
            try:
                kwargs["initialization_timeout"] = int(env[_TIMEOUT_ENV])
            except ValueError:
                raise ConfigError(f"{_TIMEOUT_ENV}={env[_TIMEOUT_ENV]!r} must be a whole number of seconds") from None
        for field, var in _ENV.items():
            if env.get(var):
                value = env[var]
                if field != "coordinator_address":
                    try:
                        value = int(value)
                    except ValueError:
                        raise ConfigError(f"{var}={env[var]!r} must be an integer") from None
                kwargs[field] = value
        # Explicit variables win over auto-detection: a launcher that knows the coordinator (a
        # local stand-in for a pod, an SSH cluster) overrides what the platform would detect.
        auto = env.get("RLJAX_DISTRIBUTED", "").lower() == "auto" and not kwargs.keys() & _ENV.keys()
        return cls(auto=auto, **kwargs)


def initialize(config: DistributedConfig | None = None) -> bool:
    """Joins the cluster described by `config` (default: from the environment) before any JAX
    computation. Returns True for a multi-process run; a no-op for a single process or when
    already joined."""
    config = DistributedConfig.from_env() if config is None else config
    if not config.enabled:
        return False
    if jax.distributed.is_initialized():
        return True
    jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    coordinator = _coordinator(config)
    if coordinator is not None:
        address, process_id, num_processes = coordinator
        print(f"rljax: joining {address} as process {process_id} of {num_processes}; every process must join "
              f"within {config.initialization_timeout} s ({_TIMEOUT_ENV})", file=sys.stderr, flush=True)
        if process_id != 0:
            wait_for_coordinator(address, config.initialization_timeout)
    if config.auto:
        jax.distributed.initialize(initialization_timeout=config.initialization_timeout)
    else:
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                                   initialization_timeout=config.initialization_timeout)
    return True


def _coordinator(config: DistributedConfig) -> tuple[str, int, int] | None:
    """(coordinator address, this process's id, process count) as jax.distributed will use them,
    or None where only jax can tell. Auto mode is resolved for SLURM only, with jax's own reader of
    its environment variables and only when jax would pick SLURM (the first cluster jax finds);
    Cloud TPU detection queries the metadata server and waits for the coordinator by itself."""
    if not config.auto:
        return config.coordinator_address, config.process_id, config.num_processes
    try:
        from jax._src.clusters import ClusterEnv, SlurmCluster
        env = None
        for env in ClusterEnv._cluster_types:  # jax's detection order; SLURM's comes before the TPU ones
            if env is SlurmCluster or (not env.opt_in_only_method and env.is_env_present()):
                break
        if env is not SlurmCluster or not SlurmCluster.is_env_present():
            return None
        address = (os.environ.get("JAX_COORDINATOR_ADDRESS")
                   or SlurmCluster.get_coordinator_address(None, os.environ.get("JAX_COORDINATOR_PORT")))
        return address, SlurmCluster.get_process_id(), SlurmCluster.get_process_count()
    except (ImportError, AttributeError):  # a jax whose private cluster API moved: no pre-check
        return None


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Returns once `host:port` accepts a TCP connection; raises LaunchError (one line) when it
    has not within `timeout_s`. Refused connections and unresolvable names are retried: the
    coordinator (process 0) may simply start later than this process."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal, [::1]:1234
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"cannot reach the coordinator {address} within {timeout_s:g} s: is process 0 running? is the "
                    f"port open between hosts (firewall)? set {_TIMEOUT_ENV}=SECONDS to wait longer") from None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def is_main_process() -> bool:
    """True on process 0, the one that writes metrics, logs and other single-copy side effects."""
    return jax.process_index() == 0


def main_process_only(fn: Callable) -> Callable:
    """Wraps `fn` so it runs on process 0 only and returns None on the others."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs) if is_main_process() else None
    return wrapped


def global_batch(local_batch, mesh: Mesh):
    """One global array per leaf from each process's rows (its slice along the leading dim).

    Process p holds rows [p * b, (p + 1) * b) of a global batch of process_count * b rows; the
    leading dim is sharded over data x fsdp (where it divides), so no data moves between hosts.
    """
    def one(x):
        global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        sharding = NamedSharding(mesh, P(batch_axes(mesh, global_shape[0])))
        return jax.make_array_from_process_local_data(sharding, x, global_shape)
    return jax.tree.map(one, local_batch)


def process_rows(mesh: Mesh, global_rows: int) -> slice:
    """The rows of a global batch of `global_rows` that this process loads for `global_batch`."""
    sharding = NamedSharding(mesh, P(batch_axes(mesh, global_rows)))
    index = sharding.addressable_devices_indices_map((global_rows,)).values()
    bounds = {(i[0].start or 0, global_rows if i[0].stop is None else i[0].stop) for i in index}
    start, stop = min(b[0] for b in bounds), max(b[1] for b in bounds)
    if sum(b[1] - b[0] for b in bounds) != stop - start:
        raise ConfigError(f"this process's batch rows are not contiguous on mesh {dict(mesh.shape)}; "
                          "build the mesh with make_mesh so each process holds a block of rows")
    return slice(start, stop)
