"""Training with LoRA (rljax.lora through rljax.update): only the adapters move and only they have
optimiser state, the frozen base may be bf16 under f32 adapters, the KL reference is the base
with the adapters off (no reference copy), every objective traces, a PPO critic is adapters plus
a head, and the sharded update equals the one-device update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.lora import LoraConfig
from rljax.models import FrozenModel, init_params, preset, token_logprobs
from rljax.objectives import PRESETS, AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.sharding import MeshConfig, make_mesh, trainer_layout
from rljax.update import (RolloutBatch, UpdateConfig, init_train_state, prepare_batch, reset_reference, update,
                          update_step)

CFG = preset("qwen2-test", param_dtype="bfloat16")  # a bf16 base; the adapters are f32
LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=(".*",))  # the tied embedding too
# PPO with a KL term: the objective that needs both a critic and the reference.
PPO_KL = AlgorithmConfig(algorithm="ppo", kl_coef=0.1)
# eps = 1e3 makes Adam's first steps ~ lr * g / eps, linear in the gradient (no sign-of-rounding
# steps), so sharded and one-device adapters compare their gradients.
LINEAR_ADAM = OptimConfig(learning_rate=1.0, eps=1e3, max_grad_norm=None)
SCHEDULE = UpdateConfig(num_minibatches=2)
STEPS = 2


def _batch(seed, b=8, t=12, prompt=5):
    """Left-padded prompts, ragged completions, sampler log-probs near the base's."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, CFG.vocab_size, (b, t))
    attn = np.ones((b, t), bool)
    loss = np.zeros((b, t), bool)
    for i in range(b):
        attn[i, :rng.integers(0, 3)] = False
        n = rng.integers(1, t - prompt + 1)
        loss[i, prompt:prompt + n] = True
        attn[i, prompt + n:] = False
    toks = np.where(attn, toks, 0)
    logp = -np.abs(rng.normal(2.0, 0.5, (b, t))).astype(np.float32)
    return RolloutBatch(tokens_bt=jnp.asarray(toks), attn_mask_bt=jnp.asarray(attn), loss_mask_bt=jnp.asarray(loss),
                        sampler_logp_bt=jnp.asarray(np.where(loss, logp, 0.0)),
                        rewards_b=jnp.asarray(rng.integers(0, 2, b).astype(np.float32)),
                        group_ids_b=prompt_major_group_ids(b, 4), completion_len=t - prompt)


def _state(layout=None, algo=PPO_KL, optim=LINEAR_ADAM, lora=LORA):
    params = init_params(CFG, jax.random.key(0))
    # a distilling preset (opd, gkd) grades with a frozen teacher: one of the student's shape here
    teacher = FrozenModel(CFG, init_params(CFG, jax.random.key(2))) if algo.needs.teacher_logp else None
    return init_train_state(CFG, params, algo, optim, update_cfg=SCHEDULE, key=jax.random.key(1), layout=layout,
                            lora=lora, teacher=teacher)


def _run(state):
    metrics = []
    for i in range(STEPS):
        state, m = update_step(state, _batch(i), jax.random.key(i))
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


@pytest.fixture(scope="module")
def one_device():
    """(state before as host arrays, state after, metrics) of PPO with a KL term, LoRA on every
    weight of a bf16 base, two mini-batches per step, STEPS steps."""
    state = _state()
    before = jax.tree.map(np.asarray, state)
    state, metrics = _run(state)
    return before, state, metrics


def test_only_adapters_move_and_hold_optimiser_state(one_device):
    """After STEPS PPO updates with a KL term, the bf16 base is bitwise unchanged and still bf16;
    the trainable leaves (policy adapters, the critic's adapters and head) are f32 and the
    zero-initialised side of each adapter moved (B; the embedding's A), as did the critic's head;
    the optimiser state holds exactly two moments per trainable leaf (Adam's mu, nu) plus scalar
    counters, nothing shaped like a base weight, and no reference copy exists.
    Catches: gradients or Adam moments over the base (a full fine-tune), a base upcast to f32,
    a critic that copies the backbone, or a reference copy kept for the KL term."""
    before, state, metrics = one_device
    assert all(np.isfinite(v) for m in metrics for v in m.values()) and metrics[-1]["loss/value"] > 0
    for old, new in zip(jax.tree.leaves(before.params), jax.tree.leaves(state.params), strict=True):
        assert new.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(new), old)
    assert set(state.value_params) == {"adapters", "value_head", "value_bias"}
    trainable_before = jax.tree.leaves((before.adapters, before.value_params))
    trainable = jax.tree.leaves(state.trainable)
    for old, new in zip(trainable_before, trainable, strict=True):
        assert new.dtype == jnp.float32
        if old.ndim and not old.any():  # zero at init: takes the first gradient
            assert np.abs(np.asarray(new)).max() > 0
    moments = sorted(x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == sorted([x.shape for x in trainable if x.ndim] * 2)
    base_shapes = {x.shape for x in jax.tree.leaves(state.params) if x.ndim > 1}  # weights ([D] is the head's too)
    assert state.ref_params is None and not base_shapes & {x.shape for x in jax.tree.leaves(state.opt_state)}
    with pytest.raises(ConfigError, match="cannot be reset"):
        reset_reference(state)


def test_reference_logprobs_are_the_base_models():
    """With a KL term, `prepare_batch` scores the reference with the base params, adapters off:
    its ref log-probs equal `token_logprobs` of the bare base (1e-6), while the adapted policy's
    differ from them by far more (random adapters, B != 0). Catches: a reference that runs the
    adapters (KL identically 0) or one scored from a stale copy."""
    state = _state()
    adapters = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(x.size), x.shape), state.adapters)
    state = state.replace(adapters=adapters)
    batch = _batch(5)

    @jax.jit
    def logps(state):
        score = lambda p: token_logprobs(CFG, p, batch.tokens_bt, batch.attn_mask_bt)[0]  # noqa: E731
        return prepare_batch(state, batch)[0].ref_logp_bt, score(state.params), score(state.models()[0])

    mask = np.asarray(batch.loss_mask_bt)
    ref_logp, base_logp, policy_logp = (np.asarray(x)[mask] for x in logps(state))
    np.testing.assert_allclose(ref_logp, base_logp, atol=1e-6, rtol=0)
    assert np.abs(policy_logp - base_logp).max() > 0.1


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_objective_traces_with_adapters_only(name):
    """Every preset's update traces with LoRA (abstractly: `jax.eval_shape`, no compile): the new
    state keeps the base's and adapters' shapes, never makes a reference copy, and a critic, when
    the objective has one, is adapters plus a scalar head on the frozen base. Catches: an
    objective whose needs (values, reference, greedy baseline) read the base as trainable or
    build a full-size critic or reference."""
    algo = AlgorithmConfig(algorithm=name)
    state = jax.eval_shape(lambda: _state(algo=algo, optim=OptimConfig()))
    batch = _batch(0)
    if algo.needs.greedy_baseline:
        batch = batch.replace(baseline_rewards_b=jnp.zeros_like(batch.rewards_b))
    new, metrics = jax.eval_shape(update, state, batch, jax.random.key(0))
    assert jax.tree.structure(new.adapters) == jax.tree.structure(state.adapters)
    assert new.ref_params is None and "loss/policy" in metrics
    if algo.needs.teacher_logp:  # the teacher passes through untouched, as abstract as it came
        assert jax.tree.structure(new.teacher) == jax.tree.structure(state.teacher)
    if algo.needs.values:
        assert set(new.value_params) == {"adapters", "value_head", "value_bias"}
        assert new.value_params["value_head"].shape == (CFG.hidden_size,)
    else:
        assert new.value_params is None


def test_sharded_update_equals_one_device(one_device):
    """The same run on data=2 x fsdp=2 x tensor=2: adapters are born in the layout their rules give
    (q's B split over heads on tensor, as q is), keep it through the update, and end equal to the
    one-device run's (Adam linear in the gradient, so this compares gradients) within 1e-5, the
    base bitwise. Catches: adapter rules that shard the stacked layer axis or leave tensor-parallel
    adapters misaligned with their weight, or a sharded LoRA backward that differs."""
    _, want, want_metrics = one_device
    layout = trainer_layout(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    state = _state(layout)
    q_b = state.adapters["layers"]["q"]["lora_b"]  # [L, r, N, H]
    assert q_b.sharding.spec[0] is None and q_b.sharding.spec[2] == "tensor"
    state, metrics = _run(state)
    assert state.adapters["layers"]["q"]["lora_b"].sharding.is_equivalent_to(q_b.sharding, q_b.ndim)
    np.testing.assert_allclose(metrics[-1]["loss/policy"], want_metrics[-1]["loss/policy"], atol=1e-5)
    for got, ref in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(want.trainable), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
    for got, ref in zip(jax.tree.leaves(state.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
