"""Expert parallelism: each device of the `expert` mesh axis holds E / n experts, and every token
travels to the devices of its top-k experts and back with two all-to-alls inside `shard_map`.

This is GShard's layout (Lepikhin et al., 2020) as Switch Transformers (Fedus et al., 2021) and
DeepSpeed-MoE (Rajbhandari et al., 2022) use it: the `expert` axis is a data axis for everything
but the experts (tokens are split over data x fsdp x expert), and for the expert weights [E, D, F]
it is the axis their E dim is split over. Per MoE layer, on each device of n local tokens:

    a = n k assignments (token, expert), destination rank r(a) = expert(a) // (E / n_ep)
    send[r, slot]  = x[token(a)]                 slot = a's index among the assignments to r
    recv = all_to_all(send)                      recv[s] = what rank s sent here
    out  = local_expert(recv)                    each row through its (local) expert
    back = all_to_all(out)                       back[r, slot] = the output of assignment a
    y[t] = sum_k gate[t, k] back[r(a), slot(a)]

The gates are applied where the tokens live, so the router's gradient never crosses the network.
With a `tensor` axis the experts are split on F as the dense MLP is (Megatron-LM, Shoeybi et al.,
2019): SwiGLU is elementwise over F and the down projection sums over it, so each tensor rank
returns a partial sum and one psum over `tensor` of y [n, D] completes it (after the combine,
where the rows are k n_ep times fewer than in the buffers). `fsdp` shards of the expert weights
are gathered on entry, as FSDP gathers every layer's weights.

Dropless, by the capacity rule: a rank sends at most n k rows to any one destination (all of its
assignments), so each of the n_ep per-destination send slots holds C = n k rows and no assignment
is ever dropped, whatever the router does. The price is buffers of n_ep x C x D per device (send,
receive and return), n_ep times the mean load; `dispatch_bytes` counts them for `rljax plan`.
The unused slots are marked (expert id -1) and the expert function receives `valid_r`, so a
grouped kernel can skip them.

The model stays layout-free: `expert_mesh()` reads the mesh of the surrounding
`jax.set_mesh(mesh)` context, and the MoE block (`rljax.models.moe`) calls `sharded_experts_apply`,
which wraps `rljax.models.experts.experts_apply` in `expert_parallel_apply` only when that mesh has
an `expert` axis of more than one device. Without one (or when the token count does not split over
the axis) it is `experts_apply` itself, and the compiler gathers the experts.

On each device the local experts run through `experts_apply` (any `impl`) on all n_ep C received
rows, the unused slots with gate 0: correct for every implementation, at the cost of computing
those padding rows (the dropless buffers' price again; a capacity factor below n_ep would trade
it for possible drops, and is not offered).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
TOKEN_AXES = ("data", "fsdp", EXPERT_AXIS)  # the axes tokens (rows) are split over, in mesh order

# local_apply(x_rd, expert_r, valid_r, weights) -> y_rd: row r through local expert expert_r
# (0 <= expert_r < E / n_ep; rows with valid_r False are padding, their output is ignored).
LocalApply = Callable[..., jax.Array]


def expert_mesh():
    """The surrounding `jax.set_mesh` mesh when it has an `expert` axis of more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return None
    return mesh if mesh.shape[EXPERT_AXIS] > 1 else None


def token_axes(sizes: Mapping[str, int], rows: int) -> tuple[str, ...] | None:
    """The mesh axes (`sizes`: {axis: size}, e.g. `mesh.shape`) `rows` tokens split over: every
    token axis of more than one device, dropping data then fsdp until their product divides
    `rows`; None when not even `expert` alone divides it."""
    present = tuple(a for a in TOKEN_AXES if sizes.get(a, 1) > 1)
    for drop in range(len(present)):
        axes = present[drop:]
        if EXPERT_AXIS in axes and rows % math.prod(sizes[a] for a in axes) == 0:
            return axes
    return None


def capacity(tokens_per_device: int, top_k: int) -> int:
    """Rows of one destination's slot in the send buffer: n k, so no assignment is ever dropped."""
    return tokens_per_device * top_k


def dispatch_bytes(tokens_per_device: int, top_k: int, hidden: int, n_expert: int, itemsize: int) -> int:
    """Bytes of one MoE layer's all-to-all buffers on one device: send, receive and return, each
    n_ep x C x D (plus the int32 expert ids that travel with the send)."""
    slots = n_expert * capacity(tokens_per_device, top_k)
    return 3 * slots * hidden * itemsize + 2 * slots * 4


def swiglu_specs(weights: dict, mesh) -> dict:
    """In-`shard_map` specs of stacked SwiGLU experts {gate, up: [E, D, F], down: [E, F, D]}: E over
    `expert`, F over `tensor` where it divides (other names: E over `expert` only)."""
    tp = mesh.shape.get(TENSOR_AXIS, 1)
    f_dim = {"gate": 2, "up": 2, "down": 1}

    def spec(name, w):
        parts = [EXPERT_AXIS] + [None] * (w.ndim - 1)
        d = f_dim.get(name)
        if tp > 1 and d is not None and w.shape[d] % tp == 0:
            parts[d] = TENSOR_AXIS
        return P(*parts)
    return {name: spec(name, w) for name, w in weights.items()}


def sharded_experts_apply(x_td, expert_ids_tk, gates_tk, weights, *, impl: str, activation: str = "silu",
                          dtype=jnp.float32):
    """`rljax.models.experts.experts_apply`, expert-parallel inside a `jax.set_mesh` mesh with an
    `expert` axis (see the module docstring), else `experts_apply` itself. Same arguments, f32 out.

    Rows travel in `dtype` (what `experts_apply` rounds them to anyway), so bf16 halves the bytes."""
    from rljax.models.experts import ExpertWeights, experts_apply

    mesh = expert_mesh()
    if mesh is None or token_axes(mesh.shape, x_td.shape[0]) is None:
        return experts_apply(x_td, expert_ids_tk, gates_tk, weights, impl=impl, activation=activation, dtype=dtype)

    def local(x_rd, expert_r, valid_r, w):
        return experts_apply(x_rd, expert_r[:, None], valid_r[:, None].astype(jnp.float32),
                             ExpertWeights(w["gate"], w["up"], w["down"]), impl=impl, activation=activation,
                             dtype=dtype)
    stacked = {"gate": weights.gate_edf, "up": weights.up_edf, "down": weights.down_efd}
    return expert_parallel_apply(x_td.astype(dtype), expert_ids_tk, gates_tk.astype(jnp.float32), stacked, local,
                                 mesh=mesh)


def expert_parallel_apply(x_nd, expert_nk, gate_nk, weights, local_apply: LocalApply, *, mesh,
                          weight_specs=None):
    """y [N, D] = sum_k gate[n, k] expert_{expert[n, k]}(x[n]), with the experts split over the
    `expert` axis of `mesh` and the tokens sent to them by all-to-all (see the module docstring).

    `weights` is a pytree of expert-stacked arrays [E, ...]; `weight_specs` their specs inside the
    `shard_map` (default `swiglu_specs` for a dict, else E over `expert`). A spec that splits a
    weight over `tensor` makes each tensor rank's output a partial sum, completed by one psum.
    `local_apply(x_rd, expert_r, valid_r, local_weights) -> y_rd` runs rows through the local
    experts (ids in [0, E / n_ep)). `N` must split over the expert axis (`token_axes`).
    """
    n_tokens, _ = x_nd.shape
    axes = token_axes(mesh.shape, n_tokens)
    if axes is None:
        raise ValueError(f"{n_tokens} tokens do not split over the expert axis ({mesh.shape[EXPERT_AXIS]} devices)")
    if weight_specs is None:
        weight_specs = swiglu_specs(weights, mesh) if isinstance(weights, dict) else jax.tree.map(
            lambda w: P(EXPERT_AXIS), weights)
    n_ep = mesh.shape[EXPERT_AXIS]
    n_experts = jax.tree.leaves(weights)[0].shape[0]
    if n_experts % n_ep:
        raise ValueError(f"{n_experts} experts do not split over {n_ep} expert-parallel devices")
    specs = jax.tree.leaves(weight_specs, is_leaf=lambda s: isinstance(s, P))
    tensor_split = any(TENSOR_AXIS in tuple(s) for s in specs)
    rows = P(axes)
    body = _dispatch_combine(local_apply, n_ep, n_experts // n_ep, tensor_split)
    return jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, weight_specs), out_specs=rows)(
        x_nd, expert_nk.astype(jnp.int32), gate_nk, weights)


def _dispatch_combine(local_apply: LocalApply, n_ep: int, e_local: int, tensor_split: bool):
    """The per-device body of `expert_parallel_apply`: route, all-to-all, experts, all-to-all back, combine."""

    def body(x_nd, expert_nk, gate_nk, weights):
        n, d = x_nd.shape
        k = expert_nk.shape[1]
        cap = capacity(n, k)
        expert_a = expert_nk.reshape(n * k)
        token_a = jnp.arange(n * k) // k
        dest_a = expert_a // e_local
        # slot of assignment a within its destination: how many earlier assignments go there
        counts_ar = jnp.cumsum(dest_a[:, None] == jnp.arange(n_ep)[None, :], axis=0)
        slot_a = jnp.take_along_axis(counts_ar, dest_a[:, None], axis=1)[:, 0] - 1
        send_rcd = jnp.zeros((n_ep, cap, d), x_nd.dtype).at[dest_a, slot_a].set(
            x_nd[token_a], unique_indices=True)
        ids_rc = jnp.full((n_ep, cap), -1, jnp.int32).at[dest_a, slot_a].set(
            expert_a % e_local, unique_indices=True)
        recv_scd = jax.lax.all_to_all(send_rcd, EXPERT_AXIS, 0, 0, tiled=True)
        ids_sc = jax.lax.all_to_all(ids_rc, EXPERT_AXIS, 0, 0, tiled=True)
        ids_m = ids_sc.reshape(n_ep * cap)
        valid_m = ids_m >= 0
        out_md = local_apply(recv_scd.reshape(n_ep * cap, d), jnp.where(valid_m, ids_m, 0), valid_m, weights)
        out_md = jnp.where(valid_m[:, None], out_md, 0)
        back_rcd = jax.lax.all_to_all(out_md.reshape(n_ep, cap, -1), EXPERT_AXIS, 0, 0, tiled=True)
        y_akd = back_rcd[dest_a, slot_a].reshape(n, k, -1)
        y_nd = jnp.einsum("nkd,nk->nd", y_akd, gate_nk.astype(y_akd.dtype))
        return jax.lax.psum(y_nd, TENSOR_AXIS) if tensor_split else y_nd
    return body
