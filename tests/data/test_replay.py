"""Replay of successful trajectories (rljax/data/replay.py): storage, mixing, the corrected loss."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rljax.data.replay import ReplayBuffer, mix_into_batch
from rljax.errors import CheckpointError, ConfigError
from rljax.objectives import OFF_POLICY, POLICY_LOSSES, aggregate
from rljax.update.batch import RolloutBatch

N, COMPLETION = 3, 3  # samples per prompt, completion columns


def _batch(prompts_gp, rewards_b, seed):
    """A prompt-major RolloutBatch: each row = left-padded prompt then COMPLETION sampled tokens,
    with behaviour log-probs on the completion (0 elsewhere)."""
    rng = np.random.default_rng(seed)
    rows, attn = [], []
    width = max(len(p) for p in prompts_gp)
    for prompt in prompts_gp:
        for _ in range(N):
            pad = width - len(prompt)
            rows.append([0] * pad + list(prompt) + list(rng.integers(5, 50, COMPLETION)))
            attn.append([False] * pad + [True] * (len(prompt) + COMPLETION))
    tokens = np.array(rows, np.int32)
    loss = np.zeros_like(tokens, bool)
    loss[:, -COMPLETION:] = True
    logp = np.where(loss, -rng.uniform(0.1, 2.0, tokens.shape), 0.0).astype(np.float32)
    groups = np.repeat(np.arange(len(prompts_gp)), N).astype(np.int32)
    return RolloutBatch(tokens_bt=tokens, attn_mask_bt=np.array(attn), loss_mask_bt=loss, sampler_logp_bt=logp,
                        rewards_b=np.asarray(rewards_b, np.float32), group_ids_b=groups, completion_len=COMPLETION)


def _add(buffer, batch, prompt_ids):
    return buffer.add(prompt_ids, batch.tokens_bt, batch.attn_mask_bt, batch.loss_mask_bt, batch.sampler_logp_bt,
                      batch.rewards_b)


@pytest.fixture(scope="module")
def mixed():
    """Step 1 (prompt width 3): p0 solved 1/3 (stored), p1 solved 2/3 (too easy, not stored).
    Step 2 (prompt width 2, one column narrower): p0 and p1 both all-failed; p0 gets a replay."""
    buffer = ReplayBuffer(capacity=4, row_len=8, per_prompt=2, max_pass_rate=0.5)
    step1 = _batch([(7, 8), (9, 10, 11)], [1, 0, 0, 1, 1, 0], seed=1)
    stored = _add(buffer, step1, ["p0", "p1"])
    step2 = _batch([(7, 8), (9, 10)], [0] * 6, seed=2)
    out = mix_into_batch(step2, buffer, prompt_ids_g=["p0", "p1"], fraction=1.0)
    return buffer, step1, step2, stored, out


def test_replayed_rows_carry_their_behaviour_logprobs_exactly(mixed):
    """Only successes of hard prompts are stored; the all-failed p0 group's last row becomes the
    stored success with its tokens, masks, reward and behaviour log-probs, realigned to the
    narrower batch; every other row is untouched.
    Catches: storing easy prompts' rows, replaying into the wrong group or row, misaligned
    columns, or keeping the fresh row's log-probs on the replayed tokens."""
    buffer, step1, step2, stored, out = mixed
    assert stored == 1 and buffer.slots_of("p0") and not buffer.slots_of("p1")
    b = out.batch
    assert isinstance(b, RolloutBatch) and out.replayed_b.tolist() == [False, False, True, False, False, False]
    # step1 row 0 is [pad, 7, 8, c, c, c]; step2 has no pad column for p0
    np.testing.assert_array_equal(b.sampler_logp_bt[2], step1.sampler_logp_bt[0, 1:])
    np.testing.assert_array_equal(b.tokens_bt[2], step1.tokens_bt[0, 1:])
    np.testing.assert_array_equal(b.loss_mask_bt[2], step1.loss_mask_bt[0, 1:])
    np.testing.assert_array_equal(b.attn_mask_bt[2], step1.attn_mask_bt[0, 1:])
    assert b.rewards_b[2] == 1.0
    keep = ~out.replayed_b
    for name in ("tokens_bt", "attn_mask_bt", "loss_mask_bt", "sampler_logp_bt", "rewards_b"):
        np.testing.assert_array_equal(np.asarray(getattr(b, name))[keep], np.asarray(getattr(step2, name))[keep])
    assert out.metrics == {"replay/rows_mixed": 1.0, "replay/groups_all_failed": 2.0}


def _corrected_loss_reference(logp, trainer, behaviour, mask, adv, correction, cap=2.0, eps=0.2):
    """NumPy: PPO-clip against the trainer's old log-probs, times TIS weight min(pi_old/mu, cap)
    or under the MIS mask |log pi_old/mu| <= log cap, token-mean over the surviving tokens."""
    log_w = np.where(mask, trainer - behaviour, 0.0)
    if correction == "tis":
        w, m = np.minimum(np.exp(log_w), cap), mask.astype(float)
    else:
        w, m = np.ones_like(log_w), mask * (np.abs(log_w) <= np.log(cap))
    r = np.exp(logp - trainer)
    loss = np.maximum(-adv * r, -adv * np.clip(r, 1 - eps, 1 + eps)) * w
    return np.sum(loss * m) / np.sum(m), m


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_loss_on_mixed_batch_applies_the_off_policy_correction(mixed, correction):
    """The registered correction + ppo_clip + token-mean on the mixed batch equals the NumPy
    corrected objective built from step 1's stored behaviour log-probs; the replayed row's
    weight differs from 1 (the correction binds) while fresh rows' stay near 1.
    Catches: replayed rows scored against the fresh sampler's log-probs, or no correction."""
    _, step1, _, _, out = mixed
    b = out.batch
    mask = b.loss_mask_bt
    rng = np.random.default_rng(3)
    trainer = np.where(mask, b.sampler_logp_bt + rng.normal(0, 0.01, mask.shape), 0.0).astype(np.float32)
    trainer[2, -COMPLETION:] = step1.sampler_logp_bt[0, -COMPLETION:] + np.array([1.2, 0.1, -0.05], np.float32)
    logp = np.where(mask, trainer + rng.normal(0, 0.1, mask.shape), 0.0).astype(np.float32)
    rewards_gn = b.rewards_b.reshape(-1, N)
    adv = np.repeat((rewards_gn - rewards_gn.mean(axis=1, keepdims=True)).reshape(-1), mask.shape[1]).reshape(mask.shape)
    adv = np.where(mask, adv, 0.0).astype(np.float32)

    behaviour_ref = np.array(b.sampler_logp_bt)
    behaviour_ref[2] = step1.sampler_logp_bt[0, 1:]  # what step 1's sampler produced for that row
    want, m_ref = _corrected_loss_reference(logp.astype(np.float64), trainer.astype(np.float64),
                                            behaviour_ref.astype(np.float64), mask, adv, correction)

    w, m = OFF_POLICY.get(correction)(trainer, b.sampler_logp_bt, mask.astype(np.float32), cap=2.0, level="token")
    loss_bt, _ = POLICY_LOSSES.get("ppo_clip")(logp, trainer, adv, m)
    got = float(aggregate(loss_bt * w, m, "token-mean"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(m), m_ref)
    if correction == "tis":
        assert float(np.asarray(w)[2, -COMPLETION]) == pytest.approx(2.0)  # e^1.2 truncated at the cap
    else:
        assert np.asarray(m)[2].sum() == COMPLETION - 1  # the e^1.2 token is masked out


def test_eviction_per_prompt_then_fifo_and_newest_is_replayed():
    """per_prompt=2 keeps a prompt's two newest successes; at capacity the oldest row overall
    goes; mixing replays the prompt's newest success.
    Catches: one prompt filling the buffer, evicting a prompt's newest row, replaying its
    oldest, or miscounted evictions."""
    buffer = ReplayBuffer(capacity=3, row_len=6, per_prompt=2, max_pass_rate=0.5)
    batches = [_batch([(1, 2)], [1, 0, 0], seed=seed) for seed in range(5)]
    serials = lambda key: [int(buffer.order[s]) for s in buffer.slots_of(key)]  # noqa: E731
    for batch in batches[:3]:
        _add(buffer, batch, ["a"])
    assert serials("a") == [1, 2]
    for batch, key in zip(batches[3:], "bc"):
        _add(buffer, batch, [key])
    assert {key: serials(key) for key in "abc"} == {"a": [2], "b": [3], "c": [4]}  # FIFO dropped serial 1
    assert buffer.metrics() == {"replay/size": 3.0, "replay/added": 5.0, "replay/sampled": 0.0,
                                "replay/evicted": 2.0, "replay/mixed": 0.0}
    _add(buffer, _batch([(1, 2)], [1, 0, 0], seed=9), ["c"])  # c now holds serials 4 and 5
    out = mix_into_batch(_batch([(1, 2)], [0, 0, 0], seed=10), buffer, prompt_ids_g=["c"], fraction=1.0)
    np.testing.assert_array_equal(out.batch.tokens_bt[2], _batch([(1, 2)], [1, 0, 0], seed=9).tokens_bt[0])


def test_fraction_caps_the_groups_replayed():
    """With 4 all-failed groups that all have stored successes, fraction=0.5 replays into 2 (the
    first two in batch order).
    Catches: a fraction read as rows instead of groups, or no cap at all."""
    buffer = ReplayBuffer(capacity=8, row_len=6, max_pass_rate=0.5)
    prompts = [(1, 2), (3, 4), (5, 6), (7, 8)]
    _add(buffer, _batch(prompts, [1, 0, 0] * 4, seed=0), ["a", "b", "c", "d"])
    out = mix_into_batch(_batch(prompts, [0] * 12, seed=1), buffer, prompt_ids_g=["a", "b", "c", "d"], fraction=0.5)
    assert np.flatnonzero(out.replayed_b).tolist() == [2, 5] and buffer.counters["mixed"] == 2


def test_state_dict_round_trip_and_deterministic_sampling():
    """A buffer restored from state_dict equals the original and samples the same rows from the
    same generator; a checkpoint of another capacity is a one-line CheckpointError.
    Catches: state left out of state_dict (prompts, serial, counters) or aliasing the arrays."""
    buffer = ReplayBuffer(capacity=4, row_len=6, per_prompt=1, max_pass_rate=0.5)
    for seed, key in enumerate(["a", "b", "c", "d", "e"]):
        _add(buffer, _batch([(1, 2 + seed)], [1, 0, 0], seed=seed), [key])
    state = buffer.state_dict()
    restored = ReplayBuffer(capacity=4, row_len=6, per_prompt=1, max_pass_rate=0.5)
    restored.load_state_dict(state)
    first, second = buffer.sample(2, np.random.default_rng(0)), restored.sample(2, np.random.default_rng(0))
    for name in ("tokens_bt", "attn_mask_bt", "loss_mask_bt", "behaviour_logp_bt", "rewards_b"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    assert first.prompt_ids == second.prompt_ids and buffer.metrics() == restored.metrics()
    assert restored.slots_of("a") == [] and restored.serial == 5
    buffer.tokens[:] = -1
    assert not np.any(restored.tokens == -1)  # restored arrays are copies
    with pytest.raises(CheckpointError, match="keep replay.capacity"):
        ReplayBuffer(capacity=5, row_len=6).load_state_dict(state)


def _with_routes(batch, layers=2, top_k=2):
    """The batch with a routing record that is a function of each token (so a replayed row's record
    can be checked against its tokens): (token + 5 l + j) mod 16, -1 on padding."""
    tokens, attn = batch.tokens_bt, batch.attn_mask_bt
    routes = (tokens[:, :, None, None] + 5 * np.arange(layers)[:, None] + np.arange(top_k)) % 16
    return dataclasses.replace(batch, routes_btlk=np.where(attn[:, :, None, None], routes, -1).astype(np.int8))


def test_replayed_rows_bring_their_routing_record():
    """Routing replay: a buffer with `routes_lk` stores each success's record with its tokens; the
    replayed row's record in the (narrower) batch is its own, shifted with its tokens (-1 on its
    padding), the other rows' records untouched, in the batch's dtype; the record survives
    state_dict. A record-carrying batch and a buffer without records, either way, is one line.
    Catches: a record left behind (the fresh row's kept), shifted by another width, or dropped
    from the checkpoint."""
    buffer = ReplayBuffer(capacity=4, row_len=8, per_prompt=2, max_pass_rate=0.5, routes_lk=(2, 2))
    step1 = _with_routes(_batch([(7, 8), (9, 10, 11)], [1, 0, 0, 1, 1, 0], seed=1))
    buffer.add(["p0", "p1"], step1.tokens_bt, step1.attn_mask_bt, step1.loss_mask_bt, step1.sampler_logp_bt,
               step1.rewards_b, routes_btlk=step1.routes_btlk)
    step2 = _with_routes(_batch([(7, 8), (9, 10)], [0] * 6, seed=2))
    restored = ReplayBuffer(capacity=4, row_len=8, per_prompt=2, max_pass_rate=0.5, routes_lk=(2, 2))
    restored.load_state_dict(buffer.state_dict())
    out = mix_into_batch(step2, restored, prompt_ids_g=["p0", "p1"], fraction=1.0)
    assert np.flatnonzero(out.replayed_b).tolist() == [2]
    got = out.batch.routes_btlk
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, _with_routes(out.batch).routes_btlk)  # row 2: the stored row's record
    np.testing.assert_array_equal(got[[0, 1, 3, 4, 5]], step2.routes_btlk[[0, 1, 3, 4, 5]])
    assert not np.array_equal(got[2], step2.routes_btlk[2])
    with pytest.raises(ConfigError, match="buffer keeps none"):
        mix_into_batch(step2, ReplayBuffer(capacity=4, row_len=8), prompt_ids_g=["p0", "p1"], fraction=1.0)
    with pytest.raises(ConfigError, match="the batch has none"):
        _add(buffer, step1, ["p0", "p1"])
    with pytest.raises(CheckpointError, match="routing records"):
        ReplayBuffer(capacity=4, row_len=8).load_state_dict(buffer.state_dict())
