"""Layouts for the trainer and the sampler, compiled functions with explicit shardings, weight sync.

The trainer and the sampler want different layouts (HybridFlow, Sheng et al., 2024; ReaLHF,
Mei et al., 2024): training shards params and optimiser state with FSDP so they fit, while
decoding, which runs one small matmul per token, keeps each weight whole inside a tensor-parallel
group so no step all-gathers. `sync_weights` moves the trainer's params into the sampler's
layout with one compiled identity whose outputs carry the sampler's shardings, so XLA moves the
shards between devices with collectives and nothing passes through the host.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rljax.models.row_pinning import pinned_rows
from rljax.sharding.rules import (
    rows_sharding,
    batch_axes,
    DEFAULT_RULES,
    Rule,
    batch_shardings,
    cache_shardings,
    named,
    opt_state_shardings,
    param_shardings,
    tree_specs,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where arrays live: a mesh, partition rules, and whether params are FSDP-sharded."""

    mesh: Mesh
    rules: tuple[Rule, ...] = DEFAULT_RULES
    fsdp: bool = True

    def params(self, params):
        return param_shardings(params, self.mesh, self.rules, fsdp=self.fsdp)

    def opt_state(self, tx, params):
        return opt_state_shardings(tx, params, self.params(params), self.mesh)

    def tree(self, tree):
        """Shardings for any pytree by path rules, e.g. a whole train state (params, optimiser
        moments, reference and value params all take their param's layout; counters replicate)."""
        return named(self.mesh, tree_specs(tree, self.mesh, self.rules, fsdp=self.fsdp))

    def batch(self, batch):
        return batch_shardings(batch, self.mesh)

    def cache(self, cache):
        return cache_shardings(cache, self.mesh)

    def rows(self, size: int) -> NamedSharding:
        """Where a batch of `size` rows lives (`rljax.sharding.rules.rows_sharding`)."""
        return rows_sharding(self.mesh, size)

    def pinned_rows(self):
        """Context for tracing an update: its forward keeps each row's hidden states on the
        devices that hold the row (`rljax.models.row_pinning`), where the rows divide the batch axes."""
        return pinned_rows(self._rows_or_none)

    def _rows_or_none(self, size: int) -> NamedSharding | None:
        return None if batch_axes(self.mesh, size) is None else self.rows(size)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def trainer_layout(mesh: Mesh, rules: tuple[Rule, ...] = DEFAULT_RULES) -> Layout:
    """FSDP x tensor parallel params, batches over data x fsdp."""
    return Layout(mesh, rules, fsdp=True)


def sampler_layout(mesh: Mesh, rules: tuple[Rule, ...] = DEFAULT_RULES) -> Layout:
    """Tensor-parallel params replicated over data/fsdp (no per-token all-gathers), KV cache on heads."""
    return Layout(mesh, rules, fsdp=False)


def make_sharded(fn: Callable, mesh: Mesh, in_shardings, out_shardings, *,
                 static_argnums: int | Sequence[int] = (), donate_argnums: int | Sequence[int] = ()):
    """`jax.jit(fn)` with explicit input and output shardings (pjit semantics).

    `in_shardings` / `out_shardings` are pytree prefixes of the (non-static) arguments and the
    result, holding NamedShardings or PartitionSpecs (taken on `mesh`). Arguments arriving in
    another layout are moved on device; results come back in exactly the given layout.
    """
    return jax.jit(fn, in_shardings=named(mesh, in_shardings), out_shardings=named(mesh, out_shardings),
                   static_argnums=static_argnums, donate_argnums=donate_argnums)


def sync_weights(params, target_shardings, *, donate: bool = False):
    """Reshard `params` to `target_shardings` on device; returns (params, seconds).

    The copy is one compiled identity with `out_shardings=target_shardings`: XLA gathers and
    re-slices the shards device to device. `jax.device_put` is not used for this because, when a
    target shard is not a slice some source device already holds (FSDP shards gathered into
    tensor-parallel replicas), it assembles the whole array on the host and sends it back. When
    the two layouts order their devices differently (one compiled program cannot span both),
    it falls back to `jax.device_put`.

    The seconds include waiting for the transfer to finish. `donate=True` frees the source
    buffers (when the trainer no longer needs them).
    """
    start = time.perf_counter()
    if _same_device_order(params, target_shardings):
        with warnings.catch_warnings():  # a reshard changes shard shapes, so few buffers alias
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            out = jax.jit(_identity, out_shardings=target_shardings,
                          donate_argnums=(0,) if donate else ())(params)
        if donate:  # XLA reuses only the buffers whose shard shape is unchanged; free the rest
            for x in jax.tree.leaves(params):
                if not x.is_deleted():
                    x.delete()
    else:
        out = jax.device_put(params, target_shardings, donate=donate)
    jax.block_until_ready(out)
    return out, time.perf_counter() - start


def _identity(tree):
    return tree


def _same_device_order(params, target_shardings) -> bool:
    """True when every source and target sharding is a NamedSharding over one device order."""
    shardings = [x.sharding for x in jax.tree.leaves(params)] + jax.tree.leaves(target_shardings)
    if not all(isinstance(s, NamedSharding) for s in shardings):
        return False
    return len({tuple(mesh.devices.flat) for mesh in {s.mesh for s in shardings}}) == 1


def device_bytes(tree) -> dict[jax.Device, int]:
    """Bytes each device holds for the arrays of `tree`, counted from their addressable shards."""
    totals: dict[jax.Device, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying `shardings`: a restore target for orbax or an AOT `lower`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
