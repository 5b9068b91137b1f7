"""One compiled RL update: `update_step(train_state, batch, rng) -> (train_state, metrics)`.

Inside one jitted program (compiled once per batch shape and config):

    rewards -> shaped rewards (overlong / length penalty)
    [old log-probs, reference log-probs, old values: scored without gradients where needed]
    advantages (estimator by name)
    for epoch in num_epochs:                       lax.scan
        shuffle rows, split into num_minibatches   lax.scan
            split into num_microbatches            lax.scan, gradients accumulated
            optax update (global-norm clip, AdamW)

Losses use (numerator, denominator) aggregation: every micro-batch's numerator is divided by the
whole mini-batch's denominator, so accumulated gradients equal one big batch's exactly, and every
metric is summed as a (numerator, denominator) pair and divided once at the end.

Log-probs come from `rljax.models.token_logprobs`, the sampler's own scoring code, so on-policy
ratios start at exactly 1.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from rljax.errors import ConfigError
from rljax.models import ModelConfig, init_value_params, token_logprobs, values
from rljax.objectives import shaping
from rljax.objectives.aggregation import aggregate_parts
from rljax.objectives.advantages import zero_variance_groups
from rljax.objectives.config import AlgorithmConfig
from rljax.objectives.kl import kl
from rljax.objectives.losses import value_loss
from rljax.objectives.registry import ADVANTAGES, OFF_POLICY, POLICY_LOSSES
from rljax.optim import OptimConfig, make_optimizer, make_schedule

Params = Any
sg = jax.lax.stop_gradient


@flax.struct.dataclass
class Batch:
    """One batch of scored rollouts (rows prompt-major when groups come from a sampler).

    tokens_bt: prompt + completion, prompt left-padded; attn_mask_bt: real tokens;
    loss_mask_bt: completion tokens to train on; old_logp_bt: the sampling policy's log-probs
    aligned with tokens (column t scores token t); rewards_b; group_ids_b: ints in [0, B), one per
    prompt group. Optional: baseline_rewards_b (ReMax's greedy reward); old_values_bt: V(state before
    token t) from the rollout's value model (PPO; computed here when absent).
    """

    tokens_bt: jax.Array
    attn_mask_bt: jax.Array
    loss_mask_bt: jax.Array
    old_logp_bt: jax.Array
    rewards_b: jax.Array
    group_ids_b: jax.Array
    baseline_rewards_b: jax.Array | None = None
    old_values_bt: jax.Array | None = None


@flax.struct.dataclass
class TrainState:
    """Everything an update changes, plus the static configs that shape the compiled program."""

    model_cfg: ModelConfig = flax.struct.field(pytree_node=False)
    algo: AlgorithmConfig = flax.struct.field(pytree_node=False)
    optim: OptimConfig = flax.struct.field(pytree_node=False)
    step: jax.Array
    params: Params
    opt_state: Any
    value_params: Params | None = None
    ref_params: Params | None = None


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def init_train_state(model_cfg: ModelConfig, params: Params, algo: AlgorithmConfig, optim: OptimConfig,
                     *, value_params: Params | None = None, key: jax.Array | None = None) -> TrainState:
    """A fresh train state. The reference policy is a frozen copy of `params` when the objective
    has a KL term; a value model is built on the policy backbone when `algo.value_coef > 0`."""
    if algo.uses_values and value_params is None:
        value_params = init_value_params(model_cfg, params, key if key is not None else jax.random.key(0))
    value_params = value_params if algo.uses_values else None
    ref = _copy(params) if algo.uses_reference else None
    opt_state = make_optimizer(optim).init((params, value_params))
    return TrainState(model_cfg=model_cfg, algo=algo, optim=optim, step=jnp.zeros((), jnp.int32),
                      params=params, opt_state=opt_state, value_params=value_params, ref_params=ref)


def reset_reference(state: TrainState, reset_optimizer: bool = True) -> TrainState:
    """ProRL's reference reset (Liu et al., 2025): the reference becomes a copy of the current
    policy and, by default, the optimiser moments restart."""
    opt_state = make_optimizer(state.optim).init((state.params, state.value_params)) \
        if reset_optimizer else state.opt_state
    return state.replace(ref_params=_copy(state.params), opt_state=opt_state)


# ----------------------------------------------------------------------------- scoring helpers


def _state_values(cfg, value_params, tokens_bt, attn_mask_bt, remat=False, unroll=False):
    """V(state before token t): the value head on the hidden state at t - 1 (column 0 is 0)."""
    v_bt = values(cfg, value_params, tokens_bt, attn_mask_bt, remat=remat, unroll=unroll)
    return jnp.concatenate([jnp.zeros_like(v_bt[:, :1]), v_bt[:, :-1]], axis=1)


def _chunked(fn, chunks: int, *arrays):
    """fn over `chunks` row blocks with lax.map (bounded memory for no-grad scoring passes)."""
    if chunks == 1:
        return fn(*arrays)
    split = [a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:]) for a in arrays]
    out = jax.lax.map(lambda xs: fn(*xs), tuple(split))
    return out.reshape(-1, *out.shape[2:])


# ----------------------------------------------------------------------------- the loss


def _loss(trainable, rows, den, cfg: ModelConfig, algo: AlgorithmConfig):
    """Total loss of one micro-batch (numerators over the mini-batch denominator) and its metric
    pairs. `rows` holds this micro-batch's slices; `den` the mini-batch's aggregation denominator."""
    params, value_params = trainable
    mode, norm = algo.aggregation, algo.norm_length
    m = rows["mask"]
    logp, ent = token_logprobs(cfg, params, rows["tokens"], rows["attn"], with_entropy=True, remat=algo.remat,
                               unroll=algo.unroll_layers)
    pg_bt, st = POLICY_LOSSES.get(algo.policy_loss)(
        logp, rows["old_logp"], rows["adv"], m, eps_low=algo.clip_eps_low, eps_high=algo.clip_eps_high,
        dual_clip=algo.dual_clip)
    pg_bt = pg_bt * rows["is_w"]

    def agg(x_bt):
        return aggregate_parts(x_bt, m, mode, norm)

    num_pg, den_pg = agg(pg_bt)
    total = num_pg / den
    ent_num, _ = agg(ent)
    if algo.entropy_coef > 0:
        total = total - algo.entropy_coef * ent_num / den
    n_tok = jnp.sum(m)
    msum = lambda x: jnp.sum(sg(x) * m)  # noqa: E731
    pairs = {
        "loss/policy": (num_pg, den_pg),
        "loss/entropy": (sg(ent_num), den_pg),
        "entropy": (msum(ent), n_tok),
        "clip/low_frac": (msum(st["clip_low"]), n_tok),
        "clip/high_frac": (msum(st["clip_high"]), n_tok),
        "ratio/mean": (msum(st["ratio"]), n_tok),
        "approx_kl": (msum(kl(logp, rows["old_logp"], "k3")), n_tok),
    }
    if algo.uses_reference:
        kl_bt = kl(logp, rows["ref_logp"], algo.kl_estimator)
        num_kl, _ = agg(kl_bt)
        pairs["kl_ref"] = (msum(kl_bt), n_tok)
        if not algo.kl_in_reward:
            total = total + algo.kl_coef * num_kl / den
            pairs["loss/kl"] = (sg(num_kl), den_pg)
    if algo.uses_values:
        v_bt = _state_values(cfg, value_params, rows["tokens"], rows["attn"], algo.remat, algo.unroll_layers)
        vf_bt = value_loss(v_bt, rows["old_values"], rows["returns"], algo.value_clip)
        num_vf, _ = agg(vf_bt)
        total = total + algo.value_coef * num_vf / den
        pairs["loss/value"] = (sg(num_vf), den_pg)
        pairs["value/mean"] = (msum(v_bt), n_tok)
    extremes = {"ratio/max": jnp.max(jnp.where(m > 0, st["ratio"], -jnp.inf)),
                "ratio/min": jnp.min(jnp.where(m > 0, st["ratio"], jnp.inf))}
    return total, (pairs, extremes)


# ----------------------------------------------------------------------------- the update step


def _split(tree, n):
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), tree)


def _prepare(state: TrainState, batch: Batch):
    """Shaped rewards, old/reference log-probs, old values, advantages and importance weights."""
    cfg, algo = state.model_cfg, state.algo
    mask = batch.loss_mask_bt.astype(jnp.float32)
    lengths_b = jnp.sum(mask, axis=-1)
    rewards_b = batch.rewards_b.astype(jnp.float32)
    if algo.overlong_max_length is not None:
        rewards_b = rewards_b + shaping.overlong_penalty(lengths_b, algo.overlong_max_length,
                                                         algo.overlong_buffer)
    if algo.length_penalty:
        rewards_b = rewards_b + shaping.length_penalty(lengths_b, algo.length_penalty, mask.shape[-1])

    chunks = algo.num_minibatches * algo.num_microbatches
    score = lambda p: lambda t, a: token_logprobs(cfg, p, t, a)[0]  # noqa: E731
    toks, attn = batch.tokens_bt, batch.attn_mask_bt
    old_logp, is_w = batch.old_logp_bt.astype(jnp.float32), jnp.ones_like(mask)
    if algo.recompute_old_logp:
        trainer_logp = sg(_chunked(score(state.params), chunks, toks, attn))
        is_w, mask = OFF_POLICY.get(algo.off_policy)(trainer_logp, old_logp, mask, cap=algo.off_policy_cap,
                                                     level=algo.off_policy_level)
        old_logp = trainer_logp
    rows = {"tokens": toks, "attn": attn, "mask": mask, "old_logp": old_logp, "is_w": is_w}
    token_rewards = None
    if algo.uses_reference:
        rows["ref_logp"] = _chunked(score(state.ref_params), chunks, toks, attn)
        if algo.kl_in_reward:
            token_rewards = -algo.kl_coef * kl(old_logp, rows["ref_logp"], algo.kl_estimator) * mask
    old_values = None
    if algo.uses_values:
        old_values = batch.old_values_bt
        if old_values is None:
            old_values = _chunked(lambda t, a: _state_values(cfg, state.value_params, t, a),
                                  chunks, toks, attn)
        old_values = sg(old_values.astype(jnp.float32))
    if algo.advantage == "remax" and batch.baseline_rewards_b is None:
        raise ConfigError("advantage='remax' needs batch.baseline_rewards_b (the greedy response's reward)")
    adv = ADVANTAGES.get(algo.advantage)(
        rewards_b, batch.group_ids_b, mask, token_rewards_bt=token_rewards,
        baseline_b=batch.baseline_rewards_b,
        values_bt=old_values, gamma=algo.gamma, lam=algo.lam, std_normalize=algo.std_normalize, eps=algo.eps)
    rows["adv"] = sg(adv)
    if algo.uses_values:
        rows["old_values"], rows["returns"] = old_values, sg(adv + old_values)

    n = jnp.maximum(jnp.sum(mask), 1.0)
    adv_mean = jnp.sum(adv * mask) / n
    metrics = {
        "reward/mean": jnp.mean(rewards_b), "reward/raw_mean": jnp.mean(batch.rewards_b.astype(jnp.float32)),
        "length/mean": jnp.mean(lengths_b),
        "adv/mean": adv_mean, "adv/std": jnp.sqrt(jnp.sum(jnp.square(adv - adv_mean) * mask) / n),
        "adv/max": jnp.max(jnp.where(mask > 0, adv, -jnp.inf)),
        "adv/min": jnp.min(jnp.where(mask > 0, adv, jnp.inf)),
        "zero_variance_groups": zero_variance_groups(batch.rewards_b.astype(jnp.float32), batch.group_ids_b),
        "is_weight/mean": jnp.sum(is_w * mask) / n,
    }
    return rows, metrics


def _update_step(state: TrainState, batch: Batch, rng: jax.Array):
    """update_step(train_state, batch, rng) -> (train_state, metrics).

    Epochs x shuffled mini-batches x accumulated micro-batches of the configured objective, compiled
    once per batch shape and config; the train state's buffers are donated (do not reuse the old state).
    Metrics are device scalars: loss parts, clip fractions, approximate KL, entropy, ratio statistics,
    grad norm, advantage and reward statistics and the count of zero-variance groups.
    """
    cfg, algo = state.model_cfg, state.algo
    b = batch.tokens_bt.shape[0]
    n_mb, n_micro = algo.num_minibatches, algo.num_microbatches
    if b % (n_mb * n_micro):
        raise ConfigError(f"batch size {b} must be divisible by num_minibatches * num_microbatches = "
                          f"{n_mb * n_micro}")
    tx = make_optimizer(state.optim)
    rows, metrics = _prepare(state, batch)
    grad_fn = jax.value_and_grad(_loss, has_aux=True)

    def minibatch(carry, mb_rows):
        trainable, opt_state = carry
        den = jnp.maximum(aggregate_parts(jnp.zeros_like(mb_rows["mask"]), mb_rows["mask"], algo.aggregation,
                                          algo.norm_length)[1], 1e-8)

        def micro(g_acc, mc_rows):
            (_, (pairs, ext)), grads = grad_fn(trainable, mc_rows, den, cfg, algo)
            return jax.tree.map(jnp.add, g_acc, grads), (pairs, ext)

        zeros_g = jax.tree.map(jnp.zeros_like, trainable)
        grads, (pairs, ext) = jax.lax.scan(micro, zeros_g, _split(mb_rows, n_micro))
        pairs = jax.tree.map(lambda x: jnp.sum(x, axis=0), pairs)
        ext = {"ratio/max": jnp.max(ext["ratio/max"]), "ratio/min": jnp.min(ext["ratio/min"])}
        gnorm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        pairs["grad_norm"] = (gnorm, jnp.ones(()))
        return (trainable, opt_state), (pairs, ext)

    def epoch(carry, key):
        if n_mb > 1:
            perm = jax.random.permutation(key, b)
            shuffled = jax.tree.map(lambda x: jnp.take(x, perm, axis=0), rows)
        else:
            shuffled = rows
        return jax.lax.scan(minibatch, carry, _split(shuffled, n_mb))

    keys = jax.random.split(rng, algo.num_epochs)
    carry = ((state.params, state.value_params), state.opt_state)
    ((params, value_params), opt_state), (pairs, ext) = jax.lax.scan(epoch, carry, keys)
    for name, (num, den) in pairs.items():
        metrics[name] = jnp.sum(num) / jnp.maximum(jnp.sum(den), 1e-8)
    metrics["ratio/max"], metrics["ratio/min"] = jnp.max(ext["ratio/max"]), jnp.min(ext["ratio/min"])
    metrics["lr"] = make_schedule(state.optim)(state.step)
    metrics["num_updates"] = jnp.asarray(algo.num_epochs * n_mb, jnp.int32)
    new_state = state.replace(step=state.step + algo.num_epochs * n_mb, params=params,
                              value_params=value_params, opt_state=opt_state)
    return new_state, metrics


update_step = jax.jit(_update_step, donate_argnums=(0,))
