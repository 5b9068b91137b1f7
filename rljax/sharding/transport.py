"""Moving pytrees of arrays between processes that share no mesh: the trainer hosts' params to
the sampler hosts, and rollouts back (asynchronous RL across hosts: AReaL, Fu et al. 2025;
ReaLHF, Mei et al. 2024; verl's one-step off-policy mode).

Inside one process (or one mesh) `sync_weights` moves params with a compiled identity. Sampler
and trainer hosts in an asynchronous run are two programs on two device sets that never run one
program together, so a collective cannot move the bytes. This module moves them over XLA's
transfer server (`jax.experimental.transfer`, the DCN cross-slice transfer that TPU pods use;
on CPU it runs over TCP): the sending process *offers* device arrays under a 64-bit id
(`await_pull`), the receiving process *pulls* them straight into device buffers of the shapes,
dtypes and shardings it asks for. Nothing goes through pickle or the host-side Python heap.

Who offers what, and when, is agreed through the key-value store that `jax.distributed`
already runs (the coordinator), with plain string keys under `rljax/transport/{channel}/`:

- **Latest-value channel** (`publish` / `latest`; the weights): a reader posts a request number,
  the publisher answers at its next `publish` (or `serve_requests`) with its newest version and
  offers that tree once for that reader. An offer is made only for a request, so a version no
  reader asked for is never pinned in memory, and a slow reader simply skips versions.
- **Queue channel** (`put` / `get`; rollouts): item k of a channel is offered once, for its one
  consumer, under the id of (channel, k); `get(k)` blocks (with a timeout) until item k exists.
  The producer bounds the queue by reading the consumer's count (`consumed`).

Every blocking call takes a timeout and raises `TransportTimeout` with the channel and what it
waited for, so a dead peer stops the run instead of hanging it. A process waiting on anything
keeps answering its own readers' requests (no thread: the waits poll the store), so a trainer
waiting for a rollout still serves the weights that rollout's sampler asked for.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
import zlib
from typing import Any, Protocol

import jax

_PREFIX = "rljax/transport"
_POLL_S = 0.002  # between polls of the store while waiting


class TransportTimeout(RuntimeError):
    """A peer did not answer within the timeout (it died, or never started)."""


class KeyValueStore(Protocol):
    """The subset of jax.distributed's coordinator client this module uses."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...

    def key_value_try_get(self, key: str) -> str: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...


def distributed_store() -> KeyValueStore:
    """The coordinator's key-value store of this `jax.distributed` run."""
    from jax._src import distributed  # the public API exposes no handle on the client

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised: call rljax.sharding.initialize() first")
    return client


def transfer_id(channel: str, reader: int, serial: int) -> int:
    """A 63-bit offer id: 20 bits of the channel name's CRC, 11 of the reader, 32 of the serial."""
    return ((zlib.crc32(channel.encode()) & 0xFFFFF) << 43) | ((reader & 0x7FF) << 32) | (serial & 0xFFFFFFFF)


def _try_get(store: KeyValueStore, key: str) -> str | None:
    try:
        return store.key_value_try_get(key)
    except Exception:  # the client raises NOT_FOUND for a missing key
        return None


@dataclasses.dataclass
class Transport:
    """This process's end: a transfer server, the store, and what it served or consumed so far.

    `start()` opens the server on `host` (an address peers can reach: the host's own IP on a
    cluster, 127.0.0.1 for local processes) and registers its address under the process index.
    """

    server: Any
    store: KeyValueStore
    process: int
    timeout_s: float = 120.0
    _connections: dict[int, Any] = dataclasses.field(default_factory=dict)
    _latest: dict[str, tuple[int, Any]] = dataclasses.field(default_factory=dict)  # channel -> (version, tree)
    _answered: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)  # (channel, reader) -> request
    _sent: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)  # (channel, reader) -> version
    _requested: dict[str, int] = dataclasses.field(default_factory=dict)  # channel -> this reader's request
    _have: dict[str, int] = dataclasses.field(default_factory=dict)  # channel -> version this reader holds
    _readers: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # channel -> its readers

    @classmethod
    def start(cls, *, host: str = "127.0.0.1", store: KeyValueStore | None = None, process: int | None = None,
              timeout_s: float = 120.0) -> Transport:
        from jax.experimental import transfer

        client = jax.local_devices()[0].client
        server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"] * jax.local_device_count())
        store = distributed_store() if store is None else store
        process = jax.process_index() if process is None else process
        store.key_value_set(f"{_PREFIX}/address/{process}", server.address(), allow_overwrite=True)
        return cls(server=server, store=store, process=process, timeout_s=timeout_s)

    # ------------------------------------------------------------------ latest-value channels

    def publish(self, channel: str, version: int, tree, *, readers: tuple[int, ...]) -> int:
        """Makes `tree` the channel's newest version and answers the readers' pending requests
        with it; returns how many requests it answered. Non-blocking: the bytes move when each
        reader pulls."""
        self._latest[channel] = (version, tree)
        self._readers[channel] = tuple(readers)
        return self.serve_requests(channel, readers=readers)

    def serve_requests(self, channel: str, *, readers: tuple[int, ...]) -> int:
        """Answers each reader whose request is newer than the last one answered, when the
        newest version is newer than the one that reader was last sent (no-op when nothing was
        published yet)."""
        if channel not in self._latest:
            return 0
        version, tree = self._latest[channel]
        served = 0
        for reader in readers:
            posted = _try_get(self.store, f"{_PREFIX}/{channel}/request/{reader}")
            if posted is None or int(posted) <= self._answered.get((channel, reader), -1):
                continue
            if version <= self._sent.get((channel, reader), -1):
                continue  # the reader holds this version: its request waits for the next one
            request = int(posted)
            self.server.await_pull(transfer_id(channel, reader, request), tree)
            self.store.key_value_set(f"{_PREFIX}/{channel}/answer/{reader}/{request}", f"{version}:{self.process}",
                                     allow_overwrite=True)
            self._answered[(channel, reader)] = request
            self._sent[(channel, reader)] = version
            served += 1
        return served

    def latest(self, channel: str, like, *, block: bool = False) -> tuple[int, Any] | None:
        """(version, tree) when the publisher answered this reader's request with a version newer
        than the one it holds, else None (`block=True`: wait for the answer, up to the timeout).
        `like` gives each leaf's shape, dtype and sharding (arrays or ShapeDtypeStructs with
        `sharding`); the pull writes straight into buffers laid out that way. Posts the next
        request before returning, so the publisher answers it at its next publish."""
        request = self._requested.get(channel)
        if request is None:
            request = self._post_request(channel)
        key = f"{_PREFIX}/{channel}/answer/{self.process}/{request}"
        answer = self._wait(key, what=f"an answer to request {request}") if block else _try_get(self.store, key)
        if answer is None:
            return None
        version, publisher = (int(x) for x in answer.split(":"))
        tree = self._pull(publisher, transfer_id(channel, self.process, request), like)
        self._post_request(channel)
        if version <= self._have.get(channel, -1):
            return None  # answered with what this reader already holds
        self._have[channel] = version
        return version, tree

    def _post_request(self, channel: str) -> int:
        request = self._requested.get(channel, -1) + 1
        self._requested[channel] = request
        self.store.key_value_set(f"{_PREFIX}/{channel}/request/{self.process}", str(request), allow_overwrite=True)
        return request

    # ------------------------------------------------------------------ queue channels

    def put(self, channel: str, index: int, tree, *, consumer: int) -> None:
        """Offers item `index` of the channel once, for `consumer`."""
        self.server.await_pull(transfer_id(channel, consumer, index), tree)
        self.store.key_value_set(f"{_PREFIX}/{channel}/item/{index}", str(self.process), allow_overwrite=True)

    def get(self, channel: str, index: int, like):
        """Item `index` of the channel (waits for it, up to the timeout) and records it consumed."""
        producer = int(self._wait(f"{_PREFIX}/{channel}/item/{index}", what=f"item {index}"))
        tree = self._pull(producer, transfer_id(channel, self.process, index), like)
        self.store.key_value_set(f"{_PREFIX}/{channel}/consumed", str(index + 1), allow_overwrite=True)
        return tree

    def consumed(self, channel: str) -> int:
        """How many items of the channel its consumer has taken (the producer's queue bound)."""
        return int(_try_get(self.store, f"{_PREFIX}/{channel}/consumed") or 0)

    # ------------------------------------------------------------------ plumbing

    def _wait(self, key: str, *, what: str) -> str:
        """Polls `key` until it exists, answering this process's own readers meanwhile (a process
        that waits for a rollout must still serve the weights the rollout's sampler asked for,
        or the two wait for each other)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            value = _try_get(self.store, key)
            if value is not None:
                return value
            for channel, readers in self._readers.items():
                self.serve_requests(channel, readers=readers)
            if time.monotonic() > deadline:
                raise TransportTimeout(f"no {what} at {key} within {self.timeout_s:.0f} s: the peer process died or "
                                       "never started; check its log")
            time.sleep(_POLL_S)

    def _pull(self, process: int, uid: int, like):
        connection = self._connections.get(process)
        if connection is None:
            address = self._wait(f"{_PREFIX}/address/{process}", what=f"transfer server of process {process}")
            connection = self._connections[process] = self.server.connect(address)
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout_s)
        return jax.block_until_ready(connection.pull(uid, specs, timeout=deadline))
