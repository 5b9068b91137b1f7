"""On-policy distillation (issue 41): the teacher's grades, the two objectives against float64
NumPy written from the papers and against TRL's GKD loss, the frozen teacher, and the mixed
objective's two end points."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models.setup import build_teacher, policy_config
from rljax.errors import ConfigError
from rljax.models import forward, init_params, preset, token_logprobs
from rljax.models.auxiliary import FrozenModel
from rljax.models.divergence import fused_generalized_jsd, generalized_jsd
from rljax.models.scoring import teacher_scores
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.objectives.distill import reverse_kl_advantages
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, prepare_batch, update_step

CFG = preset("qwen2-test")  # the student: 2 layers of width 64
# The teacher: deeper and wider, one vocabulary.
TEACHER_CFG = preset("qwen2-test", hidden_size=96, intermediate_size=160, num_layers=3, num_heads=6, head_dim=16)
PROMPT = 5


def _teacher(seed=7):
    return FrozenModel(TEACHER_CFG, init_params(TEACHER_CFG, jax.random.key(seed)))


def _batch(seed, b=8, t=12, rewards=None, cfg=CFG, params=None):
    """Left-padded prompts, ragged completions, on-policy sampler log-probs of the student."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, (b, t))
    attn = np.ones((b, t), bool)
    loss = np.zeros((b, t), bool)
    for i in range(b):
        attn[i, :rng.integers(0, 3)] = False
        n = rng.integers(1, t - PROMPT + 1)
        loss[i, PROMPT:PROMPT + n] = True
        attn[i, PROMPT + n:] = False
    toks = np.where(attn, toks, 0)
    params = init_params(cfg, jax.random.key(0)) if params is None else params
    logp, _ = token_logprobs(cfg, params, jnp.asarray(toks), jnp.asarray(attn))
    rewards = rng.integers(0, 2, b).astype(np.float32) if rewards is None else rewards
    return RolloutBatch(tokens_bt=jnp.asarray(toks), attn_mask_bt=jnp.asarray(attn), loss_mask_bt=jnp.asarray(loss),
                        sampler_logp_bt=jnp.where(jnp.asarray(loss), logp, 0.0), rewards_b=jnp.asarray(rewards),
                        group_ids_b=prompt_major_group_ids(b, 4), completion_len=t - PROMPT)


def _sampled_reverse_kl(batch, teacher):
    """mean over completion tokens of log pi_S - log pi_T (the sampler's and the teacher's own)."""
    t_logp, _ = token_logprobs(teacher.cfg, teacher.params, batch.tokens_bt, batch.attn_mask_bt)
    m = np.asarray(batch.loss_mask_bt)
    return float(np.mean((np.asarray(batch.sampler_logp_bt, np.float64) - np.asarray(t_logp, np.float64))[m]))


def _state(algo, teacher=None, **kw):
    return init_train_state(CFG, init_params(CFG, jax.random.key(0)), algo, OptimConfig(learning_rate=1e-3),
                            key=jax.random.key(1), teacher=teacher, **kw)


# ----------------------------------------------------------------------------- NumPy references


def _np_reverse_kl_adv(student, teacher, mask, gamma):
    """A_t = sum_{k >= t, masked} gamma^(k - t) (lT - lS)_k, written as a double loop."""
    b, t = student.shape
    r = (teacher - student) * mask
    out = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            power = 0
            for k in range(j, t):
                if mask[i, k]:
                    out[i, j] += gamma ** power * r[i, k]
                    power += 1
    return out


def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _np_gjsd(zs, zt, beta):
    """GKD eq. 1 per position, and its gradient in the student's logits (float64).

    J = beta KL(T || M) + (1 - beta) KL(S || M), M = beta T + (1 - beta) S, which is
    beta sum t log t + (1 - beta) sum s log s - sum m log m; dJ/ds_v = (1 - beta)(log s_v - log m_v),
    and through the softmax dJ/dz_v = s_v (g_v - sum_u s_u g_u). The end points are TRL's:
    beta = 0 is KL(T || S) (dJ/dz = s - t), beta = 1 is KL(S || T) (dJ/dz = s (ls - lt - J))."""
    ls, lt = _np_log_softmax(zs), _np_log_softmax(zt)
    s, t = np.exp(ls), np.exp(lt)
    if beta == 0:
        j = (t * (lt - ls)).sum(-1)
        return j, s - t
    if beta == 1:
        j = (s * (ls - lt)).sum(-1)
        return j, s * (ls - lt - j[..., None])
    m = beta * t + (1 - beta) * s
    lm = np.log(m)
    j = beta * (t * (lt - lm)).sum(-1) + (1 - beta) * (s * (ls - lm)).sum(-1)
    g = (1 - beta) * (ls - lm)
    return j, s * (g - (s * g).sum(-1, keepdims=True))


# ----------------------------------------------------------------------------- the objectives


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_reverse_kl_advantages_match_numpy(gamma):
    """Catches a flipped sign (student - teacher), a grade leaking onto prompt or padding
    columns, and a discount that runs over unmasked columns or forwards in time."""
    rng = np.random.default_rng(0)
    student, teacher = rng.normal(size=(2, 4, 9)) - 2.0
    mask = np.zeros((4, 9), bool)
    mask[:, 3:8] = True
    mask[1, 5] = False  # a dropped token inside a completion (an off-policy correction's)
    mask[2, 3:] = False  # an empty row
    got = reverse_kl_advantages(jnp.asarray(student, jnp.float32), jnp.asarray(teacher, jnp.float32),
                                jnp.asarray(mask), discount=gamma)
    np.testing.assert_allclose(np.asarray(got), _np_reverse_kl_adv(student, teacher, mask, gamma), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_gjsd_and_its_gradient_match_numpy(beta):
    """The dense formula and the fused one (time chunks of 2, vocabulary chunks of 8 over 37 ids,
    so the last chunk is padded) against float64 NumPy: the divergence per position, and the
    gradient of a weighted sum of it in the student's hidden states and output embedding (chained
    from dJ/dz by hand). Catches swapped beta weights or KL directions, a mixture weighted the
    wrong way, padded vocabulary rows counted, a gradient reaching the teacher or lost through the
    student's logsumexp (the fused form's first pass), and chunks misaligned in time."""
    rng = np.random.default_rng(1)
    b, t, d_s, d_t, v = 2, 5, 8, 12, 37
    h_s, w_s = rng.normal(size=(b, t, d_s)), rng.normal(size=(v, d_s)) * 0.5
    h_t, w_t = rng.normal(size=(b, t, d_t)), rng.normal(size=(v, d_t)) * 0.5
    weights = rng.uniform(0.5, 1.5, size=(b, t))
    want, dz = _np_gjsd(h_s @ w_s.T, h_t @ w_t.T, beta)
    dz = dz * weights[..., None]
    want_dh, want_dw = dz @ w_s, np.einsum("btv,btd->vd", dz, h_s)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    forms = {
        "dense": lambda hs, ws: generalized_jsd(hs @ ws.T, f32(h_t) @ f32(w_t).T, beta=beta),
        "fused": lambda hs, ws: fused_generalized_jsd(hs, ws, f32(h_t), f32(w_t), beta=beta, time_chunk=2,
                                                      vocab_chunk=8),
    }
    assert want.max() > 0.05  # a divergence well above the tolerance
    for name, fn in forms.items():
        np.testing.assert_allclose(np.asarray(fn(f32(h_s), f32(w_s))), want, rtol=2e-5, atol=2e-6, err_msg=name)
        dh, dw = jax.grad(lambda hs, ws: jnp.sum(fn(hs, ws) * f32(weights)), argnums=(0, 1))(f32(h_s), f32(w_s))
        np.testing.assert_allclose(np.asarray(dh), want_dh, rtol=1e-4, atol=2e-6, err_msg=name)
        np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gjsd_equals_trl_gkd_loss(beta):
    """TRL's `GKDTrainer.generalized_jsd_loss` (reduction batchmean over labels != -100) and its
    autograd gradient in the student's logits, on the same logits. Catches a disagreement with the
    field's reference on the end-point conventions (beta = 0 forward KL, 1 reverse KL), the
    mixture's weighting, and the token-mean reduction."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    import os
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    rng = np.random.default_rng(2)
    b, t, v = 3, 6, 23
    zs, zt = rng.normal(size=(2, b, t, v)) * 2.0
    mask = rng.uniform(size=(b, t)) < 0.7
    labels = np.where(mask, 1, -100)
    zs_torch = torch.tensor(zs, dtype=torch.float64, requires_grad=True)
    trl_loss = GKDTrainer.generalized_jsd_loss(zs_torch, torch.tensor(zt, dtype=torch.float64),
                                               labels=torch.tensor(labels), beta=beta)
    trl_loss.backward()

    def ours(z):
        jsd = generalized_jsd(z, jnp.asarray(zt, jnp.float32), beta=beta)
        return jnp.sum(jnp.where(jnp.asarray(mask), jsd, 0.0)) / np.sum(mask)

    loss, grad = jax.value_and_grad(ours)(jnp.asarray(zs, jnp.float32))
    np.testing.assert_allclose(float(loss), trl_loss.item(), rtol=2e-6)
    np.testing.assert_allclose(np.asarray(grad), zs_torch.grad.numpy(), rtol=1e-4, atol=1e-7)


def test_teacher_scores_grade_each_sampled_token():
    """The teacher's log-prob and top-1 flag of each token against its full logits (`forward`),
    with vocabulary chunks. Catches a grade shifted by one column (the prediction of token t comes
    from position t - 1) and a top-1 read from the wrong chunk."""
    teacher = _teacher()
    batch = _batch(0)
    # Make some tokens the teacher's own argmax, so both outcomes of the top-1 flag occur.
    logits = forward(TEACHER_CFG, teacher.params, batch.tokens_bt, attn_mask_bt=batch.attn_mask_bt)[0]
    toks = np.asarray(batch.tokens_bt).copy()
    toks[:, 6] = np.asarray(jnp.argmax(logits[:, 5], axis=-1))
    toks = jnp.asarray(toks)
    logp, top1 = teacher_scores(TEACHER_CFG, teacher.params, toks, batch.attn_mask_bt, chunk_size=3, vocab_chunk=40)
    logits = np.asarray(forward(TEACHER_CFG, teacher.params, toks, attn_mask_bt=batch.attn_mask_bt)[0], np.float64)
    lsm = _np_log_softmax(logits[:, :-1])
    want = np.take_along_axis(lsm, np.asarray(toks)[:, 1:, None], -1)[..., 0]
    attn = np.asarray(batch.attn_mask_bt)
    real = attn[:, 1:] & attn[:, :-1]
    np.testing.assert_allclose(np.asarray(logp)[:, 1:][real], want[real], rtol=1e-5, atol=1e-5)
    want_top1 = np.asarray(toks)[:, 1:] == lsm.argmax(-1)
    np.testing.assert_array_equal(np.asarray(top1)[:, 1:][real], want_top1[real])
    assert want_top1[real].any() and not want_top1[real].all()


# ----------------------------------------------------------------------------- in the update


def test_teacher_stays_frozen_and_holds_no_optimiser_state():
    """Two on-policy distillation updates: the student moves, the teacher's params are bitwise
    what they were, and the optimiser state is exactly a teacher-less state's (no teacher-shaped
    moments). Catches a teacher inside `trainable` or a gradient reaching it."""
    teacher = _teacher()
    before = jax.tree.map(np.array, teacher.params)
    state = _state(AlgorithmConfig(algorithm="opd"), teacher=teacher)
    plain = _state(AlgorithmConfig(algorithm="grpo", kl_coef=0.0))
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(plain.opt_state)
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == sum(x.size for x in jax.tree.leaves(plain.opt_state))
    p0 = np.asarray(state.params["embed"]).copy()
    for seed in (0, 1):
        state, metrics = update_step(state, _batch(seed), jax.random.key(seed))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.teacher.params), before)
    assert not np.array_equal(np.asarray(state.params["embed"]), p0)
    for name in ("distill/reverse_kl", "distill/teacher_logp", "distill/teacher_top1_match"):
        assert np.isfinite(float(metrics[name])), name
    np.testing.assert_allclose(float(metrics["distill/reverse_kl"]), _sampled_reverse_kl(_batch(1), state.teacher),
                               rtol=1e-4, atol=1e-6)


def test_distill_coef_zero_is_plain_rl_bitwise():
    """GRPO with a teacher at lambda = 0 updates the params bitwise as GRPO alone. Catches a
    distillation term that leaks into the advantages (or their normalisation) at weight 0."""
    batch = _batch(0)
    teacher = _teacher()
    plain, _ = update_step(_state(AlgorithmConfig(kl_coef=0.0)), batch, jax.random.key(0))
    mixed, m = update_step(_state(AlgorithmConfig(kl_coef=0.0, distill="reverse_kl", distill_coef=0.0),
                                  teacher=teacher), batch, jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, mixed.params),
                 jax.tree.map(np.asarray, plain.params))
    # The teacher was scored (its grades differ from the student's) and weighed nothing.
    np.testing.assert_allclose(float(m["distill/reverse_kl"]), _sampled_reverse_kl(batch, mixed.teacher), rtol=1e-4)
    assert abs(float(m["distill/reverse_kl"])) > 1e-3


def test_reward_weight_zero_is_pure_distillation():
    """With reward_weight = 0 the advantages are lambda x (log pi_T - log pi_S) on the completion
    tokens (NumPy from the teacher's own log-probs), and the update does not depend on the rewards
    at all: two batches that differ only in their rewards give bitwise the same params. Catches
    RL advantages leaking in at weight 0, and a wrong coefficient or sign."""
    teacher = _teacher()
    algo = AlgorithmConfig(kl_coef=0.0, distill="reverse_kl", reward_weight=0.0, distill_coef=0.7)
    batch = _batch(0, rewards=np.array([1, 0, 0, 1, 1, 1, 0, 0], np.float32))
    prepared, _ = prepare_batch(_state(algo, teacher=teacher), batch)
    t_logp, _ = token_logprobs(TEACHER_CFG, teacher.params, batch.tokens_bt, batch.attn_mask_bt)
    mask = np.asarray(batch.loss_mask_bt)
    want = 0.7 * (np.asarray(t_logp, np.float64) - np.asarray(batch.sampler_logp_bt, np.float64)) * mask
    np.testing.assert_allclose(np.asarray(prepared.advantages_bt), want, rtol=1e-5, atol=1e-5)
    other = dataclasses.replace(batch, rewards_b=jnp.asarray([0, 1, 1, 0, 0, 1, 1, 0], jnp.float32))
    # (update_step donates the state, the teacher's buffers with it: each state gets its own copy)
    a, _ = update_step(_state(algo, teacher=_teacher()), batch, jax.random.key(0))
    b, _ = update_step(_state(algo, teacher=_teacher()), other, jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a.params), jax.tree.map(np.asarray, b.params))


def test_gkd_loss_in_the_update_and_it_learns():
    """The `gkd` preset: the update's `loss/distill` equals the token mean of GJSD computed from
    both models' full logits (`forward`) at the params that sampled, and a few updates on one
    batch bring the student closer to the teacher. Catches the loss reading the wrong hidden
    states (misaligned rows after the micro-batch split) and a gradient of the wrong sign."""
    teacher = _teacher()
    algo = AlgorithmConfig(algorithm="gkd", distill_beta=0.5)
    state = _state(algo, teacher=teacher, update_cfg=UpdateConfig(num_microbatches=2))
    batch = _batch(0)
    zs = forward(CFG, state.params, batch.tokens_bt, attn_mask_bt=batch.attn_mask_bt)[0]
    zt = forward(TEACHER_CFG, teacher.params, batch.tokens_bt, attn_mask_bt=batch.attn_mask_bt)[0]
    jsd, _ = _np_gjsd(np.asarray(zs, np.float64)[:, :-1], np.asarray(zt, np.float64)[:, :-1], 0.5)
    mask = np.asarray(batch.loss_mask_bt)[:, 1:]
    want = float(jsd[mask].mean())
    losses = []
    for i in range(6):
        state, metrics = update_step(state, batch, jax.random.key(i))
        losses.append(float(metrics["loss/distill"]))
    np.testing.assert_allclose(losses[0], want, rtol=1e-4)
    assert losses[-1] < 0.8 * losses[0], losses
    assert float(metrics["loss/policy"]) == 0.0  # reward_weight = 0: no policy-gradient signal


def test_lora_student_distils_with_a_frozen_base():
    """A LoRA student: only the adapters move; base and teacher stay bitwise."""
    from rljax.lora import LoraConfig

    teacher = _teacher()
    before = jax.tree.map(np.array, teacher.params)
    state = _state(AlgorithmConfig(algorithm="opd"), teacher=teacher, lora=LoraConfig(rank=4))
    base = jax.tree.map(np.array, state.params)
    a0 = jax.tree.map(np.array, state.adapters)
    state, metrics = update_step(state, _batch(0), jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), base)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.teacher.params), before)
    moved = jax.tree.leaves(jax.tree.map(lambda x, y: not np.array_equal(np.asarray(x), y), state.adapters, a0))
    assert any(moved) and np.isfinite(float(metrics["distill/reverse_kl"]))


def test_refusals_are_one_line():
    """A teacher of another vocabulary, a distilling objective without a teacher, and reward
    weights without distillation each fail with one line naming the fix."""
    other = FrozenModel(preset("qwen2-test", vocab_size=130), None)
    with pytest.raises(ConfigError, match="vocabulary has 130 ids"):
        _state(AlgorithmConfig(algorithm="opd"), teacher=other)
    with pytest.raises(ConfigError, match="teacher"):
        _state(AlgorithmConfig(algorithm="opd"))
    with pytest.raises(ConfigError, match="reward_weight"):
        AlgorithmConfig(reward_weight=0.5)
    with pytest.raises(ConfigError, match="distill_discount"):
        AlgorithmConfig(algorithm="gkd", distill_discount=0.9)


# ----------------------------------------------------------------------------- in a run

TINY_RUN = [
    "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
    "model.num_kv_heads=1", "model.head_dim=32", "data.size=300", "data.eval_size=20", "eval.size=20",
    "warm_start.steps=0", "rl.prompts_per_iteration=8", "sampling.num_samples=4", "rl.iterations=2",
    "eval.every=100", "checkpoint.every=100", "metrics.tensorboard=false", "metrics.progress_bar=false",
    "mesh.devices=1",
]


def _teacher_dir(tmp_path, alphabet="0123456789+-= "):
    """A teacher deeper and wider than TINY_RUN's policy, saved as a HF directory with a tokenizer."""
    from rljax.models import save_hf
    from rljax.tokenizers import load as load_tokenizer
    from rljax.train.config import load_config

    tok = load_tokenizer(f"chars:{alphabet}")
    policy = policy_config(load_config(None, TINY_RUN).model, tok)
    tcfg = dataclasses.replace(policy, hidden_size=96, intermediate_size=192, num_layers=3, num_heads=3)
    path = tmp_path / f"teacher_{len(alphabet)}_{alphabet[0]}"
    save_hf(tcfg, init_params(tcfg, jax.random.key(3)), path)
    tok.save(path)
    return path


def test_a_run_distils_from_a_teacher_checkpoint_and_plan_counts_it(tmp_path):
    """`rljax train` with algorithm=opd and a teacher directory: two fused iterations report
    finite distillation metrics, the teacher held by the final state is the checkpoint's, and
    `rljax plan`'s state memory counts its bytes exactly (the plan test's style)."""
    from rljax.models import load_hf
    from rljax.plan.memory import state_memory
    from rljax.train.config import load_config
    from rljax.train.loop import train

    teacher = _teacher_dir(tmp_path)
    cfg = load_config(None, TINY_RUN + ["algorithm.algorithm=opd", f"teacher.checkpoint='{teacher}'",
                                        f"output_dir='{tmp_path / 'run'}'"])
    lines = []
    result = train(cfg, log=lines.append)
    assert any(line.startswith("teacher qwen2 ") for line in lines), lines
    rows = [r for r in result.history if "distill/reverse_kl" in r]
    assert len(rows) == 2
    for name in ("distill/reverse_kl", "distill/teacher_logp", "distill/teacher_top1_match", "loss/policy"):
        assert all(np.isfinite(r[name]) for r in rows), name
    _, loaded = load_hf(teacher)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, result.state.teacher.params),
                 jax.tree.map(np.asarray, loaded))
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(result.state.teacher.params))
    assert state_memory(cfg).teacher_bytes == held > 0


def test_run_config_refusals_are_one_line(tmp_path):
    """A distilling recipe without a teacher, a teacher without distillation, GJSD with packing,
    and a teacher whose tokenizer is not the policy's."""
    from rljax.tokenizers import load as load_tokenizer
    from rljax.train.config import load_config

    with pytest.raises(ConfigError, match="set teacher.checkpoint"):
        load_config(None, TINY_RUN + ["algorithm.algorithm=opd"])
    with pytest.raises(ConfigError, match="algorithm.distill='none'"):
        load_config(None, TINY_RUN + ["teacher.checkpoint='somewhere'"])
    with pytest.raises(ConfigError, match="update.packing=false"):
        load_config(None, TINY_RUN + ["algorithm.algorithm=gkd", "teacher.checkpoint='x'", "update.packing=true"])
    other = _teacher_dir(tmp_path, alphabet="abcdefghij+-= ")  # same size, other symbols
    cfg = load_config(None, TINY_RUN + ["algorithm.algorithm=opd", f"teacher.checkpoint='{other}'"])
    tok = load_tokenizer("chars:0123456789+-= ")
    with pytest.raises(ConfigError, match="tokenizer other than the policy's"):
        build_teacher(cfg.teacher, policy_config(cfg.model, tok), tok, jax.random.key(0))


def test_sharded_teacher_is_placed_like_the_policy_and_updates_as_on_one_device(tmp_path):
    """On 8 devices (fsdp=4 x tensor=2) `build_teacher` streams the teacher into the trainer's
    layout (every leaf in the sharding the policy's path rules give it), and an opd update of the
    sharded state equals the one-device update: the distillation metrics to 1e-5, the params to
    float rounding. Catches a teacher left whole on one device, and a sharded grade that differs
    from the unsharded one (e.g. rows scored against the wrong shard of the teacher)."""
    from rljax import sharding
    from rljax.tokenizers import load as load_tokenizer
    from rljax.train.config import load_config

    layout = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(fsdp=4, tensor=2)))
    cfg = load_config(None, TINY_RUN + ["algorithm.algorithm=opd", f"teacher.checkpoint='{_teacher_dir(tmp_path)}'"])
    tok = load_tokenizer("chars:0123456789+-= ")
    policy_cfg = policy_config(cfg.model, tok)
    params = init_params(policy_cfg, jax.random.key(0))
    batch = _batch(0, cfg=policy_cfg, params=params)
    results = []
    for where in (None, layout):
        teacher = build_teacher(cfg.teacher, policy_cfg, tok, jax.random.key(0), where)
        if where is not None:
            want = jax.tree.leaves(layout.params(teacher.params))
            assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(teacher.params), want))
            assert any(len(x.sharding.device_set) == 8 and x.addressable_shards[0].data.size < x.size
                       for x in jax.tree.leaves(teacher.params))  # split, not replicated
        fresh = init_params(policy_cfg, jax.random.key(0))  # (update_step donates the state)
        state = init_train_state(policy_cfg, fresh, cfg.algorithm, cfg.optim, key=jax.random.key(1), layout=where,
                                 teacher=teacher)
        state, metrics = update_step(state, batch, jax.random.key(0))
        results.append((jax.tree.map(np.asarray, state.params), {k: float(v) for k, v in metrics.items()}))
    (p1, m1), (p8, m8) = results
    for name in ("distill/reverse_kl", "distill/teacher_logp", "distill/teacher_top1_match"):
        np.testing.assert_allclose(m8[name], m1[name], rtol=1e-5, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p8, p1)
