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
MESHES = {"expert4_data2": dict(data=2, fsdp=1, expert=4),
          "expert2_fsdp2_tensor2": dict(data=1, fsdp=2, expert=2, tensor=2)}


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


def test_real_update_step_on_an_expert_mesh_equals_one_device():
    """The real `rljax.update.update_step` (GRPO with a k3 KL) on a tiny Qwen3-MoE (8 experts, top-2,
    sorted-blocks experts) compiled for expert=2 x fsdp=2 x tensor=2 inside `jax.set_mesh`: the MoE
    block dispatches by all-to-all (in the program), each device holds 4 of the 8 experts, and the new
    params, optimiser state and metrics equal one device's within 1e-5."""
    from test_layout import _close, _rl_batch

    from rljax.models import init_params, preset
    from rljax.models.moe_config import MoEConfig
    from rljax.objectives import AlgorithmConfig
    from rljax.optim import OptimConfig
    from rljax.update import init_train_state, update

    cfg = preset("qwen2-test").replace(model_type="qwen3_moe", qkv_bias=False, qk_norm=True,
                                       moe=MoEConfig(num_experts=8, top_k=2, expert_size=32, norm_topk_prob=True))
    algo = AlgorithmConfig(algorithm="grpo", kl_coef=0.1)
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0), std=0.2), algo,
                             OptimConfig(learning_rate=1e-3, eps=1e-4))  # eps: see test_layout's update_reference
    state = state.replace(ref_params=init_params(cfg, jax.random.key(7), std=0.2))
    host_state, batch = jax.tree.map(np.asarray, state), _rl_batch()
    want_state, want_metrics = jax.jit(update)(state, batch, jax.random.key(3))

    layout = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, expert=2, tensor=2)))
    state_sh, batch_sh = layout.tree(host_state), layout.batch(batch)
    assert state_sh.params["layers"]["expert_gate"].spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", "tensor")
    step = jax.jit(update, in_shardings=(state_sh, batch_sh, layout.replicated),
                   out_shardings=(state_sh, layout.replicated))
    placed = jax.device_put(host_state, state_sh)
    with jax.set_mesh(layout.mesh):
        compiled = step.lower(placed, batch, jax.random.key(3)).compile()
    assert "all-to-all" in compiled.as_text()
    assert placed.params["layers"]["expert_up"].addressable_shards[0].data.shape[1] == 4
    got_state, got_metrics = compiled(placed, jax.device_put(batch, batch_sh), jax.random.key(3))
    _close((got_state.params, got_state.opt_state), (want_state.params, want_state.opt_state))
    for name in want_metrics:
        np.testing.assert_allclose(float(got_metrics[name]), float(want_metrics[name]), atol=1e-5, rtol=1e-5,
                                   err_msg=name)
