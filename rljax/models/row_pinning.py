"""The update's rows stay on the devices that hold them.

An FSDP layout shards every weight over the `fsdp` axis, the embedding table [V, D] on its hidden
dim (P(None, 'fsdp')), and shards a batch's rows over (data, fsdp). The embedding lookup
`table[tokens_bt]` meets the two: XLA's sharding propagation may keep the table's D sharding on
the hidden states h_btd and, since one dimension of the mesh cannot shard two dims, give up the
row sharding, so every layer runs every row of the micro-batch on every device (the compiled
program all-gathers f32[B T, D]) and the per-device activations grow with the whole batch
instead of the device's share of it. Pinning h_btd to the batch's row sharding right after the
lookup (`jax.lax.with_sharding_constraint`) fixes the choice for the layers, which then all-gather
each weight and keep the rows, as FSDP intends (ZeRO-3, Rajbhandari et al., 2020).

Only the update pins. Its caller enters `pinned_rows(rows_of)` while the update traces
(`rljax.sharding.Layout.pinned_rows`, entered by the stage programs and the memory plan);
`rows_of(num_rows)` is the rows' sharding, or None where the rows do not divide the batch axes
(then nothing is pinned). The sampler's programs trace outside it: its layout keeps weights
whole (no per-token all-gather), and pinning its prefill made its temporaries larger, not
smaller. The model stays layout-free: nothing here knows a mesh until a caller hands one in.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import jax

_ROWS_OF: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("rljax_rows_of", default=None)


@contextlib.contextmanager
def pinned_rows(rows_of: Callable | None) -> Iterator[None]:
    """While tracing inside it, `pin_rows` constrains arrays to `rows_of(num_rows)` (see the module doc)."""
    token = _ROWS_OF.set(rows_of)
    try:
        yield
    finally:
        _ROWS_OF.reset(token)


def pin_rows(x_b):
    """`x_b` (rows leading, e.g. h_btd) constrained to its rows' sharding inside `pinned_rows`,
    else unchanged."""
    rows_of = _ROWS_OF.get()
    sharding = None if rows_of is None else rows_of(x_b.shape[0])
    return x_b if sharding is None else jax.lax.with_sharding_constraint(x_b, sharding)
