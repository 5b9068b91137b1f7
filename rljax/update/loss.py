"""The loss of one micro-batch of a `PreparedBatch`: policy loss, entropy bonus, KL and value terms.

Every term is a (numerator, denominator) aggregation (`rljax.objectives.aggregation`); each
micro-batch divides its numerator by the whole mini-batch's denominator, so accumulated
gradients equal one big batch's exactly. Metrics are returned the same way: pairs to be summed
over micro-batches and divided once, plus per-micro-batch extremes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.errors import ConfigError
from rljax.models import ModelConfig, output_embedding, token_logprobs
from rljax.models.auxiliary import FrozenModel
from rljax.objectives.aggregation import aggregate_parts
from rljax.objectives.config import AlgorithmConfig
from rljax.objectives.kl import kl
from rljax.objectives.losses import value_loss
from rljax.objectives.registry import DISTILLATION, POLICY_LOSSES
from rljax.objectives.rollout_correction import mask_kl_penalty
from rljax.update.batch import PreparedBatch, replayed_routes, state_values
from rljax.update.config import UpdateConfig
from rljax.update.controls import select_tokens
from rljax.update.moe_terms import router_terms
from rljax.update.packing import Slab

sg = jax.lax.stop_gradient

MetricPairs = dict[str, tuple[jax.Array, jax.Array]]


def aggregation_denominator(batch: PreparedBatch, algo: AlgorithmConfig, norm_length: int) -> jax.Array:
    """The aggregation denominator of a whole (mini-)batch; the loss of each part divides by it."""
    mask = batch.loss_mask_bt
    return jnp.maximum(aggregate_parts(jnp.zeros_like(mask), mask, algo.aggregation, norm_length)[1], 1e-8)


def microbatch_loss(trainable, batch: PreparedBatch, den: jax.Array, *, cfg: ModelConfig, algo: AlgorithmConfig,
                    update_cfg: UpdateConfig, norm_length: int, share: float = 1.0, models=None,
                    slab: Slab | None = None, teacher: FrozenModel | None = None, entropy_coef=None,
                    controls_key: jax.Array | None = None
                    ) -> tuple[jax.Array, tuple[MetricPairs, dict[str, jax.Array]]]:
    """Total loss of one micro-batch (numerators over the mini-batch denominator `den`) and its
    metrics: (numerator, denominator) pairs and extremes. `share` is this micro-batch's share of
    the mini-batch (1 / num_microbatches), so loss pairs (num, share * den) sum to the mini-batch's
    own ratio for every aggregation mode. `trainable` is the (policy, critic) params pair, or
    what `models` maps to it (a LoRA state's `TrainState.models`: adapters onto the frozen base).

    With `slab` (a packed micro-batch, `rljax.update.packing`), `batch` is the whole mini-batch:
    the model runs on the slab's packed buffers, its outputs land on their padded rows, and the
    loss reads only those rows (the others are masked out).

    A distillation loss (`algorithm.distill = "gjsd"`) adds distill_coef x its aggregated
    per-token divergence to the `teacher`'s distribution (hidden states from `prepare_batch`).

    Entropy and rollout controls: `entropy_coef` is the adaptive coefficient carried in the train
    state (`algorithm.entropy_target`; None: `algorithm.entropy_coef`); a mini-batch's
    `select_bt` goes to a selecting policy loss (Clip-Cov, KL-Cov), its `entropy_keep_bt`
    multiplies the policy loss (the high-entropy tokens keep it, the others stay in the
    denominator, as in TRL), and a `mask_kl` correction adds off_policy_kl_coef x the aggregated
    1/2 (log pi - log mu)^2 on the tokens it zeroed (`rljax.objectives.rollout_correction`).
    With `controls_key` (the mini-batch's key; only when `batch` is the whole mini-batch, unpacked,
    `rljax.update.controls.controls_in_loss`) the loss selects those tokens itself from its own
    forward's detached log-probs and entropies (`select_tokens`) instead of a scoring pass, and
    returns the selection's metrics with its own.

    Routing replay: a batch carrying `routes_btlk` runs its forward (packed or not) with those
    experts; the routing metrics then compare the trainer's own top-k with the record."""
    params, value_params = trainable if models is None else models(trainable)
    image_kw = {}
    if batch.vision is not None:  # image rows: the tower's embeddings spliced in, M-RoPE tables (packed: per buffer)
        params, image_kw = batch.vision.splice(params, slab, batch.tokens_bt, batch.attn_mask_bt,
                                               remat=update_cfg.remat)
    m = batch.loss_mask_bt
    b, t = batch.tokens_bt.shape
    with_entropy = algo.entropy_coef > 0 or update_cfg.log_entropy or algo.adaptive_entropy
    select_here = controls_key is not None
    if select_here and slab is not None:
        raise ValueError("controls_key selects over the whole mini-batch; a packed slab holds part of it")
    mask_entropy = select_here and algo.top_entropy_quantile < 1.0  # the mask reads this forward's entropies
    v_bt = None
    distill = DISTILLATION.get(algo.distill) if algo.distill != "none" else None
    distill_loss = distill is not None and distill.kind == "loss"
    if distill_loss and slab is not None:
        raise ConfigError(f"algorithm.distill={algo.distill!r} reads whole rows' distributions, which packed "
                          "micro-batches do not keep: set update.packing=false")
    if slab is None:
        lp_chunks = update_cfg.chunk_for(b, t, cfg.vocab_size)
        logp, ent, *h_s = token_logprobs(cfg, params, batch.tokens_bt, batch.attn_mask_bt,
                                         with_entropy=with_entropy or mask_entropy,
                                         chunk_size=lp_chunks.time, vocab_chunk=lp_chunks.vocab, remat=update_cfg.remat,
                                         unroll=update_cfg.layers_unrolled(), return_hidden=distill_loss,
                                         return_routing=cfg.moe is not None,
                                         routes_lbtk=replayed_routes(batch.routes_btlk), **image_kw)
        routing = h_s.pop() if cfg.moe is not None else None
        routing_mask = batch.attn_mask_bt
    else:
        lp_chunks = update_cfg.chunk_for(slab.buffers, slab.plan.pack_length, cfg.vocab_size)
        logp, ent, v_bt, *packed = slab.scores(cfg, params, value_params if algo.uses_values else None,
                                               batch.tokens_bt, batch.attn_mask_bt, with_entropy=with_entropy,
                                               chunks=lp_chunks, remat=update_cfg.remat,
                                               unroll=update_cfg.layers_unrolled(), routes_btlk=batch.routes_btlk,
                                               return_routing=cfg.moe is not None, **image_kw)
        # the router terms over the packed buffers' real tokens: the rows the update packs (those
        # with a loss token), where the padded layout reads every real token of the micro-batch
        routing, routing_mask = packed[0] if packed else (None, None)
        m = m * slab.rows()[:, None].astype(m.dtype)
    control_pairs = {}
    if select_here:  # the token controls from this forward, detached (`rljax.update.controls`)
        batch, control_pairs = select_tokens(algo, batch, sg(logp), None if ent is None else sg(ent), controls_key)
    selected = {} if batch.select_bt is None else dict(select_bt=batch.select_bt, kl_cov_coef=algo.kl_cov_coef)
    pg_bt, st = POLICY_LOSSES.get(algo.policy_loss)(
        logp, batch.old_logp_bt, batch.advantages_bt, m, eps_low=algo.clip_eps_low, eps_high=algo.clip_eps_high,
        dual_clip=algo.dual_clip, **selected)
    pg_bt = pg_bt * batch.is_weight_bt
    if batch.entropy_keep_bt is not None:
        pg_bt = pg_bt * batch.entropy_keep_bt

    def agg(x_bt):
        return aggregate_parts(x_bt, m, algo.aggregation, norm_length)[0]

    loss_den = share * den
    num_pg = agg(pg_bt)
    total = num_pg / den
    n_tok = jnp.sum(m)
    msum = lambda x: jnp.sum(sg(x) * m)  # noqa: E731
    log_ratio = logp - batch.old_logp_bt
    pairs: MetricPairs = {
        "loss/policy": (sg(num_pg), loss_den),
        "clip/low_frac": (msum(st["clip_low"]), n_tok),
        "clip/high_frac": (msum(st["clip_high"]), n_tok),
        "ratio/mean": (msum(st["ratio"]), n_tok),
        # KL(pi_old || pi) for samples from pi_old: k3 with r = pi / pi_old (Schulman, 2020).
        "approx_kl": (msum(kl(batch.old_logp_bt, logp, "k3")), n_tok),
        "logp_diff/abs_mean": (msum(jnp.abs(log_ratio)), n_tok),
    }
    pairs.update(control_pairs)
    if with_entropy:
        ent_num = agg(ent)
        if algo.adaptive_entropy:
            coef = algo.entropy_coef if entropy_coef is None else entropy_coef
            total = total - coef * ent_num / den
        elif algo.entropy_coef > 0:
            total = total - algo.entropy_coef * ent_num / den
        pairs["loss/entropy"] = (sg(ent_num), loss_den)
        pairs["entropy"] = (msum(ent), n_tok)
        if algo.token_controls or algo.adaptive_entropy:
            pairs["policy/entropy"] = (msum(ent), n_tok)
    if batch.correction_kl_bt is not None:
        num_ckl = agg(mask_kl_penalty(logp, batch.behaviour_logp_bt, batch.correction_kl_bt))
        total = total + algo.off_policy_kl_coef * num_ckl / den
        pairs["loss/off_policy_kl"] = (sg(num_ckl), loss_den)
    if algo.uses_reference:
        kl_bt = kl(logp, batch.ref_logp_bt, algo.kl_estimator, clamp=algo.kl_clamp)
        pairs["kl_ref"] = (msum(kl_bt), n_tok)
        if not algo.kl_in_reward:
            num_kl = agg(kl_bt)
            total = total + algo.kl_coef * num_kl / den
            pairs["loss/kl"] = (sg(num_kl), loss_den)
    if distill_loss:
        jsd_bt = distill.fn(h_s[0], output_embedding(cfg, params), batch.teacher_hidden_btd,
                            output_embedding(teacher.cfg, teacher.params), beta=algo.distill_beta,
                            softcap_s=cfg.final_logit_softcap, softcap_t=teacher.cfg.final_logit_softcap,
                            time_chunk=lp_chunks.time, vocab_chunk=lp_chunks.vocab)
        num_d = agg(jsd_bt)
        total = total + algo.distill_coef * num_d / den
        pairs["loss/distill"] = (sg(num_d), loss_den)
        pairs["distill/gjsd"] = (msum(jsd_bt), n_tok)
    if routing is not None:  # an MoE policy: router losses and routing metrics (`rljax.update.moe_terms`)
        router_loss, router_pairs = router_terms(routing, routing_mask, cfg, algo, share)
        total = total + router_loss
        pairs.update(router_pairs)
    if algo.uses_values:
        if v_bt is None:
            v_bt = state_values(cfg, value_params, batch.tokens_bt, batch.attn_mask_bt, remat=update_cfg.remat,
                                unroll=update_cfg.layers_unrolled())
        num_vf = agg(value_loss(v_bt, batch.old_values_bt, batch.returns_bt, algo.value_clip))
        total = total + algo.value_coef * num_vf / den
        pairs["loss/value"] = (sg(num_vf), loss_den)
        pairs["value/mean"] = (msum(v_bt), n_tok)
    on = m > 0
    extremes: dict[str, Any] = {
        "ratio/max": jnp.max(jnp.where(on, st["ratio"], -jnp.inf)),
        "ratio/min": jnp.min(jnp.where(on, st["ratio"], jnp.inf)),
        "logp_diff/abs_max": jnp.max(jnp.where(on, jnp.abs(sg(log_ratio)), 0.0)),
    }
    return total, (pairs, extremes)
