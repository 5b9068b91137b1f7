"""An MoE policy's update: the router losses join the loss with their coefficients and are logged,
with the routing metrics, at the values an independent forward gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rljax.models as M
from rljax.models.moe_config import MoEConfig
from rljax.models.moe_losses import load_balancing_loss, router_z_loss
from rljax.models.transformer import hidden_states_and_routes
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, init_train_state, update_step
from rljax.update.config import UpdateConfig


def _batch(cfg, rng):
    b, t, prompt = 8, 10, 4
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    attn = np.ones((b, t), bool)
    attn[1, :2] = False  # a left-padded row
    loss = np.zeros((b, t), bool)
    loss[:, prompt:] = True
    return RolloutBatch(tokens_bt=toks, attn_mask_bt=jnp.asarray(attn), loss_mask_bt=jnp.asarray(loss),
                        sampler_logp_bt=jnp.zeros((b, t), jnp.float32), rewards_b=jnp.asarray(rng.random(b), jnp.float32),
                        group_ids_b=prompt_major_group_ids(b, 4), completion_len=t - prompt)


def test_router_losses_are_logged_and_trained():
    """`loss/router_aux` and `loss/router_z` equal the losses of a separate forward at the
    pre-update params (one mini-batch, one micro-batch); `moe/route_agreement` is 1 without
    replay; and the coefficients change the router's update (the losses reach the gradient)."""
    cfg = M.preset("qwen2-test", moe=MoEConfig(num_experts=4, top_k=2, expert_size=32))
    params = M.init_params(cfg, jax.random.key(0))
    batch = _batch(cfg, np.random.default_rng(0))
    _, aux = hidden_states_and_routes(cfg, params, batch.tokens_bt, attn_mask_bt=batch.attn_mask_bt)
    lb = float(load_balancing_loss(aux, batch.attn_mask_bt, 4, 2))
    z = float(router_z_loss(aux, batch.attn_mask_bt))

    def run(aux_coef, z_coef):
        algo = AlgorithmConfig(algorithm="grpo", router_aux_coef=aux_coef, router_z_coef=z_coef)
        state = init_train_state(cfg, jax.tree.map(jnp.array, params), algo, OptimConfig(learning_rate=1e-2))
        return jax.tree.map(np.asarray, update_step(state, batch, jax.random.key(0)))

    with_losses, m = run(10.0, 1.0)
    np.testing.assert_allclose(float(m["loss/router_aux"]), lb, rtol=1e-5)
    np.testing.assert_allclose(float(m["loss/router_z"]), z, rtol=1e-5)
    assert float(m["moe/route_agreement"]) == 1.0 and float(m["moe/expert_load"]) >= 1.0
    without, _ = run(0.0, 0.0)
    router = lambda s: s.params["layers"]["router"]
    assert np.abs(router(with_losses) - router(without)).max() > 1e-6


def test_packed_update_gives_the_padded_router_losses_and_metrics():
    """update.packing=true with one packed micro-batch (a token budget that holds every row, so the
    router sees the same real tokens as the padded micro-batch; every row has a loss token):
    `loss/router_aux`, `loss/router_z`, `moe/route_agreement`, `moe/expert_load` and the updated
    router equal the padded update's within 1e-5. Two rows to a buffer, so a packed forward that
    read the empty slots, or routed across rows, would change them."""
    cfg = M.preset("qwen2-test", moe=MoEConfig(num_experts=4, top_k=2, expert_size=32))
    params = M.init_params(cfg, jax.random.key(0))
    batch = _batch(cfg, np.random.default_rng(0))
    algo = AlgorithmConfig(algorithm="grpo", router_aux_coef=10.0, router_z_coef=1.0)

    def run(update_cfg):
        state = init_train_state(cfg, jax.tree.map(jnp.array, params), algo, OptimConfig(learning_rate=1e-2),
                                 update_cfg=update_cfg)
        return jax.tree.map(np.asarray, update_step(state, batch, jax.random.key(0)))

    padded, m_pad = run(UpdateConfig())
    packed, m_pack = run(UpdateConfig(packing=True, pack_length=20, max_tokens_per_microbatch=80))
    for name in ("loss/router_aux", "loss/router_z", "moe/route_agreement", "moe/expert_load"):
        np.testing.assert_allclose(float(m_pack[name]), float(m_pad[name]), rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(packed.params["layers"]["router"], padded.params["layers"]["router"], atol=1e-5)
