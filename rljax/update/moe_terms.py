"""An MoE policy's terms in the update loss: the router losses and the routing metrics.

`microbatch_loss` calls `router_terms` with the micro-batch's routing (`rljax.models.moe.MoEAux`
from the scoring forward) when the policy has MoE layers; the objectives never see it. The losses
(`rljax.models.moe_losses`) are means over the micro-batch's real tokens (prompt and completion,
the tokens the router saw), weighted by `share` so accumulated micro-batches average them.
"""

from __future__ import annotations

import jax

from rljax.models import ModelConfig
from rljax.models.moe import MoEAux
from rljax.models.moe_losses import load_balancing_loss, router_z_loss, routing_metrics
from rljax.objectives.config import AlgorithmConfig

sg = jax.lax.stop_gradient


def router_terms(aux: MoEAux, mask_bt, cfg: ModelConfig, algo: AlgorithmConfig, share: float):
    """(loss to add: share * (router_aux_coef L_lb + router_z_coef L_z), metric pairs
    {name: (share * value, share)}: `loss/router_aux`, `loss/router_z`, `moe/route_agreement`,
    `moe/expert_load`)."""
    lb = load_balancing_loss(aux, mask_bt, cfg.moe.num_experts, cfg.moe.top_k)
    z = router_z_loss(aux, mask_bt)
    values = {"loss/router_aux": lb, "loss/router_z": z, **routing_metrics(aux, mask_bt, cfg.moe.num_experts)}
    pairs = {name: (sg(v) * share, share) for name, v in values.items()}
    return share * (algo.router_aux_coef * lb + algo.router_z_coef * z), pairs
