"""Routing replay (`algorithm.routing_replay = "rollout"`, R3): the static sampler records every
token's experts per layer, the rollout carries the record in the `RolloutBatch`, and every trainer
forward of those tokens (old and reference log-probs, the update, packed or not) computes each
token with them, the gates still from the trainer's router.

The model: 2 MoE layers of 4 experts, top-2, hidden 32, vocabulary 64. The near-tie variant gives
every expert's router column the same large part plus 1% of its own, so a bf16 sampler and an f32
trainer rank the experts differently on a share of the tokens."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.models as M
from rljax.errors import ConfigError
from rljax.models.moe_config import MoEConfig
from rljax.models.transformer import hidden_states_and_routes
from rljax.objectives import AlgorithmConfig
from rljax.optim import OptimConfig
from rljax.rewards.base import Rewards
from rljax.envs import ENV
from rljax.envs.config import EnvConfig
from rljax.sampling import SampleControls, sample
from rljax.sampling import multiturn as MT
from rljax.stages.episodes import episodes_to_batch
from rljax.stages.rollout import rollout
from rljax.train.config import load_config
from rljax.update import init_train_state, prepare_batch
from rljax.update.batch import replayed_routes
from rljax.update.loss import aggregation_denominator, microbatch_loss
from rljax.update.packing import Slab, pack_rows

CFG = M.preset("qwen2-test", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8,
               moe=MoEConfig(num_experts=4, top_k=2, expert_size=32))
BF16 = CFG.replace(compute_dtype="bfloat16")
G, P, N, SAMPLES = 4, 8, 8, 2
CONTROLS = SampleControls(max_new_tokens=N, num_samples=SAMPLES, eos_ids=(3,), pad_id=0, decode_phases=1)
REPLAY = AlgorithmConfig(algorithm="grpo", kl_coef=0.0, recompute_old_logp=True, routing_replay="rollout")
OFF = REPLAY.replace(routing_replay="off")


def _params(near_tie: bool):
    params = M.init_params(CFG, jax.random.key(0), std=0.3)
    if near_tie:
        r = params["layers"]["router"]
        params["layers"]["router"] = r[..., :1] + 0.01 * r
    return params


def _prompts():
    rng = np.random.default_rng(0)
    mask = np.ones((G, P), bool)
    mask[1, :3] = False  # left padding
    mask[3, :5] = False
    return jnp.asarray(np.where(mask, rng.integers(4, CFG.vocab_size, (G, P)), 0), jnp.int32), jnp.asarray(mask)


def _reward(tokens_bt, mask_bt, index_b):
    total = ((tokens_bt[:, 0] % 2) == 0).astype(jnp.float32) * mask_bt[:, 0]
    return Rewards(total, {"even": total}, jnp.zeros(total.shape, bool))


@functools.cache
def _batch(near_tie: bool, sampler_dtype: str):
    """One rollout of G prompts x 2 samples with the record (`needs.routes`), by a sampler in
    `sampler_dtype` compute."""
    cfg = BF16 if sampler_dtype == "bfloat16" else CFG
    tokens, mask = _prompts()
    run = jax.jit(lambda p, k: rollout(cfg, p, tokens, mask, jnp.arange(G), k, controls=CONTROLS,
                                       reward_callback=_reward, num_groups=G, needs=REPLAY.needs)[0])
    return run(_params(near_tie), jax.random.key(1))


def _state(algo, near_tie=False):
    return init_train_state(CFG, _params(near_tie), algo, OptimConfig(learning_rate=1e-2))


_prepare = jax.jit(prepare_batch)


@jax.jit
def _routing(params, batch):
    """The f32 trainer's routing of the batch's tokens: (own, replaying the batch's record)."""
    def run(routes):
        return hidden_states_and_routes(CFG, params, batch.tokens_bt, attn_mask_bt=batch.attn_mask_bt,
                                        routes_lbtk=routes)[1]
    return run(None), run(replayed_routes(batch.routes_btlk))


def test_sampler_records_the_teacher_forced_routes():
    """f32: the record equals an independent teacher-forced forward's own top-k (same experts, same
    order) at every prompt and completion token it covers, in int8 [B, T, L, k]; it covers every
    real token but possibly a row's last (never fed back; it scores nothing) and is -1 on padding."""
    batch = _batch(False, "float32")
    rec = np.asarray(batch.routes_btlk)
    assert rec.dtype == np.int8 and rec.shape == (*batch.tokens_bt.shape, CFG.num_layers, 2)
    aux, _ = _routing(_params(False), batch)
    own = np.asarray(aux.routes_btk).transpose(1, 2, 0, 3)
    attn = np.asarray(batch.attn_mask_bt)
    covered = rec[..., 0] >= 0
    last = np.zeros_like(attn)
    last[np.arange(attn.shape[0]), attn.shape[1] - 1 - np.argmax(attn[:, ::-1], axis=1)] = True
    assert not covered[~attn].any() and (rec[~attn] == -1).all()
    assert covered[attn & ~last].all()  # every prompt token, every fed completion token
    assert covered[:, :P].sum() == attn[:, :P].sum() * CFG.num_layers  # the prefill's record is whole
    np.testing.assert_array_equal(rec[covered], own[covered])


def test_replay_closes_the_bf16_sampler_f32_trainer_gap():
    """Near-tied routers: the bf16 sampler's record and the f32 trainer's own top-k disagree on a
    share of the token-layers; with replay the trainer computes every covered token with the
    recorded experts, `update/logp_diff_mean` and `_max` (trainer against sampler, over the
    completion tokens, from `prepare_batch`) fall; a completion-only record leaves the gap open."""
    batch = _batch(True, "bfloat16")
    params = _params(True)
    rec = np.asarray(batch.routes_btlk)
    covered = rec[..., 0] >= 0
    own, used = _routing(params, batch)
    same = (np.sort(np.asarray(own.routes_btk).transpose(1, 2, 0, 3), -1) == np.sort(rec, -1)).all(-1)
    disagree = 1.0 - same[covered].mean()
    np.testing.assert_array_equal(np.asarray(used.routes_btk).transpose(1, 2, 0, 3)[covered], rec[covered])
    _, m_off = _prepare(_state(OFF, near_tie=True), batch.replace(routes_btlk=None))
    _, m_on = _prepare(_state(REPLAY, near_tie=True), batch)
    print(f"\nbf16 sampler / f32 trainer, near-tied routers: own routes disagree on {disagree:.1%} of token-layers; "
          f"logp_diff mean {float(m_off['update/logp_diff_mean']):.4f} -> {float(m_on['update/logp_diff_mean']):.4f}, "
          f"max {float(m_off['update/logp_diff_max']):.4f} -> {float(m_on['update/logp_diff_max']):.4f}")
    assert disagree > 0.05
    assert float(m_on["update/logp_diff_mean"]) < 0.2 * float(m_off["update/logp_diff_mean"])
    assert float(m_on["update/logp_diff_max"]) < 0.2 * float(m_off["update/logp_diff_max"])
    # the completion-only record (prompt routes dropped: the trainer's own there) leaves a gap
    prompt_dropped = batch.routes_btlk.at[:, :P].set(-1)
    _, m_part = _prepare(_state(REPLAY, near_tie=True), batch.replace(routes_btlk=prompt_dropped))
    print(f"completion-only record: logp_diff mean {float(m_part['update/logp_diff_mean']):.4f}")
    assert float(m_part["update/logp_diff_mean"]) > 2 * float(m_on["update/logp_diff_mean"])


def test_continuous_scheduler_records_what_the_static_one_does():
    """The continuous scheduler (slot layout, fewer slots than rows, so rows are admitted as
    others end) returns the static scheduler's tokens and the same routing record, prompt and
    completion, on every token both fed (each covers every token but a row's last)."""
    tokens, mask = _prompts()
    controls = CONTROLS.replace(record_routes=True)
    static = jax.jit(lambda p: sample(CFG, p, tokens, mask, jax.random.key(1), controls))(_params(False))
    cont = jax.jit(lambda p: sample(CFG, p, tokens, mask, jax.random.key(1),
                                    controls.replace(scheduler="continuous", slots=3)))(_params(False))
    np.testing.assert_array_equal(np.asarray(cont.tokens), np.asarray(static.tokens))
    np.testing.assert_array_equal(np.asarray(cont.prompt_routes), np.asarray(static.prompt_routes))
    c, st = np.asarray(cont.routes), np.asarray(static.routes)
    covered = c[..., 0] >= 0  # a row's last token is recorded only if a later step fed it
    np.testing.assert_array_equal(c[covered], st[covered])
    fed = np.arange(c.shape[1])[None, :] < np.asarray(static.lengths)[:, None] - 1
    assert covered[fed].all() and (st[..., 0] >= 0)[fed].all()


def test_paged_layout_records_what_the_static_one_does():
    """The paged layout (pages of 4 tokens, a pool so small that rows are preempted and re-run
    from token 0) returns the static scheduler's tokens and routing record, prompt and completion,
    on every token both fed; and the update replaying a paged rollout's record equals the one
    replaying the static rollout's (a layout that wrote a row's experts into another row's record,
    or the wrong column, fails both; the static rollout's batch is the test's shared one)."""
    tokens, mask = _prompts()
    controls = CONTROLS.replace(record_routes=True)
    paged_controls = controls.replace(scheduler="continuous", kv_layout="paged", page_size=4, slots=4,
                                      max_total_tokens=32)
    static = jax.jit(lambda p: sample(CFG, p, tokens, mask, jax.random.key(1), controls))(_params(False))
    paged = jax.jit(lambda p: sample(CFG, p, tokens, mask, jax.random.key(1), paged_controls))(_params(False))
    assert int(paged.preemptions) > 0
    np.testing.assert_array_equal(np.asarray(paged.tokens), np.asarray(static.tokens))
    np.testing.assert_array_equal(np.asarray(paged.prompt_routes), np.asarray(static.prompt_routes))
    pr, st = np.asarray(paged.routes), np.asarray(static.routes)
    covered = pr[..., 0] >= 0
    fed = np.arange(pr.shape[1])[None, :] < np.asarray(static.lengths)[:, None] - 1
    assert covered[fed].all()
    np.testing.assert_array_equal(pr[covered], st[covered])
    # the update replaying the paged record (as the rollout lays it out: prompt, then completion)
    # equals the one replaying the static rollout's, under a shifted record (which moves log-probs)
    b_static = _batch(False, "float32")
    paged_rec = jnp.concatenate([paged.prompt_routes, paged.routes], axis=1)
    shift = lambda r: jnp.where(r >= 0, (r + 1) % 4, r).astype(r.dtype)  # noqa: E731
    state = _state(REPLAY)
    old_paged = _prepare(state, b_static.replace(routes_btlk=shift(paged_rec)))[0].old_logp_bt
    old_static = _prepare(state, b_static.replace(routes_btlk=shift(b_static.routes_btlk)))[0].old_logp_bt
    loss = np.asarray(b_static.loss_mask_bt)
    np.testing.assert_allclose(np.asarray(old_paged)[loss], np.asarray(old_static)[loss], atol=1e-6)


def test_interruptible_rollout_records_the_routes_of_the_cache_it_decodes_from():
    """Partial rollouts (`rljax.sampling.interruptible`): without a swap the record is the static
    scheduler's; with new weights (the router's expert columns reversed) taken up after 3 tokens,
    the swap re-records the prompt and every fed completion token, so the whole record is the new
    params' teacher-forced routing (f32), which differs from the old params' on most token-layers
    (a swap that kept the old record fails)."""
    from rljax.sampling.interruptible import sample_with_updates
    tokens, mask = _prompts()
    controls = CONTROLS.replace(record_routes=True)
    v0 = _params(False)
    v1 = dict(v0, layers=dict(v0["layers"], router=v0["layers"]["router"][..., ::-1]))
    polls = []

    def weights(switch_after):
        polls.append(None)
        return (v1, 1) if len(polls) > switch_after else (v0, 0)

    plain, _, swaps = sample_with_updates(CFG, tokens, mask, jax.random.key(1), controls, segment_steps=3,
                                          weights=lambda: weights(99))
    static = jax.jit(lambda p: sample(CFG, p, tokens, mask, jax.random.key(1), controls))(v0)
    assert swaps == 0
    np.testing.assert_array_equal(np.asarray(plain.routes), np.asarray(static.routes))
    np.testing.assert_array_equal(np.asarray(plain.prompt_routes), np.asarray(static.prompt_routes))
    polls.clear()
    out, version_bc, swaps = sample_with_updates(CFG, tokens, mask, jax.random.key(1), controls, segment_steps=3,
                                                 weights=lambda: weights(2))
    assert swaps == 1 and set(np.unique(np.asarray(version_bc))) >= {0, 1}
    rec = np.concatenate([np.asarray(out.prompt_routes), np.asarray(out.routes)], axis=1)
    seq = jnp.concatenate([jnp.repeat(tokens, SAMPLES, axis=0), out.tokens], axis=1)
    attn = jnp.concatenate([jnp.repeat(mask, SAMPLES, axis=0), out.mask], axis=1)
    own = {v: np.asarray(hidden_states_and_routes(CFG, p, seq, attn_mask_bt=attn)[1].routes_btk).transpose(1, 2, 0, 3)
           for v, p in ((0, v0), (1, v1))}
    covered = rec[..., 0] >= 0
    fed = np.arange(N)[None, :] < np.asarray(out.lengths)[:, None] - 1
    assert covered[:, :P][np.asarray(mask.repeat(SAMPLES, 0))].all() and covered[:, P:][fed].all()
    np.testing.assert_array_equal(rec[covered], own[1][covered])
    assert (rec[covered] != own[0][covered]).any(-1).mean() > 0.5


class _ObservingHost:
    """A multi-turn environment in two lines: a row's first turn gets the observation 10 11 12,
    its second ends the episode."""

    def reset(self, index_b):
        self.turns = np.zeros(len(index_b), np.int32)
        return np.int32(0)

    def step(self, episode_id, tokens_bn, turn_start_b, step, needs_b):
        rows = needs_b.shape[0]
        self.turns = self.turns + needs_b
        obs = np.zeros((rows, 4), np.int32)
        obs[:, :3] = (10, 11, 12)
        return MT.EnvOutput(obs, np.full(rows, 3, np.int32), self.turns >= 2, np.zeros(rows, np.float32),
                            np.zeros(rows, np.int32), np.zeros(rows, bool))


def test_multiturn_episodes_record_every_fed_token():
    """Multi-turn episodes (`rljax.sampling.multiturn`, [env]): the record covers the prompt and
    every column a running row fed, model and observation tokens alike, and equals an
    independent teacher-forced forward's top-k over the episode batch (f32); the episode batch
    carries it, aligned with its tokens."""
    tokens, mask = _prompts()
    controls = MT.episode_controls(CONTROLS.replace(record_routes=True, max_new_tokens=4), (7,))
    host = _ObservingHost()
    run = jax.jit(lambda p, k: MT.sample_episodes(CFG, p, tokens, mask, jnp.arange(G), k, controls=controls,
                                                  host=host, budget=16, max_turns=2, max_observation_tokens=4))
    episodes = run(_params(False), jax.random.key(1))
    batch = episodes_to_batch(tokens, mask, episodes, num_samples=SAMPLES, options=EnvConfig(name="x")).batch
    rec = np.asarray(batch.routes_btlk)
    assert (np.asarray(episodes.author_bn) == ENV).any()  # observations were fed
    own, _ = _routing(_params(False), batch)
    own = np.asarray(own.routes_btk).transpose(1, 2, 0, 3)
    covered = rec[..., 0] >= 0
    attn = np.asarray(batch.attn_mask_bt)
    fed = np.arange(rec.shape[1])[None, :] < P + np.asarray(episodes.lengths_b)[:, None] - 1
    assert covered[attn & fed].all() and not covered[~attn].any()
    np.testing.assert_array_equal(rec[covered], own[covered])


def test_a_wrong_record_changes_the_trainer_logprobs():
    """f32, where the record equals the trainer's own routes: replaying it gives the log-probs
    without replay (1e-6); a record with every expert id shifted by one, or only the prompt's,
    moves the completion tokens' log-probs (the prompt's record is read too)."""
    batch = _batch(False, "float32")
    state = _state(REPLAY)
    loss = np.asarray(batch.loss_mask_bt)

    def old_logp(routes):
        return np.asarray(_prepare(state, batch.replace(routes_btlk=routes))[0].old_logp_bt)[loss]

    rec = batch.routes_btlk
    shift = lambda r: jnp.where(r >= 0, (r + 1) % 4, r).astype(r.dtype)  # noqa: E731
    plain = np.asarray(_prepare(_state(OFF), batch.replace(routes_btlk=None))[0].old_logp_bt)[loss]
    np.testing.assert_allclose(old_logp(rec), plain, atol=1e-6)
    assert np.abs(old_logp(shift(rec)) - plain).max() > 0.1
    assert np.abs(old_logp(rec.at[:, :P].set(shift(rec[:, :P]))) - plain).max() > 1e-3


def test_packed_microbatches_replay_like_the_padded_one():
    """A shifted record (which moves the log-probs by > 0.1: the test above): the loss and
    gradients of the mini-batch in two packed micro-batches (`rljax.update.packing`: the record
    moves with its tokens) equal the padded micro-batch's within 1e-5 (a packed forward that
    dropped the record would route by the trainer's own top-k). The padded micro-batch's
    `moe/route_agreement` is the share of real token-layers where the trainer's own top-k in the
    replayed forward is the set it used, and the router's gradient is not zero: it trains
    through the gates, the experts being fixed by the record."""
    batch = _batch(False, "float32")
    batch = batch.replace(routes_btlk=jnp.where(batch.routes_btlk >= 0, (batch.routes_btlk + 1) % 4,
                                                batch.routes_btlk).astype(batch.routes_btlk.dtype))
    state = _state(REPLAY.replace(recompute_old_logp=False))
    prepared, _ = _prepare(state, batch)
    den = aggregation_denominator(prepared, state.algo, N)
    kw = dict(cfg=CFG, algo=state.algo, update_cfg=state.update_cfg, norm_length=N)
    plan = pack_rows(prepared.attn_mask_bt, prepared.loss_mask_bt, prepared.tokens_bt.shape[1])
    per = -(-int(plan.num_buffers) // 2)

    @jax.jit
    def loss_and_grads(prepared, first):
        slab = None if first is None else Slab(plan, first, per)
        share = 1.0 if first is None else 0.5
        return jax.value_and_grad(microbatch_loss, has_aux=True)(state.trainable, prepared, den, share=share,
                                                                  slab=slab, **kw)

    (l_pad, (pairs, _)), g_pad = loss_and_grads(prepared, None)
    packed = [loss_and_grads(prepared, jnp.asarray(i * per)) for i in range(2)]
    l_pack = sum(float(p[0][0]) for p in packed)
    g_pack = jax.tree.map(jnp.add, packed[0][1], packed[1][1])
    np.testing.assert_allclose(l_pack, float(l_pad), atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g_pack, g_pad)
    assert float(jnp.abs(g_pad[0]["layers"]["router"]).max()) > 0
    _, used = _routing(_params(False), batch)
    agree = (np.sort(np.asarray(used.own_routes_btk), -1) == np.sort(np.asarray(used.routes_btk), -1)).all(-1)
    agreement = pairs["moe/route_agreement"]
    np.testing.assert_allclose(float(agreement[0] / agreement[1]),
                               agree.transpose(1, 2, 0)[np.asarray(batch.attn_mask_bt)].mean(), atol=1e-6)
    assert float(agreement[0] / agreement[1]) < 0.5 and "moe/expert_load" in pairs


def test_replay_on_a_dense_model_or_without_a_record_is_one_config_error():
    """One line each: replay on a dense model, a batch without a record, an unknown mode; every
    run setting keeps the record now (the paged layout, the replay buffer, partial rollouts,
    multi-turn [env]); the MoE recipe turns replay on."""
    dense = M.preset("qwen2-test")
    with pytest.raises(ConfigError, match="dense model: set algorithm.routing_replay='off'"):
        init_train_state(dense, M.init_params(dense, jax.random.key(0)), REPLAY, OptimConfig())
    with pytest.raises(ConfigError, match="batch.routes_btlk is None"):
        prepare_batch(_state(REPLAY), _batch(False, "float32").replace(routes_btlk=None))
    with pytest.raises(ConfigError, match="routing_replay"):
        AlgorithmConfig(routing_replay="trainer")
    assert load_config("moe_default", ["sampling.scheduler=continuous", "sampling.kv_layout=paged",
                                       "sampling.max_total_tokens=1024"]).sampling.kv_layout == "paged"
    # the replay buffer (tests/data/test_replay.py), interruptible rollouts and multi-turn episodes
    # carry the record: no run setting is refused any more
    assert load_config("moe_default", ["rl.replay.capacity=8", "algorithm.recompute_old_logp=true",
                                       "algorithm.off_policy=tis"]).rl.replay.capacity == 8
    assert load_config("moe_default", ["rl.partial_rollouts=true", "rl.mode=async",
                                       "mesh.sampler_devices=1"]).rl.partial_rollouts
    assert load_config("moe_default", ["env.name=countdown"]).env.enabled
    assert load_config("moe_default").algorithm.needs.routes
