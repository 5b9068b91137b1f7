"""One compiled RL update: `update_step(train_state, rollout_batch, rng) -> (train_state, metrics)`.

Inside one jitted program (compiled once per batch shape and config):

    prepare_batch: shaped rewards, old / reference log-probs, old values, advantages (update/advantages.py)
    for epoch in num_epochs:                       lax.scan
        shuffle rows, split into num_minibatches   lax.scan
            split into num_microbatches            lax.scan, gradients accumulated
            optax update (global-norm clip, AdamW)

Metrics are summed as (numerator, denominator) pairs and divided once at the end, so they equal
one big batch's. Log-probs come from `rljax.models.token_logprobs`, the sampler's own scoring
code: an on-policy ratio starts at 1 up to the sampler/trainer numerics gap, which is reported
every step as `update/logp_diff_mean|max` and `update/ratio_first_min|max` (see `update`).
"""

from __future__ import annotations

from typing import Any

import functools

import flax.struct
import jax
import jax.numpy as jnp
import optax

from rljax.errors import ConfigError
from rljax.lora import LoraConfig, attach, attach_value, init_adapters, init_value_adapters, merge
from rljax.models import ModelConfig, init_value_params
from rljax.models.auxiliary import FrozenModel, check_vocabulary
from rljax.rewards.learned import LearnedReward
from rljax.objectives.config import AlgorithmConfig
from rljax.objectives.entropy_control import adaptive_entropy_coef
from rljax.objectives.shaping import RewardShaping
from rljax.optim import OptimConfig, make_optimizer, make_schedule
from rljax.sharding import Layout, sync_weights
from rljax.update.advantages import check_routing_replay, prepare_batch
from rljax.update.batch import RolloutBatch, rows
from rljax.update.config import UpdateConfig
from rljax.update.controls import controls_in_loss, fast_logp, token_controls
from rljax.update.loss import aggregation_denominator, microbatch_loss
from rljax.update.packing import Slab, pack_rows, pad_fraction
from rljax.update.vision import freeze_tower

Params = Any


@flax.struct.dataclass
class TrainState:
    """Everything an update changes, plus the static configs that shape the compiled program.

    With LoRA (`lora` set, `rljax.lora`) `params` is the frozen base model and `adapters` are what
    the update trains (with the critic's adapters and head in `value_params`, when there is a
    critic): gradients and optimiser state cover `trainable` only, and the reference policy is
    the base itself (`reference_params`), so `ref_params` stays None.

    `teacher` is a frozen distillation teacher (`rljax.models.FrozenModel`, any architecture with
    the policy's vocabulary) when the objective distils (`algorithm.distill`): scored inside the
    update, never trained, and returned as it came. `reward_model` is a learned reward
    (`rljax.rewards.learned.LearnedReward`): a frozen reward model scored inside the update, whose
    weighted score joins the verifier's rewards; only its running moments change.

    `entropy_coef` is the adaptive entropy coefficient (`algorithm.entropy_target`; None without
    one): the loss uses it, and each update moves it toward the target
    (`rljax.objectives.entropy_control.adaptive_entropy_coef`)."""

    model_cfg: ModelConfig = flax.struct.field(pytree_node=False)
    algo: AlgorithmConfig = flax.struct.field(pytree_node=False)
    optim: OptimConfig = flax.struct.field(pytree_node=False)
    update_cfg: UpdateConfig = flax.struct.field(pytree_node=False)
    shaping: RewardShaping = flax.struct.field(pytree_node=False)
    step: jax.Array
    params: Params
    opt_state: Any
    value_params: Params | None = None
    ref_params: Params | None = None
    adapters: Params | None = None
    lora: LoraConfig | None = flax.struct.field(pytree_node=False, default=None)
    teacher: FrozenModel | None = None
    reward_model: LearnedReward | None = None
    entropy_coef: jax.Array | None = None

    @property
    def trainable(self) -> tuple[Params, Params | None]:
        """(policy part, critic part) the optimiser updates: the params, or the LoRA adapters."""
        return (self.params if self.adapters is None else self.adapters), self.value_params

    def models(self, trainable=None, dropout_key: jax.Array | None = None) -> tuple[Params, Params | None]:
        """(policy params, critic params) the forward runs, from `trainable` (default: the state's):
        as they are, or the frozen base with the adapters attached (`rljax.lora.attach`; the
        dropout key turns on LoRA dropout, for the trained forward)."""
        policy, critic = self.trainable if trainable is None else trainable
        if self.adapters is None:
            return policy, critic
        k_policy, k_critic = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        policy = attach(self.params, policy, self.lora, dropout_key=k_policy)
        return policy, None if critic is None else attach_value(self.params, critic, self.lora, dropout_key=k_critic)

    @property
    def reference_params(self) -> Params | None:
        """The KL reference: the frozen base under LoRA (the adapters switched off), else the copy."""
        return self.params if self.adapters is not None else self.ref_params

    def sampler_params(self) -> Params:
        """The policy the sampler decodes with: the params, or under LoRA the base with the
        adapters merged (`lora.merge_for_sampling`) or attached."""
        if self.adapters is None:
            return self.params
        if self.lora.merge_for_sampling:
            return merge(self.params, self.adapters, self.lora)
        return attach(self.params, self.adapters, self.lora)


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def init_train_state(model_cfg: ModelConfig, params: Params, algo: AlgorithmConfig, optim: OptimConfig, *,
                     update_cfg: UpdateConfig = UpdateConfig(), shaping: RewardShaping = RewardShaping(),
                     value_params: Params | None = None, key: jax.Array | None = None,
                     layout: Layout | None = None, lora: LoraConfig | None = None,
                     adapters: Params | None = None, teacher: FrozenModel | None = None,
                     reward_model: LearnedReward | None = None) -> TrainState:
    """A fresh train state. The reference policy is a frozen copy of `params` when the objective
    needs reference log-probs (a KL term); a value model is built on the policy backbone when it
    needs values (`value_coef > 0`).

    With `lora` enabled (rank > 0) `params` stay frozen: the state trains `adapters` (fresh when
    None, e.g. `rljax.lora.load_peft`'s to continue one), the critic is the base with adapters of
    its own and a head, and no reference copy is made (the base is the reference).

    With `layout` (the trainer's `rljax.sharding.Layout`) the state is born sharded: the reference
    copy, the value model and the optimiser moments come out of one compiled program whose
    `out_shardings` are `layout.tree` of the abstract state (`jax.eval_shape`), so each device
    writes only its own shards and no device holds a whole weight. `params` pass through as they
    are when already in the layout (no copy); otherwise they are moved there device to device
    first. Without a layout the state is built eagerly next to `params`. A distilling objective
    needs a `teacher` (`FrozenModel`), which is held as it comes (load it in the layout)."""
    key = key if key is not None else jax.random.key(0)
    lora = lora if lora is not None and lora.enabled else None
    check_routing_replay(model_cfg, algo)
    if algo.needs.teacher_logp and teacher is None:
        raise ConfigError(f"algorithm.distill={algo.distill!r} grades samples with a teacher: pass teacher= (a run "
                          "loads it from teacher.checkpoint)")
    if teacher is not None:
        check_vocabulary(model_cfg, teacher.cfg, "teacher")
    if reward_model is not None:
        check_vocabulary(model_cfg, reward_model.model.cfg, "reward model")
    configs = dict(model_cfg=model_cfg, algo=algo, optim=optim, update_cfg=update_cfg, shaping=shaping, lora=lora,
                   teacher=teacher if algo.needs.teacher_logp else None, reward_model=reward_model)
    if layout is None:
        return TrainState(**configs, params=params,
                          **_fresh_parts(model_cfg, algo, optim, lora, params, value_params, adapters, key))
    build = functools.partial(_fresh_parts, model_cfg, algo, optim, lora)
    abstract = jax.eval_shape(lambda p, v, a, k: TrainState(**configs, params=p, **build(p, v, a, k)),
                              params, value_params, adapters, key)
    shardings = layout.tree(abstract)
    params = _in_layout(params, shardings.params)
    out = {name: getattr(shardings, name)
           for name in ("step", "opt_state", "value_params", "ref_params", "adapters", "entropy_coef")}
    return TrainState(**configs, params=params,
                      **jax.jit(build, out_shardings=out)(params, value_params, adapters, key))


def _fresh_parts(model_cfg: ModelConfig, algo: AlgorithmConfig, optim: OptimConfig, lora: LoraConfig | None,
                 params: Params, value_params: Params | None, adapters: Params | None,
                 key: jax.Array) -> dict[str, Any]:
    """The fields of a fresh state besides params: step, optimiser state, value params, reference
    and, with LoRA, the adapters."""
    needs = algo.needs
    if lora is not None:
        k_policy, k_critic = jax.random.split(key)
        adapters = init_adapters(model_cfg, lora, k_policy) if adapters is None else adapters
        if needs.values and value_params is None:
            value_params = init_value_adapters(model_cfg, lora, k_critic)
    elif needs.values and value_params is None:
        value_params = init_value_params(model_cfg, params, key)
    value_params = value_params if needs.values else None
    trained = params if lora is None else adapters
    return {"step": jnp.zeros((), jnp.int32), "opt_state": make_optimizer(optim).init((trained, value_params)),
            "value_params": value_params, "adapters": adapters if lora is not None else None,
            "ref_params": _copy(params) if needs.reference_logp and lora is None else None,
            "entropy_coef": jnp.asarray(algo.entropy_coef, jnp.float32) if algo.adaptive_entropy else None}


def _in_layout(params: Params, shardings) -> Params:
    """`params` in `shardings`: as they are when already there, else moved device to device."""
    leaves = jax.tree.leaves(params)
    if all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
           for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True)):
        return params
    if all(isinstance(x, jax.Array) for x in leaves):
        return sync_weights(params, shardings)[0]
    return jax.device_put(params, shardings)


def reset_reference(state: TrainState, reset_optimizer: bool = True) -> TrainState:
    """ProRL's reference reset (Liu et al., 2025): the reference becomes a copy of the current
    policy and, by default, the optimiser moments restart. The learning-rate schedule does not
    restart: its step count is kept, so warmup is not replayed and the logged `lr` stays true."""
    if state.adapters is not None:
        raise ConfigError("a LoRA run's reference is its frozen base model and cannot be reset; "
                          "set rl.reference_reset_every=0")
    opt_state = state.opt_state
    if reset_optimizer:
        fresh = make_optimizer(state.optim).init(state.trainable)
        is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
        opt_state = jax.tree.map(lambda new, old: old if is_schedule(new) else new, fresh, state.opt_state,
                                 is_leaf=is_schedule)
    return state.replace(ref_params=_copy(state.params), opt_state=opt_state)


def _extreme(name: str, values):
    """The extreme a `.../min` or `.../max` metric keeps over micro-batches, mini-batches, epochs."""
    return jnp.min(values) if name.endswith("/min") else jnp.max(values)


def update(state: TrainState, batch: RolloutBatch, rng: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    """update(train_state, batch, rng) -> (train_state, metrics), traceable (`update_step` is its
    jitted, donating form; call this one inside a larger compiled program).

    Epochs x shuffled mini-batches x accumulated micro-batches of the configured objective.
    Metrics are device scalars: loss parts, clip fractions, approximate KL, entropy, ratio and
    log-prob-difference statistics, grad norm, advantage and reward statistics.
    """
    cfg, algo, sched = state.model_cfg, state.algo, state.update_cfg
    b = batch.tokens_bt.shape[0]
    n_mb, n_micro = sched.num_minibatches, sched.num_microbatches
    if b % sched.chunks:
        raise ConfigError(f"batch size {b} must be divisible by update.num_minibatches * num_microbatches = "
                          f"{sched.chunks}")
    norm_length = algo.norm_length or batch.completion_len
    tx = make_optimizer(state.optim)
    prepared, metrics = prepare_batch(state, batch)
    grad_fn = jax.value_and_grad(microbatch_loss, has_aux=True)

    lora_dropout = state.lora is not None and state.lora.dropout > 0
    # the token controls' selection: from the loss's own forward where that forward sees the whole
    # mini-batch at its params, else from a scoring pass before micro-batching (rljax.update.controls)
    select_in_loss = controls_in_loss(state)

    def microbatches(trainable, mb, mb_key, den):
        """Gradients and metrics of a mini-batch, accumulated over `num_microbatches` row blocks."""
        def micro(g_acc, xs):
            part, key = xs
            models = functools.partial(state.models, dropout_key=key if lora_dropout else None)
            (_, aux), grads = grad_fn(trainable, part, den, cfg=cfg, algo=algo, update_cfg=sched,
                                      norm_length=norm_length, share=1.0 / n_micro, models=models,
                                      teacher=state.teacher, entropy_coef=state.entropy_coef,
                                      controls_key=mb_key if select_in_loss else None)
            return jax.tree.map(jnp.add, g_acc, grads), aux

        zeros = jax.tree.map(jnp.zeros_like, trainable)
        grads, (pairs, ext) = jax.lax.scan(micro, zeros, (rows(mb, n_micro), jax.random.split(mb_key, n_micro)))
        return grads, jax.tree.map(lambda x: jnp.sum(x, axis=0), pairs), {k: _extreme(k, v) for k, v in ext.items()}

    def packed_microbatches(trainable, mb, mb_key, den):
        """The same, over packed micro-batches (`rljax.update.packing`): as many as the rows fill,
        a loop whose trip count follows the data inside one program."""
        per, length = sched.packed_shape(mb.tokens_bt.shape[0], mb.tokens_bt.shape[1])
        plan = pack_rows(mb.attn_mask_bt, mb.loss_mask_bt, length)
        n_slabs = (plan.num_buffers + per - 1) // per

        def loss_grads(i):
            key = jax.random.fold_in(mb_key, i)
            models = functools.partial(state.models, dropout_key=key if lora_dropout else None)
            return grad_fn(trainable, mb, den, cfg=cfg, algo=algo, update_cfg=sched, norm_length=norm_length,
                           share=1.0 / jnp.maximum(n_slabs, 1), models=models, slab=Slab(plan, i * per, per),
                           teacher=state.teacher, entropy_coef=state.entropy_coef)

        def body(i, carry):
            g_acc, pairs_acc, ext_acc = carry
            (_, (pairs, ext)), grads = loss_grads(i)
            ext = {k: jnp.minimum(ext_acc[k], v) if k.endswith("/min") else jnp.maximum(ext_acc[k], v)
                   for k, v in ext.items()}
            return jax.tree.map(jnp.add, g_acc, grads), jax.tree.map(jnp.add, pairs_acc, pairs), ext

        (_, (pairs0, ext0)), grads0 = jax.eval_shape(loss_grads, jnp.zeros((), jnp.int32))
        init = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads0, pairs0))
                + ({k: jnp.full(v.shape, jnp.inf if k.endswith("/min") else -jnp.inf, v.dtype)
                    for k, v in ext0.items()},))
        grads, pairs, ext = jax.lax.fori_loop(0, n_slabs, body, init)
        before, after = pad_fraction(mb.attn_mask_bt, plan, per)
        pairs["update/pad_fraction_padded"] = (before, jnp.ones(()))
        pairs["update/pad_fraction"] = (after, jnp.ones(()))
        pairs["update/packed_microbatches"] = (n_slabs.astype(jnp.float32), jnp.ones(()))
        return grads, pairs, ext

    def minibatch(carry, xs):
        (trainable, opt_state), (mb, mb_key) = carry, xs
        den = aggregation_denominator(mb, algo, norm_length)
        control_pairs = {}
        if algo.token_controls and not select_in_loss:  # selections over the whole mini-batch
            known = mb.old_logp_bt if fast_logp(algo, sched) else None
            mb, control_pairs = token_controls(state, trainable, mb, mb_key, chunks=n_micro, logp_bt=known)
        accumulate = packed_microbatches if sched.packing else microbatches
        grads, pairs, ext = accumulate(trainable, mb, mb_key, den)
        pairs.update(control_pairs)
        pairs["grad_norm"] = (optax.tree.norm(grads), jnp.ones(()))
        updates, opt_state = tx.update(grads, opt_state, trainable)
        updates = (freeze_tower(updates[0], mb.vision), updates[1])  # a frozen tower moves not at all
        return (optax.apply_updates(trainable, updates), opt_state), (pairs, ext)

    def epoch(carry, key):
        shuffled = prepared
        if n_mb > 1:
            perm = jax.random.permutation(key, b)
            shuffled = jax.tree.map(lambda x: jnp.take(x, perm, axis=0), prepared)
        mb_keys = jax.random.split(jax.random.fold_in(key, 1), n_mb)  # LoRA dropout
        return jax.lax.scan(minibatch, carry, (rows(shuffled, n_mb), mb_keys))

    keys = jax.random.split(rng, sched.num_epochs)
    carry = (state.trainable, state.opt_state)
    ((trained, value_params), opt_state), (pairs, ext) = jax.lax.scan(epoch, carry, keys)
    # pairs and extremes are stacked [epochs, minibatches]
    for name, (num, den) in pairs.items():
        metrics[name] = jnp.sum(num) / jnp.maximum(jnp.sum(den), 1e-8)
    for name, v in ext.items():
        metrics[name] = _extreme(name, v)
    # The sampler/trainer mismatch: with `recompute_old_logp`, prepare_batch measured it over every
    # row; otherwise the first mini-batch is scored with the params that sampled against the
    # sampler's log-probs, so its |log-ratio| is the mismatch. The ratio's spread there is what PPO
    # starts from (the policy loss's ratio: per token, per sequence for GSPO).
    if not algo.recompute_old_logp:
        first_num, first_den = pairs["logp_diff/abs_mean"]
        metrics["update/logp_diff_mean"] = first_num[0, 0] / jnp.maximum(first_den[0, 0], 1e-8)
        metrics["update/logp_diff_max"] = ext["logp_diff/abs_max"][0, 0]
    metrics["update/ratio_first_min"] = ext["ratio/min"][0, 0]
    metrics["update/ratio_first_max"] = ext["ratio/max"][0, 0]
    entropy_coef = state.entropy_coef
    if algo.adaptive_entropy:  # Skywork-OR1: toward the target, from this update's entropy
        metrics["entropy/coef"] = entropy_coef
        entropy_coef = adaptive_entropy_coef(entropy_coef, metrics["entropy"], algo.entropy_target,
                                             algo.entropy_coef_step)
        metrics["entropy/coef_next"] = entropy_coef
    metrics["lr"] = make_schedule(state.optim)(state.step)
    metrics["num_updates"] = jnp.asarray(sched.num_epochs * n_mb, jnp.int32)
    reward_model = state.reward_model
    if reward_model is not None:  # the batch joins the learned reward's running moments
        reward_model = reward_model.observe(prepared.reward_model_scores_b, jnp.sum(prepared.loss_mask_bt, -1) > 0)
    new_state = state.replace(step=state.step + sched.num_epochs * n_mb, value_params=value_params,
                              opt_state=opt_state, reward_model=reward_model, entropy_coef=entropy_coef,
                              **{"params" if state.adapters is None else "adapters": trained})
    return new_state, metrics


update_step = jax.jit(update, donate_argnums=(0,))
"""The compiled update: `update_step(state, batch, rng)`; the state's buffers are donated (do not
reuse the old state)."""
