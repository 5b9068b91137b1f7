"""Task-selection policies (rljax/data/selection.py) against NumPy references written here."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from rljax.data.selection import GroupStats, group_stats, make_policy
from rljax.errors import ConfigError

# A fixed stream of 6 batches over 3 tasks: (task ids per group, mean |A| per group, pass rate per group).
STREAM_RNG = np.random.default_rng(1234)
STREAM = [(STREAM_RNG.integers(0, 3, size=5), STREAM_RNG.uniform(0, 1, size=5),
           STREAM_RNG.integers(0, 5, size=5) / 4.0) for _ in range(6)]
GROUP_SIZE = 4


def _stats(abs_adv_g, pass_rate_g, prompt_ids=None):
    return GroupStats(pass_rate_g=pass_rate_g, abs_adv_g=abs_adv_g, prompt_ids_g=prompt_ids, group_size=GROUP_SIZE)


def _softmax_ref(x, tau):
    e = np.exp((np.asarray(x) - np.max(x)) / tau)
    return e / e.sum()


def test_group_stats_pass_rate_and_abs_advantage():
    """pass_rate = mean[r >= threshold], abs_adv = mean |A| per group.
    Catches: a threshold compared with > instead of >=, or |mean A| instead of mean |A|."""
    rewards = np.array([[1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0]])
    adv = np.array([[1.0, -1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    s = group_stats(rewards, adv, ["a", "b"], correct_threshold=0.5)
    np.testing.assert_array_equal(s.pass_rate_g, [0.75, 0.0])
    np.testing.assert_array_equal(s.abs_adv_g, [0.75, 0.0])
    assert s.prompt_ids_g == ("a", "b") and s.group_size == 4


def test_unknown_policy_and_option_are_one_line_config_errors():
    """Unknown names list the registry; unknown options list the policy's options.
    Catches: a KeyError/TypeError leaking out, or a message that drifts from the registry."""
    with pytest.raises(ConfigError, match="choose one of auto_curriculum, band, bandit, schedule, uniform"):
        make_policy("nope")
    with pytest.raises(ConfigError, match="its options are"):
        make_policy("uniform", temperature=1.0)
    with pytest.raises(ConfigError, match="bandit algorithm"):
        make_policy("bandit", algorithm="exp3").init(3, 0)


def test_uniform_choices_follow_weights_and_seeded_stream():
    """uniform draws from w / sum w with generator default_rng([seed, step]).
    Catches: unnormalised weights, a generator reused across steps, or seeds ignored."""
    policy = make_policy("uniform", weights=(1.0, 3.0, 0.0))
    state = policy.init(3, seed=7)
    ids0, state = policy.choose(state, 64)
    ids1, _ = policy.choose(state, 64)
    p_ref = np.array([0.25, 0.75, 0.0])
    np.testing.assert_array_equal(ids0, np.random.default_rng([7, 0]).choice(3, 64, p=p_ref))
    np.testing.assert_array_equal(ids1, np.random.default_rng([7, 1]).choice(3, 64, p=p_ref))
    assert not np.array_equal(ids0, ids1) and not np.any(ids0 == 2)
    other, _ = policy.choose(policy.init(3, seed=8), 64)
    assert not np.array_equal(ids0, other)


def test_band_keeps_exactly_the_reference_prompts():
    """EMA pass rate per prompt (first visit sets it), keep unseen or low < p < high.
    Catches: an inclusive band, EMA weights swapped, seeding the EMA at 0, unseen prompts dropped."""
    low, high, decay = 0.4, 0.75, 0.5
    policy = make_policy("band", low=low, high=high, decay=decay)
    state = policy.init(3, seed=0)
    ref: dict[str, float] = {}
    prompts = [f"q{i}" for i in range(6)]
    for step, (_, abs_adv, pass_rate) in enumerate(STREAM):
        ids = [prompts[(step + g) % 6] for g in range(5)]
        state = policy.update(state, np.zeros(5, int), _stats(abs_adv, pass_rate, tuple(ids)))
        for key, p in zip(ids, pass_rate):
            ref[key] = p if key not in ref else decay * ref[key] + (1 - decay) * p
    query = prompts + ["unseen"]
    expected = [key not in ref or low < ref[key] < high for key in query]
    np.testing.assert_array_equal(policy.keep(state, query), expected)
    assert 0 < sum(expected) < len(expected)  # the stream exercises both outcomes
    assert high in ref.values()  # and a prompt exactly on the band's edge (dropped: the band is strict)
    np.testing.assert_allclose([state.pass_ema[k] for k in prompts], [ref[k] for k in prompts], rtol=1e-12)


def test_band_evicts_least_recently_updated_prompt():
    """The table keeps at most max_prompts prompts, dropping the least recently updated.
    Catches: unbounded growth (checkpoints grow forever) or evicting the newest prompt."""
    policy = make_policy("band", max_prompts=2)
    state = policy.init(1, seed=0)
    for key in ("a", "b", "a", "c"):
        state = policy.update(state, [0], _stats(np.zeros(1), np.array([1.0]), (key,)))
    assert list(state.pass_ema) == ["a", "c"]


def _bandit_reference(stream, window, algorithm, c=1.0, tau=0.1, alpha=0.5):
    """Per-step choice probabilities of DUMP's UCB or SEC's Boltzmann TD(0), from scratch."""
    wins = [collections.deque(maxlen=window) for _ in range(3)]
    n = np.zeros(3)
    q = np.zeros(3)
    probs = []
    for task_ids, abs_adv, _ in stream:
        for j in range(3):
            sel = abs_adv[task_ids == j]
            if len(sel):
                wins[j].extend(sel)
                n[j] += len(sel) * GROUP_SIZE
                q[j] = alpha * sel.mean() + (1 - alpha) * q[j]
        mu = np.array([np.mean(w) if w else 0.0 for w in wins])
        if algorithm == "ucb":
            probs.append(_softmax_ref(mu + c * np.sqrt(2 * np.log(n.sum() + 1) / (n + 1)), tau))
        else:
            probs.append(_softmax_ref(q, tau))
    return probs


@pytest.mark.parametrize("algorithm,kw", [("ucb", dict(window=3, exploration=1.0, temperature=0.1)),
                                          ("boltzmann", dict(learning_rate=0.5, temperature=0.1))])
def test_bandit_update_matches_numpy_reference(algorithm, kw):
    """UCB_j = mu_j + c sqrt(2 ln(N+1)/(n_j+1)) over a 3-group window (DUMP), or Q <- a r + (1-a) Q
    (SEC), then softmax(./tau), after every batch of the fixed stream.
    Catches: a window that never slides, counting groups instead of samples, updating tasks
    absent from the batch, or a missing temperature."""
    policy = make_policy("bandit", algorithm=algorithm, **kw)
    state = policy.init(3, seed=0)
    ref = _bandit_reference(STREAM, window=3, algorithm=algorithm)
    for (task_ids, abs_adv, pass_rate), p_ref in zip(STREAM, ref):
        state = policy.update(state, task_ids, _stats(abs_adv, pass_rate))
        np.testing.assert_allclose(policy.probs(state), p_ref, rtol=1e-12, atol=1e-15)
    ids, _ = policy.choose(state, 32)
    np.testing.assert_array_equal(ids, np.random.default_rng([0, 0]).choice(3, 32, p=ref[-1]))


def test_bandit_thompson_matches_numpy_reference():
    """theta_j ~ N(mu_j, sigma^2 / (m_j + 1)) per slot, argmax_j, from default_rng([seed, step]).
    Catches: a posterior that does not narrow with data, or draws shared across slots."""
    policy = make_policy("bandit", algorithm="thompson", window=4, sigma=0.3)
    state = policy.init(3, seed=5)
    wins = [collections.deque(maxlen=4) for _ in range(3)]
    for step, (task_ids, abs_adv, pass_rate) in enumerate(STREAM[:3]):
        ids, state = policy.choose(state, 16)
        mu = np.array([np.mean(w) if w else 0.0 for w in wins])
        scale = 0.3 / np.sqrt(np.array([len(w) for w in wins]) + 1.0)
        ref = np.argmax(np.random.default_rng([5, step]).normal(mu, scale, size=(16, 3)), axis=1)
        np.testing.assert_array_equal(ids, ref)
        state = policy.update(state, task_ids, _stats(abs_adv, pass_rate))
        for j in range(3):
            wins[j].extend(abs_adv[task_ids == j])


def test_schedule_weights_levels_by_stage():
    """P(j) = w[stage(k), level(j)] / #tasks at that level, the stage switching at each boundary.
    Catches: an off-by-one at a boundary, or level weights not shared among a level's tasks."""
    policy = make_policy("schedule", levels=(2, 1, 1), boundaries=(2, 4),
                         stage_weights=((1.0, 0.0), (1.0, 1.0), (0.0, 1.0)))
    state = policy.init(3, seed=0)
    expected = {0: [0, .5, .5], 1: [0, .5, .5], 2: [.5, .25, .25], 3: [.5, .25, .25], 4: [1, 0, 0]}
    for k, p_ref in expected.items():
        np.testing.assert_allclose(policy.probs(state), p_ref, rtol=1e-12)
        _, state = policy.choose(state, 4)


def test_auto_curriculum_starts_in_band_and_moves_up():
    """calibrate: lowest level with low <= p <= high, else hardest above the band, else easiest;
    update: EMA at the current level, move up once seen >= min_groups and EMA > advance_at.
    Catches: starting at a level that is too easy, advancing on stale groups from another level,
    or advancing before min_groups."""
    levels, families = (1, 2, 3, 1, 2, 3), ("a", "a", "a", "b", "b", "b")
    policy = make_policy("auto_curriculum", levels=levels, families=families, low=0.1, high=0.9,
                         advance_at=0.6, decay=0.5, min_groups=2, probe=0.0)
    state = policy.calibrate(policy.init(6, seed=0), [0.95, 0.5, 0.05, 0.95, 0.97, 0.0])
    assert policy.level_of(state) == {"a": 2, "b": 2}  # a: level 2 in band; b: none, hardest above it
    np.testing.assert_allclose(policy.probs(state), [0, .5, 0, 0, .5, 0])
    # family a at level 2 (task 1): pass rates 0.9, then a stale level-1 group, then 0.4, 0.9
    ref_rate, ref_seen, ref_level = None, 0, 2
    for task, p in [(1, 0.9), (0, 1.0), (1, 0.4), (1, 0.9)]:
        state = policy.update(state, [task], _stats(np.zeros(1), np.array([p])))
        if levels[task] == ref_level:
            ref_rate = p if ref_rate is None else 0.5 * ref_rate + 0.5 * p
            ref_seen += 1
            if ref_seen >= 2 and ref_rate > 0.6:
                ref_level, ref_rate, ref_seen = ref_level + 1, None, 0
        assert policy.level_of(state)["a"] == ref_level and state.rate["a"] == ref_rate
    assert ref_level == 3  # EMA 0.9 -> 0.65 (advances at 2 groups) -> level 3


def test_auto_curriculum_probes_the_next_level_before_moving_up():
    """With probe = 0.25 a family spends a quarter of its prompts on its next level and moves up
    only once that level's EMA pass rate is >= low over >= min_groups groups, carrying the EMA
    over; a reference loop written from the rule gives the same levels and rates after every group.
    Catches: moving up on mastery alone (decimal_chain_sum's level 2 passed 3-5% of samples and
    taught nothing for 350 iterations), probe groups counted as current-level groups, or the
    probe EMA dropped on the move."""
    levels = (1, 2, 3)
    policy = make_policy("auto_curriculum", levels=levels, low=0.1, high=0.9, advance_at=0.6, decay=0.5,
                         min_groups=2, probe=0.25)
    state = policy.calibrate(policy.init(3, seed=0), [0.5, 0.02, 0.0])
    np.testing.assert_allclose(policy.probs(state), [0.75, 0.25, 0.0])
    ref = {"level": 0, "rate": None, "seen": 0, "next_rate": None, "next_seen": 0}
    ema = lambda old, p: p if old is None else 0.5 * old + 0.5 * p  # noqa: E731
    stream = [(0, 0.9), (0, 0.9), (1, 0.0), (1, 0.05), (0, 1.0), (1, 0.3), (1, 0.4), (0, 0.9), (2, 0.5), (1, 0.9)]
    moved_at = []
    for k, (task, p) in enumerate(stream):
        state = policy.update(state, [task], _stats(np.zeros(1), np.array([p])))
        if task == ref["level"] + 1 and ref["level"] + 1 < 3:
            ref["next_rate"], ref["next_seen"] = ema(ref["next_rate"], p), ref["next_seen"] + 1
        elif task == ref["level"]:
            ref["rate"], ref["seen"] = ema(ref["rate"], p), ref["seen"] + 1
            if (ref["seen"] >= 2 and ref["rate"] > 0.6 and ref["level"] + 1 < 3 and ref["next_seen"] >= 2
                    and ref["next_rate"] >= 0.1):
                ref = {"level": ref["level"] + 1, "rate": ref["next_rate"], "seen": ref["next_seen"],
                       "next_rate": None, "next_seen": 0}
                moved_at.append(k)
        assert policy.level_of(state)["all"] == levels[ref["level"]]
        assert (state.rate["all"], state.seen["all"], state.next_rate["all"], state.next_seen["all"]) == \
            (ref["rate"], ref["seen"], ref["next_rate"], ref["next_seen"])
    # level 1 was mastered at group 1 but level 2 read 0.025 (< low): no move until it read 0.16 (group 5),
    # then at the next level-1 group (7); the move carries 0.28, and group 9 makes it 0.5 * 0.28 + 0.45
    assert moved_at == [7] and state.rate["all"] == pytest.approx(0.590625)
    np.testing.assert_allclose(policy.probs(state), [0.0, 0.75, 0.25])


def test_auto_curriculum_steps_its_ema_once_per_call_on_the_mean():
    """One update call (an RL iteration) moves the EMA once, by the mean pass rate of the call's
    groups at each level: 60 groups at 0.0 then 4 at 1.0 read 0.0625, not mastery. Reference: the
    EMA written from the rule, call by call. Catches: stepping the EMA per group, which with decay
    0.5 reads 0.94 after the 4 easy groups and moves the family up at a 6% pass rate, or one mean
    over two families or over a level and its probe."""
    policy = make_policy("auto_curriculum", levels=(1, 2), low=0.1, high=0.9, advance_at=0.7, decay=0.5,
                         min_groups=16, probe=0.0)
    state = policy.calibrate(policy.init(2, seed=0), [0.3, 0.0])
    calls = [np.r_[np.zeros(60), np.ones(4)], np.r_[np.full(32, 0.5), np.ones(32)], np.full(64, 0.9), np.full(64, 0.9)]
    ref_rate, moves = None, []
    for k, pass_g in enumerate(calls):
        state = policy.update(state, np.zeros(64, np.int64), _stats(np.zeros(64), pass_g))
        ref_rate = pass_g.mean() if ref_rate is None else 0.5 * ref_rate + 0.5 * pass_g.mean()
        if ref_rate > 0.7:
            moves.append(k)
            break
        assert state.rate["all"] == pytest.approx(ref_rate) and state.seen["all"] == 64 * (k + 1)
    assert moves == [3] and policy.level_of(state)["all"] == 2  # 0.0625 -> 0.40625 -> 0.653 -> 0.777
    # two families and a probe in one call: each level of each family steps on its own groups' mean
    policy = make_policy("auto_curriculum", levels=(1, 2, 1, 2), families=("a", "a", "b", "b"), decay=0.5,
                         min_groups=16, probe=0.25)
    state = policy.update(policy.init(4, seed=0), np.array([0, 0, 1, 2, 2, 3]),
                          _stats(np.zeros(6), np.array([1.0, 0.5, 0.25, 0.0, 0.5, 1.0])))
    assert (state.rate, state.seen) == ({"a": 0.75, "b": 0.25}, {"a": 2, "b": 2})
    assert (state.next_rate, state.next_seen) == ({"a": 0.25, "b": 1.0}, {"a": 1, "b": 1})


POLICY_CASES = [
    ("uniform", dict(weights=(1.0, 2.0, 1.0))),
    ("band", dict(low=0.1, high=0.9)),
    ("bandit", dict(algorithm="ucb", window=4)),
    ("bandit", dict(algorithm="boltzmann")),
    ("bandit", dict(algorithm="thompson")),
    ("schedule", dict(levels=(1, 2, 3), boundaries=(2,), stage_weights=((1.0, 1.0, 0.0), (0.0, 1.0, 1.0)))),
    ("auto_curriculum", dict(levels=(1, 2, 3), min_groups=2, advance_at=0.3, decay=0.5)),
]


def _run(policy, state, steps):
    """Choose, score with a fixed per-task success probability, update; the choices made."""
    chosen = []
    for _ in range(steps):
        ids, state = policy.choose(state, 6)
        rng = np.random.default_rng(int(ids.sum()) + 100 * state.step)
        rewards = (rng.uniform(size=(6, GROUP_SIZE)) < np.array([0.9, 0.5, 0.1])[ids, None]).astype(float)
        adv = rewards - rewards.mean(axis=1, keepdims=True)
        prompts = [f"t{j}-{k}" for j, k in zip(ids, rng.integers(0, 3, 6))]
        state = policy.update(state, ids, group_stats(rewards, adv, prompts))
        chosen.append(ids)
    return chosen, state


@pytest.mark.parametrize("name,kw", POLICY_CASES, ids=[f"{n}-{kw.get('algorithm', '')}" for n, kw in POLICY_CASES])
def test_resume_mid_stream_makes_identical_choices(name, kw):
    """A run saved to JSON after 3 batches and restored into a fresh policy object makes the
    same next 3 choices as an uninterrupted run, and the same seed gives the same run.
    Catches: state outside the dataclass (an RNG object, a cache), or lossy JSON (tuples, None)."""
    policy = make_policy(name, **kw)
    full, _ = _run(policy, policy.init(3, seed=11), 6)
    again, _ = _run(policy, policy.init(3, seed=11), 6)
    head, state = _run(policy, policy.init(3, seed=11), 3)
    restored = make_policy(name, **kw).load_state(json.loads(json.dumps(policy.state_dict(state))))
    assert restored == state
    tail, _ = _run(policy, restored, 3)
    np.testing.assert_array_equal(np.stack(full), np.stack(head + tail))
    np.testing.assert_array_equal(np.stack(full), np.stack(again))
