"""The expert matmuls of an MoE layer: every routed (token, expert) pair through its expert's SwiGLU.

    experts_apply(x_td, expert_ids_tk, gates_tk, weights, impl=..., activation=..., dtype=...)
      = y_td,   y_t = sum_j gates_tj * down_e(act(x_t gate_e) * (x_t up_e)),  e = expert_ids_tj

This one function is the seam for expert parallelism: a caller may wrap it in `shard_map`, send
the (token, expert) rows to the devices that hold their experts with an all-to-all, call it there
on the local experts (ids renumbered to local ones) and send the rows back. It holds no state, takes
the weights as arguments and returns f32.

Implementations (`impl`), all the same function of their inputs:

- "dense": every expert on every token, then the gates pick (einsum over [E, T, F]): E/k times
  the work of the routed tokens, and the tested reference.
- "blocks": the grouped path for CPU (and any backend): the T*k (token, expert) rows are sorted by
  expert into blocks of `b` rows, each expert's rows padded up to a whole number of blocks, so
  every block belongs to one expert; a batched matmul of the blocks with their experts' weights
  (gathered per block) does the work. Dropless: the number of blocks is bounded statically,
  sum_e ceil(n_e / b) <= (T k + E (b - 1)) / b, whatever the routing, so no row is ever dropped.
  Work is (T k + E b) rows instead of dense's T E; `b` = ceil(T k / 4E) keeps it near 1.25 T k.
- "ragged": `jax.lax.ragged_dot` on the rows sorted by expert (no padding). On GPU it runs the
  Pallas Triton kernel (`jax_ragged_dot_use_gpu_pallas_triton_lowering`, which resolving the
  implementation turns on); on TPU ragged_dot lowers natively. On CPU ragged_dot's default
  lowering masks the rows to [E, M, K] and runs dense, so "auto" never picks it there.
- "megablox": TPU's grouped matmul kernel (`jax.experimental.pallas.ops.tpu.megablox.gmm`,
  Megablocks, Gale et al., 2023) on the same sorted rows, padded to its 128-row tiles.

Shape letters: T tokens, k experts per token, E experts, D hidden, F expert width, M = T k rows,
S padded rows, n blocks of b rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax.errors import ConfigError
from rljax.models.layers import gated_activation

EXPERT_IMPLEMENTATIONS = ("dense", "blocks", "ragged", "megablox")


class ExpertWeights(NamedTuple):
    """Stacked SwiGLU experts: gate and up [E, D, F], down [E, F, D]."""

    gate_edf: jax.Array
    up_edf: jax.Array
    down_efd: jax.Array


def resolve_experts_impl(moe_impl: str, backend: str | None = None, *, every_expert: bool = False) -> str:
    """`model.moe_impl` -> an implementation of `experts_apply` for `backend` (default: JAX's).
    "auto" and "grouped": megablox on TPU, ragged (Triton) on GPU, blocks on CPU; "auto" is dense
    when `every_expert` (top-k = E: every token visits every expert, nothing to skip)."""
    if moe_impl == "dense" or moe_impl in EXPERT_IMPLEMENTATIONS or (moe_impl == "auto" and every_expert):
        return "dense" if moe_impl == "auto" else moe_impl
    if moe_impl not in ("auto", "grouped"):
        raise ConfigError(f"model.moe_impl={moe_impl!r}; choose one of auto, grouped, dense")
    backend = backend or jax.default_backend()
    if (backend == "gpu" or backend == "cuda") and _gpu_ragged_kernel():
        # Read when the program is lowered, so it is set globally (it changes ragged_dot on GPU only).
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
        return "ragged"
    return "megablox" if backend == "tpu" else "blocks"


def _gpu_ragged_kernel() -> bool:
    """Whether this jax ships the Pallas Triton lowering of ragged_dot that its flag turns on: jax
    0.11.2 has the flag but not the module (lowering fails with ModuleNotFoundError), and without it
    ragged_dot on a GPU is the masked dense matmul, so the sorted blocks serve instead."""
    import importlib.util

    try:
        return importlib.util.find_spec("jax._src.lax.pallas_lowerings") is not None
    except ModuleNotFoundError:
        return False


def experts_apply(x_td, expert_ids_tk, gates_tk, weights: ExpertWeights, *, impl: str, activation: str = "silu",
                  dtype=jnp.float32):
    """y_td (f32): the gate-weighted sum of each token's chosen experts (see the module docstring).
    Matmul operands are rounded to `dtype`, products accumulate in f32."""
    if impl == "dense":
        return _dense(x_td, expert_ids_tk, gates_tk, weights, activation, dtype)
    if impl == "blocks":
        return _blocks(x_td, expert_ids_tk, gates_tk, weights, activation, dtype)
    if impl in ("ragged", "megablox"):
        return _sorted_rows(x_td, expert_ids_tk, gates_tk, weights, activation, dtype, impl)
    raise ConfigError(f"experts impl {impl!r}; choose one of {EXPERT_IMPLEMENTATIONS}")


def combine_weights(expert_ids_tk, gates_tk, num_experts: int):
    """[T, E] f32: each token's gate on each expert (0 where it is not routed)."""
    return jnp.einsum("tk,tke->te", gates_tk.astype(jnp.float32),
                      jax.nn.one_hot(expert_ids_tk, num_experts, dtype=jnp.float32))


def _dense(x_td, ids_tk, gates_tk, w: ExpertWeights, activation, dtype):
    x = x_td.astype(dtype)
    mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    gate_etf = mm("td,edf->etf", x, w.gate_edf.astype(dtype))
    up_etf = mm("td,edf->etf", x, w.up_edf.astype(dtype))
    act_etf = gated_activation(gate_etf, up_etf, activation, dtype)
    y_etd = mm("etf,efd->etd", act_etf.astype(dtype), w.down_efd.astype(dtype))
    return jnp.einsum("te,etd->td", combine_weights(ids_tk, gates_tk, w.gate_edf.shape[0]), y_etd)


def block_rows(num_rows: int, num_experts: int) -> int:
    """Rows per block of the "blocks" path: ceil(M / 4E), so padding adds at most E b ~ M / 4 rows."""
    return max(1, -(-num_rows // (4 * num_experts)))


def _sort_by_expert(ids_tk, num_experts: int):
    """(order [M]: rows sorted by expert (stable), sizes [E]: rows per expert)."""
    flat_m = ids_tk.reshape(-1)
    return jnp.argsort(flat_m, stable=True), jnp.bincount(flat_m, length=num_experts)


def _blocks(x_td, ids_tk, gates_tk, w: ExpertWeights, activation, dtype):
    t, k = ids_tk.shape
    e, d, _ = w.gate_edf.shape
    m = t * k
    b = block_rows(m, e)
    n = -(-(m + e * (b - 1)) // b)  # blocks, bounded for any routing (dropless)
    order_m, sizes_e = _sort_by_expert(ids_tk, e)
    padded_e = -(-sizes_e // b) * b
    pad_end_e = jnp.cumsum(padded_e)
    pad_start_e, start_e = pad_end_e - padded_e, jnp.cumsum(sizes_e) - sizes_e
    expert_sorted = ids_tk.reshape(-1)[order_m]
    slot_sorted = pad_start_e[expert_sorted] + jnp.arange(m) - start_e[expert_sorted]
    slot_m = jnp.zeros((m,), jnp.int32).at[order_m].set(slot_sorted.astype(jnp.int32))
    row_s = jnp.full((n * b,), m, jnp.int32).at[slot_m].set(jnp.arange(m, dtype=jnp.int32))
    token_s = jnp.where(row_s < m, row_s // k, t)  # t: the zero row (padding)
    x_pad = jnp.concatenate([x_td.astype(dtype), jnp.zeros((1, d), dtype)])
    x_nbd = x_pad[token_s].reshape(n, b, d)
    expert_n = jnp.minimum(jnp.searchsorted(pad_end_e, jnp.arange(n) * b, side="right"), e - 1)
    mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    gate = mm("nbd,ndf->nbf", x_nbd, w.gate_edf.astype(dtype)[expert_n])
    up = mm("nbd,ndf->nbf", x_nbd, w.up_edf.astype(dtype)[expert_n])
    act = gated_activation(gate, up, activation, dtype)
    y_sd = mm("nbf,nfd->nbd", act.astype(dtype), w.down_efd.astype(dtype)[expert_n]).reshape(n * b, d)
    y_tkd = y_sd[slot_m].reshape(t, k, d)
    return jnp.einsum("tk,tkd->td", gates_tk.astype(jnp.float32), y_tkd)


def _sorted_rows(x_td, ids_tk, gates_tk, w: ExpertWeights, activation, dtype, impl):
    t, k = ids_tk.shape
    e, d, _ = w.gate_edf.shape
    m = t * k
    order_m, sizes_e = _sort_by_expert(ids_tk, e)
    x_md = x_td.astype(dtype)[order_m // k]
    if impl == "megablox":
        from jax.experimental.pallas.ops.tpu.megablox import gmm

        pad = -m % 128  # whole 128-row tiles; the extra rows are zeros in the last group
        x_md = jnp.pad(x_md, ((0, pad), (0, 0)))
        sizes_e = sizes_e.at[-1].add(pad)
        matmul = lambda a, b_: gmm(a, b_, sizes_e.astype(jnp.int32), preferred_element_type=jnp.float32)
    else:
        matmul = lambda a, b_: jax.lax.ragged_dot(a, b_, sizes_e.astype(jnp.int32), preferred_element_type=jnp.float32)
    gate = matmul(x_md, w.gate_edf.astype(dtype))
    up = matmul(x_md, w.up_edf.astype(dtype))
    y_md = matmul(gated_activation(gate, up, activation, dtype).astype(dtype), w.down_efd.astype(dtype))[:m]
    y_tkd = jnp.zeros((m, d), jnp.float32).at[order_m].set(y_md).reshape(t, k, d)
    return jnp.einsum("tk,tkd->td", gates_tk.astype(jnp.float32), y_tkd)
