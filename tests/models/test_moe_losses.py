"""Router aux losses against transformers and NumPy, routing metrics, and routing replay in the
model's forward (routes follow the record, gates still train the router)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import rljax.models as M
from rljax.models.moe import MoEAux
from rljax.models.moe_config import MoEConfig
from rljax.models.moe_losses import load_balancing_loss, router_z_loss, routing_metrics
from rljax.models.transformer import hidden_states_and_routes


def _aux(seed=0, layers=3, b=2, t=7, e=6, k=2):
    logits = np.random.default_rng(seed).normal(size=(layers, b, t, e)).astype(np.float32) * 2
    own = jax.lax.top_k(jnp.asarray(logits), k)[1]
    mask = np.ones((b, t), bool)
    mask[0, :3] = False  # left padding
    return MoEAux(own, own, jnp.asarray(logits)), mask


@pytest.mark.parametrize("k", [1, 2, 4])
def test_load_balancing_loss_equals_transformers(k):
    """Our load-balancing loss equals transformers' `load_balancing_loss_func` (top-k, over the
    layers, padding masked) on the same router logits."""
    aux, mask = _aux(k=k)
    logits = np.asarray(aux.router_logits_bte)
    ref = load_balancing_loss_func(tuple(torch.tensor(l.reshape(-1, l.shape[-1])) for l in logits), logits.shape[-1],
                                   k, torch.tensor(mask.astype(np.int64)))
    ours = load_balancing_loss(aux, jnp.asarray(mask), logits.shape[-1], k)
    np.testing.assert_allclose(float(ours), float(ref), rtol=1e-6)


def test_router_z_loss_equals_numpy():
    """z-loss = mean over real tokens and layers of (log sum exp logits)^2 (ST-MoE eq. 5)."""
    aux, mask = _aux()
    x = np.asarray(aux.router_logits_bte, np.float64)
    lse = np.log(np.exp(x).sum(-1))
    want = (lse**2)[:, mask].mean()
    np.testing.assert_allclose(float(router_z_loss(aux, jnp.asarray(mask))), want, rtol=1e-6)


def test_routing_metrics():
    """Without replay the routes agree with themselves (1.0); a record that differs on one
    token-layer lowers the agreement by one share; expert load is max/mean tokens per expert."""
    aux, mask = _aux()
    met = routing_metrics(aux, jnp.asarray(mask), 6)
    assert float(met["moe/route_agreement"]) == 1.0
    used = aux.routes_btk.at[1, 1, 4, 0].set((aux.routes_btk[1, 1, 4, 0] + 1) % 6)
    used = jnp.where(used[..., :1] == used[..., 1:], aux.routes_btk, used)  # keep the two experts distinct
    met = routing_metrics(aux._replace(routes_btk=used), jnp.asarray(mask), 6)
    assert float(met["moe/route_agreement"]) == pytest.approx(1 - 1 / (3 * mask.sum()))
    routes = np.asarray(aux.routes_btk)
    loads = [np.bincount(routes[l][mask].ravel(), minlength=6) for l in range(3)]
    want = np.mean([c.max() / c.mean() for c in loads])
    np.testing.assert_allclose(float(routing_metrics(aux, jnp.asarray(mask), 6)["moe/expert_load"]), want, rtol=1e-6)


# ----------------------------------------------------------------------------- routing replay


def _model(impl="grouped"):
    cfg = M.preset("qwen2-test", moe=MoEConfig(num_experts=4, top_k=2, expert_size=32, norm_topk_prob=True,
                                               impl=impl))
    params = M.init_params(cfg, jax.random.key(3))
    params["layers"]["router"] = params["layers"]["router"] * 50  # decisive routing
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, cfg.vocab_size)
    return cfg, params, tokens


def test_replay_routes_by_the_record_and_trains_the_router():
    """Replaying a record: every layer computes every token with the recorded experts (the aux
    says so, and the logits equal the unreplayed forward when the record is the model's own
    routes); a different record changes the logits; the router gets a gradient through the
    gates of the recorded experts."""
    cfg, params, tokens = _model()
    h_own, aux = jax.jit(lambda p: hidden_states_and_routes(cfg, p, tokens))(params)
    replay = jax.jit(lambda p, r: hidden_states_and_routes(cfg, p, tokens, routes_lbtk=r))
    h_rep, aux_rep = replay(params, aux.routes_btk)
    np.testing.assert_array_equal(aux_rep.routes_btk, aux.routes_btk)
    np.testing.assert_allclose(h_rep, h_own, atol=1e-6, rtol=0)
    wrong = (aux.routes_btk + 1) % cfg.moe.num_experts
    h_wrong, aux_wrong = replay(params, wrong)
    np.testing.assert_array_equal(aux_wrong.routes_btk, wrong)
    assert float(jnp.abs(h_wrong - h_own).max()) > 1e-2
    first = MoEAux(*(x[:1] for x in aux_wrong))  # layer 0's own routes do not depend on the record
    assert float(routing_metrics(first, jnp.ones(tokens.shape, bool), 4)["moe/route_agreement"]) == 0.0

    def loss(router):
        p = {**params, "layers": {**params["layers"], "router": router}}
        return jnp.sum(hidden_states_and_routes(cfg, p, tokens, routes_lbtk=wrong)[0] ** 2)

    g = jax.jit(jax.grad(loss))(params["layers"]["router"])
    assert float(jnp.abs(g).max()) > 0
