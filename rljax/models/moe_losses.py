"""Router auxiliary losses and routing metrics of an MoE model, from its `MoEAux` ([L, B, T, ...]).

- Load balancing (Switch Transformer, Fedus et al., 2022; top-k form of transformers'
  `load_balancing_loss_func`): over the real tokens of all layers together,

      f_je = share of tokens whose j-th choice is expert e,   P_e = mean router probability of e,
      L_lb = E * sum_j sum_e f_je P_e

  which is k when routing is uniform and grows as tokens pile onto few experts. f is a count
  (no gradient); the gradient reaches the router through P.
- Router z-loss (ST-MoE, Zoph et al., 2022, eq. 5): L_z = mean over real tokens and layers of
  (log sum_e exp x_e)^2, which keeps router logits small, so bf16 rounding of them (and so
  near-tie flips between sampler and trainer) matters less.

`routing_metrics` gives `moe/route_agreement` (the share of token-layer choices whose router's
own top-k set equals the experts used: 1 without replay, the sampler/trainer agreement with it)
and `moe/expert_load` (max over mean tokens per expert, averaged over layers; 1 is balanced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.models.moe import MoEAux


def _mask_l(mask_bt, num_layers: int):
    return jnp.broadcast_to(mask_bt.astype(jnp.float32), (num_layers, *mask_bt.shape))


def load_balancing_loss(aux: MoEAux, mask_bt, num_experts: int, top_k: int):
    """L_lb (see the module docstring) over the real tokens (`mask_bt`) of every layer, scalar f32."""
    logits = aux.router_logits_bte.astype(jnp.float32)
    m = _mask_l(mask_bt, logits.shape[0])[..., None]
    probs = jax.nn.softmax(logits, axis=-1)
    chosen = jax.lax.top_k(probs, top_k)[1]
    onehot_lbtke = jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    f_ke = jax.lax.stop_gradient(jnp.sum(onehot_lbtke * m[..., None], axis=(0, 1, 2)) / n)
    p_e = jnp.sum(probs * m, axis=(0, 1, 2)) / n
    return num_experts * jnp.sum(f_ke * p_e[None])


def router_z_loss(aux: MoEAux, mask_bt):
    """L_z = mean over real tokens and layers of logsumexp(router logits)^2 (ST-MoE), scalar f32."""
    lse = jax.nn.logsumexp(aux.router_logits_bte.astype(jnp.float32), axis=-1)
    m = _mask_l(mask_bt, lse.shape[0])
    return jnp.sum(lse * lse * m) / jnp.maximum(jnp.sum(m), 1.0)


def routing_metrics(aux: MoEAux, mask_bt, num_experts: int) -> dict[str, jax.Array]:
    """`moe/route_agreement` and `moe/expert_load` over the real tokens (module docstring)."""
    m = _mask_l(mask_bt, aux.routes_btk.shape[0])
    same = jnp.all(jnp.sort(aux.routes_btk, -1) == jnp.sort(aux.own_routes_btk, -1), axis=-1)
    counts_le = jnp.sum(jax.nn.one_hot(aux.routes_btk, num_experts, dtype=jnp.float32) * m[..., None, None],
                        axis=(1, 2, 3))
    load = jnp.max(counts_le, -1) / jnp.maximum(jnp.mean(counts_le, -1), 1e-9)
    return {"moe/route_agreement": jnp.sum(same * m) / jnp.maximum(jnp.sum(m), 1.0),
            "moe/expert_load": jnp.mean(load)}
