"""Mixtures wired into training (issue 24): `[[data.sources]]`, routing by task, per-task metrics,
fresh questions, band redraws, the host-steered iteration (DAPO rounds, replay), the warm
start's stopping rule and resume determinism."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from rljax.rewards.config import build_reward
from rljax import rewards
from rljax.data.example import Example, question_key, verifier_metadata
from rljax.data.mixture import FreshStream, MixtureSampler, MixtureSource, task_metrics
from rljax.data.replay import ReplayBuffer
from rljax.data.selection import make_policy
from rljax.data.templates import PromptFormat
from rljax.errors import ConfigError, DataError
from rljax.tokenizers import CharTokenizer
from rljax.train import setup
from rljax.drivers.host import HostBatcher, Rounds, gather_groups
from rljax.train.config import load_config
from rljax.warmstart.sft import stop_reason
from rljax.update import RolloutBatch

TOK = CharTokenizer("0123456789+-= ")


def _examples(name: str, count: int, start: int = 0) -> tuple[Example, ...]:
    return tuple(Example(id=f"{name}/{i}", question=f"{i} + 1 =", answer=str(i + 1), task=name)
                 for i in range(start, start + count))


# ----------------------------------------------------------------------------- config


def test_sources_table_parses_and_labels(tmp_path):
    """`[[data.sources]]` becomes typed SourceSections with default labels (task, task@L{level},
    file stem), a routed reward and the mixture flag; the single-source default job is no mixture.
    Catches: sources left as dicts, labels that collide across levels, or the default job taking
    the host-steered path."""
    recipe = tmp_path / "mix.toml"
    recipe.write_text('[data]\nselection = "bandit"\n'
                      '[[data.sources]]\ntask = "chain_sum"\nlevel = 1\nweight = 2.0\nfresh = true\n'
                      '[[data.sources]]\ntask = "chain_sum"\nlevel = 2\n'
                      '[[data.sources]]\nkind = "jsonl"\npath = "data/gsm.jsonl"\nverifier = "math"\n')
    cfg = load_config(recipe)
    labels = [s.label for s in cfg.data.sources]
    assert labels == ["chain_sum@L1", "chain_sum@L2", "gsm"] and cfg.data.sources[0].weight == 2.0
    assert cfg.host_batching and not load_config(None).host_batching
    assert json.loads(json.dumps(cfg.to_dict()))["data"]["sources"][2]["verifier"] == "math"
    routed = build_reward(cfg.reward, cfg.data.sources).parts[0].verifier
    assert isinstance(routed.routes["gsm"], rewards.MathAnswer)
    assert isinstance(routed.routes["chain_sum@L1"], rewards.ReasoningGymAnswer)


@pytest.mark.parametrize("overrides,message", [
    (["data.sources=[{task='a'}, {task='a'}]"], "data.sources names ['a', 'a'] repeat"),
    (["data.sources=[{kind='jsonl', path='x.jsonl', fresh=true}]"], "fresh = true needs a reasoning_gym source"),
    (["data.sources=[{kind='parquet'}]"], "a parquet source needs path"),
    (["data.selection=greedy"], "unknown selection policy 'greedy'"),
    (["rl.replay.capacity=8"], "rl.replay mixes off-policy rows: set algorithm.recompute_old_logp=true"),
    (["rl.resample_round_size=4", "rl.resample_max_rounds=2"], "cannot fill 64 groups"),
    (["rl.resample_round_size=64", "rl.dynamic_sampling=true"], "set one of them"),
])
def test_mixture_config_errors_are_one_line(overrides, message):
    """Each bad mixture setting is one ConfigError line naming the problem and the fix.
    Catches: a missing check (a traceback deep in the run instead) or a multi-line message."""
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- routing and metrics


def _by_answer(meta, completion):
    return float(completion.strip() == meta["answer"])


def _always_half(meta, completion):
    return 0.5


def test_reward_routes_by_task():
    """Rows of task a are graded by a's verifier, rows of task b by b's, on a fixed set.
    Catches: routing by position or by the first route, or losing the task in verifier_metadata."""
    reward = rewards.compose(correct=rewards.RoutedVerifier({
        "a": rewards.verifier(_by_answer, time_limit_s=None), "b": rewards.verifier(_always_half, time_limit_s=None)}))
    exs = [*_examples("a", 2), *_examples("b", 2)]
    out, infos = reward.batch([verifier_metadata(e) for e in exs], ["1", "0", "1", "3"])
    np.testing.assert_array_equal(out.total_b, [1.0, 0.0, 0.5, 0.5])
    assert [i["correct"]["route"] for i in infos] == ["a", "a", "b", "b"]
    with pytest.raises(DataError, match="no verifier for task 'c'"):
        rewards.RoutedVerifier({"a": rewards.verifier(_by_answer)})({"mixture_task": "c"}, "x")


def test_task_metrics_equal_a_per_task_reference():
    """rollout/{task}/{reward,pass_rate,samples} equal per-task means and counts computed by
    masking, on random rewards with one task absent.
    Catches: counting groups instead of samples, a mean over the whole batch, or a wrong threshold."""
    rng = np.random.default_rng(0)
    task_ids_g = rng.choice([0, 2], size=12)
    rewards_gn = rng.choice([0.0, 0.5, 1.0], size=(12, 4))
    got = task_metrics(["x", "y", "z"], task_ids_g, rewards_gn)
    for j, name in enumerate("xyz"):
        rows = rewards_gn[task_ids_g == j]
        assert got[f"rollout/{name}/samples"] == rows.size
        if rows.size:
            assert got[f"rollout/{name}/reward"] == pytest.approx(rows.mean(), abs=1e-12)
            assert got[f"rollout/{name}/pass_rate"] == pytest.approx((rows >= 1.0).mean(), abs=1e-12)
    assert "rollout/y/reward" not in got


# ----------------------------------------------------------------------------- streams


@pytest.fixture(scope="module")
def one_digit_sources():
    """chain_sum with 1-digit terms (200 distinct questions), 60 held out, a fresh stream."""
    section = load_config(None, ["data.sources=[{task='chain_sum', size=60, eval_size=60, fresh=true, "
                                 "task_kwargs={min_terms=2, max_terms=2, min_digits=1, max_digits=1}}]"]).data
    return setup.build_sources(section)


def test_fresh_questions_never_repeat_or_leak_held_out(one_digit_sources):
    """Every fresh question is new: not held out, not in the warm-start pool, never drawn twice,
    until the generator runs out; then the stream warns once and repeats the questions it drew
    (not pool ones, which the warm start memorised), and a resumed stream continues in that mode.
    A space with nothing outside pool and held-out falls back to pool questions, never held-out
    ones; only held-out questions is a DataError. Catches: a fixed pool in disguise, no dedupe
    against the held-out split, pool or held-out questions leaking in after exhaustion, a run
    killed by exhaustion, or an endless loop."""
    src = one_digit_sources[0]
    held = {question_key(e) for e in src.held_out}
    pool = {question_key(e) for e in src.train}
    stream = FreshStream(src.generate, held | pool, src.name, max_skips=2000, held_out=held)
    fresh_count = 200 - len(held | pool)
    drawn = [question_key(stream.next()) for _ in range(fresh_count)]
    assert len(drawn) == len(set(drawn)) and not set(drawn) & (held | pool) and not stream.repeating
    with pytest.warns(UserWarning, match="ran out of new questions"):
        drawn.append(question_key(stream.next()))
    assert stream.repeating == 1
    drawn += [question_key(stream.next()) for _ in range(300)]
    assert set(drawn) == set(drawn[:fresh_count])  # only its own questions come back
    restored = FreshStream(src.generate, held | pool, src.name, held_out=held)
    restored.load_state(json.loads(json.dumps(stream.state_dict())))
    assert restored.next_index == stream.next_index and restored.seen == stream.seen and restored.repeating == 1
    assert [question_key(restored.next()) for _ in range(5)] == [question_key(stream.next()) for _ in range(5)]
    everything = held | pool | set(drawn)
    pool_only = FreshStream(src.generate, everything, src.name, max_skips=500, held_out=held)
    with pytest.warns(UserWarning):
        repeats = {question_key(pool_only.next()) for _ in range(50)}
    assert pool_only.repeating == 2 and repeats and not repeats & held
    with pytest.warns(UserWarning), pytest.raises(DataError, match="held-out questions in a row"):
        FreshStream(src.generate, everything, src.name, max_skips=500, held_out=everything).next()


def test_iid_fresh_stream_is_the_generator_minus_held_out(one_digit_sources):
    """`fresh_draws = "iid"` (distinct=False): draw k is the k-th generator item that is not held
    out, pool questions and repeats included, so the training distribution is the held-out one's.
    Reference: the generator's items filtered by the held-out keys alone. Catches: pool questions
    or earlier draws still skipped (the 1-digit space has 80 questions outside pool and held out,
    and 400 draws must repeat), or a held-out question leaking in."""
    src = one_digit_sources[0]
    held = {question_key(e) for e in src.held_out}
    pool = {question_key(e) for e in src.train}
    stream = FreshStream(src.generate, held | pool, src.name, held_out=held, distinct=False)
    drawn = [question_key(stream.next()) for _ in range(400)]
    reference = [k for k in (question_key(src.generate(i)) for i in range(stream.next_index)) if k not in held]
    assert drawn == reference and set(drawn) & pool and len(set(drawn)) < len(drawn)
    assert not stream.repeating and not set(drawn) & held
    section = load_config(None, ["data.sources=[{task='chain_sum', size=60, eval_size=60, fresh=true, "
                                 "fresh_draws='iid', task_kwargs={min_terms=2, max_terms=2, min_digits=1, "
                                 "max_digits=1}}]"]).data
    assert not setup.build_sources(section)[0].fresh_distinct and src.fresh_distinct


def test_band_redraws_are_bounded_and_keep_matches_the_filter():
    """A band policy rejecting every seen prompt replaces each at most max_redraws times, then keeps
    it; the batch keeps its size and the counted rejections equal B * max_redraws. With half the
    pool in band, every kept prompt is one `keep` accepts.
    Catches: unbounded redraws (a stalled batch), a shrinking batch, or keep ignored."""
    pool = _examples("t", 40)
    band = make_policy("band", low=0.2, high=0.8)
    sampler = MixtureSampler([MixtureSource("t", pool, ())], band, seed=0, tokenizer=TOK, fmt=PromptFormat(),
                             max_prompt_len=8, max_redraws=3)
    sampler.state = band.update(sampler.state, np.zeros(40, int), _stats([1.0] * 40, [e.id for e in pool]))
    drawn = sampler.draw(5)
    assert drawn.prompts.tokens_bt.shape == (5, 8) and drawn.metrics["selection/band_rejected"] == 15
    in_band = [0.5 if i % 2 else 1.0 for i in range(40)]  # odd prompts inside (0.2, 0.8)
    sampler.state = band.update(band.init(1, 0), np.zeros(40, int), _stats(in_band, [e.id for e in pool]))
    drawn = sampler.draw(6)
    assert all(int(i.split("/")[1]) % 2 for i in drawn.prompt_ids)


def test_curriculum_gets_levels_and_families_from_the_sources_and_calibrates():
    """`auto_curriculum` built from the sources knows each source's level and family (its task);
    calibrated on pass rates (a: 0.95 at L1, 0.5 at L2; b: 0.05, 0.0) it starts a at L2 (inside
    the band) and b at L1 (nothing in band or above), and draws only those tasks, plus b's probe
    of its next level (a has none above L2).
    Catches: levels or families not passed to the policy, or calibrate not reaching its state."""
    section = load_config(None, ["data.selection=auto_curriculum"]).data
    sources = tuple(MixtureSource(name, _examples(name, 8), (), level=level, family=name[0])
                    for name, level in (("a1", 1), ("a2", 2), ("b1", 1), ("b2", 2)))
    policy = setup.build_selection(section, sources)
    assert policy.levels == (1, 2, 1, 2) and policy.families == ("a", "a", "b", "b")
    sampler = MixtureSampler(sources, policy, seed=0, tokenizer=TOK, fmt=PromptFormat(), max_prompt_len=8)
    sampler.calibrate([0.95, 0.5, 0.05, 0.0])
    drawn = sampler.draw(400).task_ids_b
    assert set(drawn.tolist()) == {1, 2, 3} and 0.01 < np.mean(drawn == 3) < 0.1  # probe 0.1 of b's half


def _stats(pass_rates, ids):
    from rljax.data.selection import GroupStats

    p = np.asarray(pass_rates, np.float64)
    return GroupStats(pass_rate_g=p, abs_adv_g=np.zeros_like(p), prompt_ids_g=tuple(ids), group_size=4)


# ----------------------------------------------------------------------------- host-steered iteration

N = 2  # samples per prompt
WIDTH, C = 8, 3


class FakeSampler:
    """The sample program's contract on NumPy: prompt-major rows whose rewards come from a fixed
    per-round table and whose behaviour log-probs encode (round, row)."""

    def __init__(self, rewards_per_round, baselines_per_round=None):
        self.rewards, self.baselines, self.calls = rewards_per_round, baselines_per_round, 0

    def __call__(self, params, tokens_pt, mask_pt, index_p, key):
        r, p = self.calls, tokens_pt.shape[0]
        self.calls += 1
        rows = p * N
        tokens = np.concatenate([np.repeat(tokens_pt, N, 0), np.full((rows, C), 3 + r, np.int32)], 1)
        attn = np.concatenate([np.repeat(mask_pt, N, 0), np.ones((rows, C), bool)], 1)
        loss = np.concatenate([np.zeros((rows, WIDTH), bool), np.ones((rows, C), bool)], 1)
        logp = np.where(loss, -(r * 100 + np.arange(rows)[:, None] + 1.0), 0.0).astype(np.float32)
        batch = RolloutBatch(tokens_bt=tokens, attn_mask_bt=attn, loss_mask_bt=loss, sampler_logp_bt=logp,
                             rewards_b=np.asarray(self.rewards[r], np.float32).reshape(-1),
                             baseline_rewards_b=None if self.baselines is None else  # ReMax's greedy rewards
                             np.repeat(np.asarray(self.baselines[r], np.float32), N),
                             group_ids_b=np.repeat(np.arange(p), N), completion_len=C)
        return batch, {"rollout/reward_mean": float(np.mean(self.rewards[r])), "rollout/tokens": rows * C}, None


class FakeState:
    pass


class FakeStages:
    """`Stages` with the fake sampler and a recording update."""

    def __init__(self, fake, update_fn):
        self.fake, self.update_fn = fake, update_fn

    def sample(self, state, *args):
        return self.fake(None, *args)

    def update(self, state, batch, key):
        return self.update_fn(state, batch, key)


def _batcher(rewards_per_round, rounds, replay=None, fraction=0.0, num_groups=3, sources=None, baselines=None):
    seen = []

    def update_fn(state, batch, key):
        seen.append(batch)
        return state, {"train/rows": float(batch.rewards_b.shape[0])}

    sources = sources or [MixtureSource("a", _examples("a", 30), ()), MixtureSource("b", _examples("b", 30), ())]
    sampler = MixtureSampler(sources, make_policy("uniform"), seed=0, tokenizer=TOK, fmt=PromptFormat(), max_prompt_len=WIDTH)
    fake = FakeSampler(rewards_per_round, baselines)
    return HostBatcher(sampler, FakeStages(fake, update_fn), num_groups=num_groups, num_samples=N, rounds=rounds, replay=replay,
                       replay_fraction=fraction), seen, fake


def test_resampling_rounds_fill_the_batch_with_valid_groups_and_report_spend():
    """Rounds of 2 prompts until 3 groups have reward variance: round 0 keeps 1, round 1 keeps 1,
    round 2 keeps 2 (one unused). The update gets exactly groups 0, 3, 4 (round-major) of the
    sampled rows, all valid, and the spend is rounds 3, sampled 6, kept 4, unused 1, padded 0.
    Catches: gathering the wrong rows, stopping before the batch is full, or wrong spend counts."""
    rounds = [[[1, 0], [1, 1]], [[0, 0], [0, 1]], [[1, 0], [1, 0]]]
    batcher, seen, fake = _batcher(rounds, Rounds(2, 4, True))
    _, metrics, _ = batcher.step(FakeState(), key=jax.random.key(0))
    assert fake.calls == 3
    all_rows = np.concatenate([np.asarray(r, np.float32).reshape(-1) for r in rounds]).reshape(-1, N)
    np.testing.assert_array_equal(seen[0].rewards_b.reshape(-1, N), all_rows[[0, 3, 4]])
    assert seen[0].loss_mask_bt.any(axis=1).all()
    np.testing.assert_array_equal(seen[0].sampler_logp_bt[:, -1], [-1, -2, -103, -104, -201, -202])
    assert {k: metrics[f"rollout/resample_{k}"] for k in ("rounds", "sampled", "kept", "unused", "padded")} == \
        {"rounds": 3, "sampled": 6, "kept": 4, "unused": 1, "padded": 0}
    assert metrics["rollout/tokens"] == 3 * 2 * N * C
    assert metrics["rollout/a/samples"] + metrics["rollout/b/samples"] == 6 * N


def test_remax_resampling_keeps_groups_whose_samples_all_differ_from_the_greedy_reward():
    """Under ReMax the host loop hands each round's greedy rewards to the resampler: round 0's
    groups agree among themselves, but group 0's samples all miss where its greedy answer is right
    (advantage -1 on each), so it is kept and group 1 (equal to its greedy reward) is dropped;
    round 1 keeps both. The update sees groups 0, 2, 3. Catches: the variance test under ReMax (it
    would keep only round 1's mixed group and pad the batch after the cap)."""
    batcher, seen, fake = _batcher([[[0, 0], [1, 1]], [[1, 0], [0, 0]]], Rounds(2, 2, True), baselines=[[1, 1], [0, 1]])
    _, metrics, _ = batcher.step(FakeState(), key=jax.random.key(0))
    assert fake.calls == 2 and metrics["rollout/resample_padded"] == 0 and metrics["rollout/resample_kept"] == 3
    np.testing.assert_array_equal(seen[0].rewards_b, [0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(seen[0].baseline_rewards_b, [1, 1, 0, 0, 1, 1])
    assert seen[0].loss_mask_bt.any(axis=1).all()


def test_resampling_at_the_cap_pads_with_masked_groups():
    """With too few informative groups within the cap, the batch is topped up with dropped groups
    whose loss masks are all False, and `padded` says how many.
    Catches: filler groups that train, or a batch of the wrong size."""
    batcher, seen, _ = _batcher([[[1, 1], [1, 0]], [[0, 0], [1, 1]]], Rounds(2, 2, True))
    _, metrics, _ = batcher.step(FakeState(), key=jax.random.key(0))
    assert metrics["rollout/resample_padded"] == 2 and seen[0].rewards_b.shape == (3 * N,)
    np.testing.assert_array_equal(seen[0].loss_mask_bt.any(axis=1), [True, True, False, False, False, False])


def test_replayed_rows_reach_the_update_with_their_behaviour_logprobs():
    """One prompt, two groups per step. Step 1: group 0 solves 1 of 2 (a hard prompt: its success is
    stored). Step 2: both groups fail, and the update sees the stored row (step 1's tokens and
    behaviour log-probs, reward 1) as the last row of each group; the fresh rows are untouched.
    Catches: replay after the update, replaying fresh log-probs, or storing the mixed rows."""
    replay = ReplayBuffer(capacity=4, row_len=WIDTH + C, per_prompt=1, max_pass_rate=0.6)
    batcher, seen, _ = _batcher([[[1, 0], [0, 0]], [[0, 0], [0, 0]]], Rounds(2, 1, False), replay, 1.0, 2,
                                sources=[MixtureSource("a", _examples("a", 1), ())])
    _, m1, _ = batcher.step(FakeState(), key=jax.random.key(0))
    _, m2, _ = batcher.step(FakeState(), key=jax.random.key(1))
    assert m1["replay/size"] == 1 and m2["replay/rows_mixed"] == 2 and m2["replay/size"] == 1
    got = seen[1]
    np.testing.assert_array_equal(got.rewards_b, [0, 1, 0, 1])
    np.testing.assert_array_equal(got.sampler_logp_bt[:, -1], [-101, -1, -103, -1])  # step 1, row 0
    np.testing.assert_array_equal(got.tokens_bt[:, -1], [4, 3, 4, 3])  # step 2's token vs step 1's


def test_gather_groups_takes_rows_in_group_order():
    """gather_groups picks rows g*n..g*n+n-1 of the concatenated rounds and renumbers groups; the
    greedy-baseline rewards (ReMax, the learn_*.toml recipe's objective) travel with their rows.
    Catches: an off-by-one in the row arithmetic, group ids that keep round positions, or the
    baseline dropped or left in round order."""
    fake = FakeSampler([[[0, 1], [1, 1]], [[1, 0], [0, 0]]], [[7, 6], [5, 4]])
    tokens = np.ones((2, WIDTH), np.int32)
    b0, _, _ = fake(None, tokens, tokens.astype(bool), None, None)
    b1, _, _ = fake(None, tokens, tokens.astype(bool), None, None)
    out = gather_groups([b0, b1], [2, 0], [True, False], N)
    np.testing.assert_array_equal(out.rewards_b, [1, 0, 0, 1])
    np.testing.assert_array_equal(out.baseline_rewards_b, [5, 5, 7, 7])  # ReMax's greedy rewards follow their rows
    np.testing.assert_array_equal(out.group_ids_b, [0, 0, 1, 1])
    np.testing.assert_array_equal(out.loss_mask_bt.any(1), [True, True, False, False])


# ----------------------------------------------------------------------------- warm start


@pytest.mark.parametrize("accs,target,patience,want", [
    ([0.1, 0.2, 0.31], 0.3, 0, "target"),
    ([0.1, 0.2, 0.2, 0.205, 0.2], 0.9, 3, "plateau"),
    ([0.0, 0.0, 0.0, 0.02], 0.9, 3, None),  # still rising by min_delta
    ([0.1, 0.1, 0.1, 0.1], 0.9, 0, None),  # no patience: only the budgets stop it
])
def test_warm_start_stops_on_target_or_plateau(accs, target, patience, want):
    """stop_reason: target reached, or no +min_delta on the best in `patience` checks.
    Catches: a plateau rule comparing with the last check instead of the best, or one that
    fires while accuracy still rises."""
    assert stop_reason(accs, target=target, patience=patience, min_delta=0.01) == want


# ----------------------------------------------------------------------------- resume


TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=16", "eval.size=8", "eval.every=100", "warm_start.steps=0",
        "rl.prompts_per_iteration=4", "sampling.num_samples=2", "sampling.max_new_tokens=3",
        "metrics.tensorboard=false", "metrics.progress_bar=false", "mesh.devices=1", "checkpoint.every=2",
        "checkpoint.keep_last=2", "data.selection=bandit", "data.selection_options={algorithm='thompson'}",
        "data.sources=[{task='chain_sum', size=40, eval_size=8, task_kwargs={min_terms=2, max_terms=2, "
        "min_digits=1, max_digits=1}}, {task='chain_sum', level=2, size=40, eval_size=8, fresh=true}]",
        "rl.replay.capacity=8", "algorithm.recompute_old_logp=true", "algorithm.off_policy='tis'",
        "rl.iterations=4"]


def test_resumed_mixture_makes_the_same_selections(tmp_path, capsys):
    """A 4-iteration mixture run (Thompson bandit, a fresh source, replay) and the same run
    restarted from its step-2 checkpoint choose the same tasks and end with the same data state;
    `rljax eval` on its last checkpoint reports the loop's greedy accuracies, overall and per task.
    Catches: selection state, stream positions or the replay buffer missing from the checkpoint,
    choices drawn from an unseeded generator, or `rljax eval` building a single-source held-out
    set or an unrouted reward for a mixture."""
    from rljax.train.loop import train

    full = tmp_path / "full"
    result = train(load_config(None, TINY + [f"output_dir='{full}'"]), log=lambda *_: None)
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    again = train(load_config(None, TINY + [f"output_dir='{resumed}'"]), resume=True, log=lambda *_: None)

    def after_restart(history):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in history if r["step"] > 2]

    picks = after_restart(result.history)
    assert after_restart(again.history) == picks and len(picks) == 2
    assert any(k.startswith("selection/") for k in picks[0]) and "replay/size" in picks[0]
    files = [d / "checkpoints" / "4" / "data" / "metadata" for d in (full, resumed)]
    state = [json.loads(f.read_text()) for f in files]
    assert state[0] == state[1] and state[0]["mixture"]["streams"][1]["next_index"] > 0

    # `rljax eval` on the mixture's checkpoint: every source's held-out problems, routed rewards,
    # the loop's own greedy accuracies (overall and per task) at that step.
    from rljax.cli import main

    main(["eval", str(full), "--step", "4", "--samples", "1", "--seeds", "1"])
    report = json.loads(capsys.readouterr().out)
    last = result.history[-1]
    per_task = {k.removeprefix("eval/").removesuffix("/accuracy"): v for k, v in last.items()
                if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2}
    from rljax.train import setup

    cfg = load_config(None, TINY + [f"output_dir='{full}'"])
    sources = setup.build_sources(cfg.data)
    held_out = sum(len(s.held_out[:cfg.eval.size]) for s in sources)  # level 2 prompts run over the limit
    assert report["problems"] + report["prompts_too_long"] == held_out and report["problems"] > 0
    assert per_task and report["greedy_accuracy"] == pytest.approx(last["eval/accuracy"])
    assert {k.removeprefix("greedy_accuracy/"): v for k, v in report.items()
            if k.startswith("greedy_accuracy/")} == pytest.approx(per_task)
