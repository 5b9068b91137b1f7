"""Expert parallelism (`rljax.models.expert_parallel`): on 8 simulated devices, the all-to-all
dispatch over an `expert` mesh axis gives the loss and gradients of one device, composes with
data, fsdp and tensor, and drops no token even when every token picks the same experts.

The experts here are a stand-in (SwiGLU rows through per-row gathered weights) and the reference
is the plain single-device sum over the top-k, written independently of the dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import sharding
from rljax.models import expert_parallel as ep

E, D, F, K, N = 8, 16, 32, 2, 64
RULES = (sharding.Rule(r"experts/(gate|up)$", rank=3, tensor_dim=-1, expert_dim=-3),
         sharding.Rule(r"experts/down$", rank=3, tensor_dim=-2, expert_dim=-3))
MESHES = {"expert4_data2": dict(data=2, fsdp=1, expert=4), "expert2_fsdp2_tensor2": dict(data=1, fsdp=2, expert=2, tensor=2)}


def swiglu_rows(x_rd, expert_r, valid_r, w):
    """Each row through its own expert: silu(x Wg) * (x Wu) Wd, weights gathered per row."""
    del valid_r
    g = jnp.einsum("rd,rdf->rf", x_rd, w["gate"][expert_r])
    u = jnp.einsum("rd,rdf->rf", x_rd, w["up"][expert_r])
    return jnp.einsum("rf,rfd->rd", jax.nn.silu(g) * u, w["down"][expert_r])


def route(x_nd, router_de, skew):
    """Softmax-then-top-k routing with renormalised gates; `skew` pushes every token to experts 0 and 1."""
    logits_ne = x_nd @ router_de + skew * jnp.asarray([50.0, 49.0] + [0.0] * (E - 2))
    top_nk, idx_nk = jax.lax.top_k(jax.nn.softmax(logits_ne, -1), K)
    return idx_nk, top_nk / top_nk.sum(-1, keepdims=True)


def loss_reference(p, x_nd, t_nd, skew=0.0):
    idx_nk, gate_nk = route(x_nd, p["router"], skew)
    y_nkd = swiglu_rows(jnp.repeat(x_nd, K, 0), idx_nk.reshape(-1), None, p["experts"]).reshape(N, K, D)
    return (((y_nkd * gate_nk[..., None]).sum(1) - t_nd) ** 2).mean()


def loss_parallel(p, x_nd, t_nd, skew=0.0):
    idx_nk, gate_nk = route(x_nd, p["router"], skew)
    mesh = ep.expert_mesh()
    assert mesh is not None, "no expert mesh in context"
    y_nd = ep.expert_parallel_apply(x_nd, idx_nk, gate_nk, p["experts"], swiglu_rows, mesh=mesh)
    return ((y_nd - t_nd) ** 2).mean()


def _problem():
    k = jax.random.split(jax.random.key(0), 6)
    p = {"router": jax.random.normal(k[0], (D, E)),
         "experts": {"gate": 0.3 * jax.random.normal(k[1], (E, D, F)), "up": 0.3 * jax.random.normal(k[2], (E, D, F)),
                     "down": 0.3 * jax.random.normal(k[3], (E, F, D))}}
    return p, jax.random.normal(k[4], (N, D)), jax.random.normal(k[5], (N, D))


@pytest.mark.parametrize("name", list(MESHES))
def test_expert_parallel_equals_one_device(name):
    """Loss and every gradient (router through the gates, experts, inputs) equal one device within
    1e-5 (f32). The expert weights live E/n per device; the program really all-to-alls. With the
    skewed router every assignment goes to one rank (the dropless capacity's worst case): a
    capacity below n k per destination would drop tokens and fail."""
    p, x_nd, t_nd = _problem()
    mesh = sharding.make_mesh(sharding.MeshConfig(**MESHES[name]))
    p_sh = sharding.param_shardings(p, mesh, RULES, min_fsdp_size=1)
    rows = sharding.batch_sharding(mesh)
    step = jax.jit(jax.value_and_grad(loss_parallel), in_shardings=(p_sh, rows, rows, None))
    placed = jax.device_put(p, p_sh)
    assert placed["experts"]["gate"].addressable_shards[0].data.shape[0] == E // mesh.shape["expert"]
    with jax.set_mesh(mesh):
        compiled = step.lower(placed, x_nd, t_nd, 0.0).compile()
    assert "all-to-all" in compiled.as_text()
    for skew in (0.0, 1.0):
        want_loss, want_grads = jax.value_and_grad(loss_reference)(p, x_nd, t_nd, skew)
        loss, grads = compiled(placed, x_nd, t_nd, skew)
        np.testing.assert_allclose(float(loss), float(want_loss), atol=1e-5, rtol=0)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    # the skew really sent everything to experts 0 and 1
    assert set(np.unique(np.asarray(route(x_nd, p["router"], 1.0)[0]))) == {0, 1}


def test_expert_mesh_only_with_an_expert_axis():
    """The model takes the parallel path only inside a mesh with an expert axis of > 1 device."""
    assert ep.expert_mesh() is None
    with jax.set_mesh(sharding.make_mesh(sharding.MeshConfig(fsdp=-1))):
        assert ep.expert_mesh() is None
    with jax.set_mesh(sharding.make_mesh(sharding.MeshConfig(fsdp=-1, expert=2))):
        assert ep.expert_mesh() is not None


def test_token_axes_and_capacity():
    """Tokens split over data x fsdp x expert, dropping data then fsdp until the count divides;
    None when the expert axis alone does not divide. Capacity n k, buffers 3 n_ep C D bytes."""
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, expert=2))
    assert ep.token_axes(mesh.shape, 16) == ("data", "fsdp", "expert")
    assert ep.token_axes(mesh.shape, 4) == ("fsdp", "expert")
    assert ep.token_axes(mesh.shape, 2) == ("expert",)
    assert ep.token_axes(mesh.shape, 3) is None
    assert ep.capacity(10, 4) == 40
    assert ep.dispatch_bytes(10, 4, 8, 2, 4) == 3 * 2 * 40 * 8 * 4 + 2 * 2 * 40 * 4
