"""AReaL's decoupled PPO objective (`off_policy='decoupled'`): against a NumPy version written from
the paper (value and gradient, with masks, -inf padding and the behaviour-weight cap), and, with
proximal == behaviour, bitwise the plain PPO clip loss through `prepare_batch` + `microbatch_loss`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import objectives as obj
from rljax.models import init_params, preset
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, init_train_state, prepare_batch
from rljax.update.loss import aggregation_denominator, microbatch_loss

B, T = 6, 9
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _case(seed=0):
    """Per-token log-probs of the current (logp), proximal (prox) and behaviour (mu) policies; mu is
    -inf on padding, as a sampler's buffers may be. Row 5 is empty."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T))
    for i in range(B - 1):
        s = rng.integers(0, 3)
        mask[i, s:s + rng.integers(1, T - s + 1)] = 1
    prox = -rng.random((B, T)) * 3
    logp = prox + rng.normal(scale=0.3, size=(B, T))
    mu = np.where(mask > 0, prox + rng.normal(scale=0.6, size=(B, T)), -np.inf)
    adv = np.repeat(rng.normal(size=(B, 1)), T, 1) * mask
    adv[0] = rng.normal(size=T) * mask[0]
    return logp, prox, mu, adv, mask


def np_areal(logp, prox, mu, adv, mask, cap, level):
    """AReaL's objective written from the paper (Fu et al., 2025, eq. 5) and its cap rule:
    L = -sum_t m_t w_t min(u_t A_t, clip(u_t, 1 - el, 1 + eh) A_t) / sum_t m_t, u = pi/pi_prox,
    w = pi_prox/mu set to 0 above `cap` (the token stays in the denominator). Returns L and dL/dlogp:
    d/dlogp of min(uA, clip(u)A) is u A where the unclipped term is the min, else 0."""
    log_w = np.where(mask > 0, prox - np.where(mask > 0, mu, 0.0), 0.0)
    if level == "sequence":
        log_w = np.repeat(log_w.sum(1, keepdims=True), T, 1)
    w = np.where(np.exp(log_w) <= cap, np.exp(log_w), 0.0)
    u = np.exp(logp - prox)
    unclipped, clipped = u * adv, np.clip(u, 1 - EPS_LOW, 1 + EPS_HIGH) * adv
    den = mask.sum()
    loss = -np.sum(mask * w * np.minimum(unclipped, clipped)) / den
    grad = -mask * w * np.where(unclipped <= clipped, u * adv, 0.0) / den
    return loss, grad, w


def _jax_loss(logp, prox, mu, adv, mask, cap, level):
    w, kept = obj.OFF_POLICY.get("decoupled")(prox, mu, mask, cap=cap, level=level)
    per, _ = obj.POLICY_LOSSES.get("ppo_clip")(logp, prox, adv, kept, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    return obj.aggregate(per * w, kept, "token-mean"), (w, kept)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_decoupled_matches_numpy_areal_value_gradient_and_cap(level):
    """Loss and gradient w.r.t. logp equal the NumPy AReaL objective (f32 rounding only), uncapped
    (cap = inf) and with cap 1.5, which zeroes some tokens' weights (or whole rows, sequence level)
    while they stay in the denominator; the cap changes the loss. Catches a weight of mu/pi_prox
    (inverted), TIS-style truncation to the cap instead of zero, dropping capped tokens from the
    mask (MIS), a weight that carries gradient, and NaN from -inf padding."""
    logp, prox, mu, adv, mask = _case(1 if level == "token" else 2)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    losses = {}
    for cap in (np.inf, 1.5):
        (value, (w, kept)), g = jax.value_and_grad(_jax_loss, has_aux=True)(
            f32(logp), f32(prox), f32(mu), f32(adv), f32(mask), cap, level)
        ref, ref_g, ref_w = np_areal(logp, prox, mu, adv, mask, cap, level)
        np.testing.assert_allclose(float(value), ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(g), ref_g, rtol=1e-5, atol=1e-7)
        on = mask > 0
        np.testing.assert_allclose(np.asarray(w)[on], ref_w[on], rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(kept), mask)  # capped tokens keep their place
        losses[cap] = float(value)
        if cap == 1.5:
            zeroed = on & (ref_w == 0)
            assert 0 < zeroed.sum() < on.sum()  # the cap binds on some tokens, not all
    assert abs(losses[1.5] - losses[np.inf]) > 1e-3


CFG = preset("qwen2-test")


def _batch(seed=0, b=4, t=10, prompt=4):
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, CFG.vocab_size, (b, t))
    attn = np.ones((b, t), bool)
    attn[0, :2] = False  # left padding
    loss = np.zeros((b, t), bool)
    for i in range(b):
        loss[i, prompt:prompt + rng.integers(2, t - prompt + 1)] = True
    return RolloutBatch(tokens_bt=jnp.asarray(np.where(attn, toks, 0)), attn_mask_bt=jnp.asarray(attn),
                        loss_mask_bt=jnp.asarray(loss), sampler_logp_bt=jnp.zeros((b, t), jnp.float32),
                        rewards_b=jnp.asarray(rng.integers(0, 2, b).astype(np.float32)),
                        group_ids_b=obj.prompt_major_group_ids(b, 2), completion_len=t - prompt)


@jax.jit
def _prepare_loss_and_grads(state, batch):
    """prepare_batch, then the loss and gradients of the whole batch as one micro-batch."""
    prepared, _ = prepare_batch(state, batch)
    norm_length = batch.completion_len
    den = aggregation_denominator(prepared, state.algo, norm_length)
    loss_grads = jax.value_and_grad(microbatch_loss, has_aux=True)(
        state.trainable, prepared, den, cfg=CFG, algo=state.algo, update_cfg=state.update_cfg,
        norm_length=norm_length)
    return prepared, loss_grads


def test_decoupled_with_proximal_equal_to_behaviour_is_bitwise_ppo_clip():
    """Through `prepare_batch` + `microbatch_loss` on a tiny model: when the sampler's log-probs are
    the proximal policy's own, the decoupled run (recompute_old_logp) gives the plain PPO clip run
    (no recompute, old log-probs = the sampler's) bitwise: weight exactly 1, same mask, same loss and
    gradients. With stale behaviour log-probs, prepare_batch's weight is pi_prox/mu zeroed above the
    cap and the loss mask is unchanged. Catches a weight that is not exactly 1 at mu = pi_prox (a
    clamp or an epsilon), a registry entry that edits the mask, and prepare_batch passing the
    arguments in the wrong order (mu/pi_prox)."""
    params = init_params(CFG, jax.random.key(0))
    opt = OptimConfig(learning_rate=1e-3)
    decoupled = init_train_state(CFG, params, obj.AlgorithmConfig(
        algorithm="dapo", recompute_old_logp=True, off_policy="decoupled", off_policy_cap=3.0), opt)
    plain = init_train_state(CFG, params, obj.AlgorithmConfig(algorithm="dapo"), opt)
    batch = _batch()
    prox = _prepare_loss_and_grads(decoupled, batch)[0].old_logp_bt  # pi_prox, as prepare_batch scores it
    on_policy = batch.replace(sampler_logp_bt=jnp.where(batch.loss_mask_bt, prox, 0.0))
    prep_d, ((loss_d, _), grads_d) = _prepare_loss_and_grads(decoupled, on_policy)
    prep_p, ((loss_p, _), grads_p) = _prepare_loss_and_grads(plain, on_policy)
    assert np.all(np.asarray(prep_d.is_weight_bt) == 1.0)
    np.testing.assert_array_equal(np.asarray(prep_d.loss_mask_bt), np.asarray(prep_p.loss_mask_bt))
    assert float(loss_d) == float(loss_p) and float(loss_p) != 0.0
    for a, b in zip(jax.tree.leaves(grads_d), jax.tree.leaves(grads_p)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    rng = np.random.default_rng(3)
    mask = np.asarray(batch.loss_mask_bt)
    stale_mu = np.where(mask, np.asarray(prox) + rng.normal(scale=0.8, size=mask.shape), 0.0).astype(np.float32)
    prep_s, _ = _prepare_loss_and_grads(decoupled, batch.replace(sampler_logp_bt=jnp.asarray(stale_mu)))
    w_ref = np.exp(np.asarray(prox, np.float64) - stale_mu)
    w_ref = np.where(w_ref <= 3.0, w_ref, 0.0)
    np.testing.assert_allclose(np.asarray(prep_s.is_weight_bt)[mask], w_ref[mask], rtol=1e-5)
    assert (w_ref[mask] == 0).any() and (w_ref[mask] > 1.2).any()
    np.testing.assert_array_equal(np.asarray(prep_s.loss_mask_bt), mask.astype(np.float32))
