"""Turn-level credit for multi-turn episodes (`env.credit = "turn"`, issue 21): the estimator
against a NumPy reference written from its formula, masks and denominators, episode credit left
as it was, the one-line errors, and one fused episode iteration.

Hand-built episodes (no model) serve every test but the last, which compiles one fused episode
iteration with scripted turns.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.models as M
from rljax import envs
from rljax.envs import ENV, FORMATS, MODEL, PAD
from rljax.errors import ConfigError
from rljax.objectives import AGGREGATIONS, POLICY_LOSSES, AlgorithmConfig, RewardShaping, aggregate
from rljax.objectives.advantages import grpo
from rljax.optim import OptimConfig
from rljax.rewards.pool import VerifierPool
from rljax.sampling import SampleControls
from rljax.sampling import multiturn as MT
from rljax.tokenizers.char import CharTokenizer
from rljax.train.config import load_config
from rljax.envs.config import EnvConfig as EpisodeOptions
from rljax.sampling.episode_host import EpisodeHost
from rljax.stages.episodes import episodes_to_batch, make_episode_iteration
from rljax.update import init_train_state, prepare_batch

TOK = CharTokenizer("0123456789+-*= <>/.tolresuhangdi")
CFG = M.preset("qwen2-test", vocab_size=TOK.vocab_size)
GAMMA = 0.5

# Hand-built episodes, 3 groups of 3 (prompt-major), each a list of (author, tokens, turn) segments
# and the per-turn rewards r_k (-0.1: a tool-error penalty from a turn-reward hook).
# Group 0: 3, 2 and 1 turns; turn 2 reached by one episode only (A = 0 there).
# Group 1: row 4's observation was empty (turns 0 and 1 touch); row 5 has a void turn (filtered
# from the loss, still in its group's baselines).
# Group 2: every turn index has equal returns (zero variance: A = 0).
SEGMENTS = [
    [(MODEL, 2, 0), (ENV, 2, 0), (MODEL, 2, 1), (ENV, 1, 1), (MODEL, 2, 2)],
    [(MODEL, 3, 0), (ENV, 2, 0), (MODEL, 2, 1)],
    [(MODEL, 4, 0)],
    [(MODEL, 2, 0), (ENV, 2, 0), (MODEL, 3, 1)],
    [(MODEL, 2, 0), (MODEL, 3, 1)],
    [(MODEL, 2, 0), (ENV, 2, 0), (MODEL, 1, 1), (ENV, 1, 1), (MODEL, 2, 2)],
    [(MODEL, 2, 0), (ENV, 1, 0), (MODEL, 2, 1)],
    [(MODEL, 2, 0), (ENV, 1, 0), (MODEL, 2, 1)],
    [(MODEL, 3, 0)],
]
TURN_REWARDS = np.array([[-0.1, 0, 1], [0, 1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0], [-0.1, 0, 0],
                         [0, 1, 0], [0, 1, 0], [0.5, 0, 0]], np.float32)
VOID = np.array([0, 0, 0, 0, 0, 1, 0, 0, 0], np.int32)
N_SAMPLES, N_COLS, P_COLS = 3, 10, 2


def hand_built_episodes() -> MT.Episodes:
    b = len(SEGMENTS)
    author = np.full((b, N_COLS), PAD, np.int32)
    turn = np.full((b, N_COLS), -1, np.int32)
    for r, segments in enumerate(SEGMENTS):
        c = 0
        for who, n, k in segments:
            author[r, c:c + n], turn[r, c:c + n] = who, k
            c += n
    rng = np.random.default_rng(0)
    tokens = np.where(author != PAD, rng.integers(1, CFG.vocab_size, (b, N_COLS)), 0).astype(np.int32)
    zeros_b = np.zeros(b, np.int32)
    return MT.Episodes(
        tokens_bn=tokens, author_bn=author, turn_bn=turn, logprobs_bn=np.zeros((b, N_COLS), np.float32),
        sampling_logprobs_bn=np.zeros((b, N_COLS), np.float32), lengths_b=(author != PAD).sum(1).astype(np.int32),
        finish_b=zeros_b, rewards_b=TURN_REWARDS.sum(1), turn_rewards_bk=TURN_REWARDS,
        turns_b=(turn.max(1) + 1).astype(np.int32), tool_calls_b=zeros_b, tool_errors_b=zeros_b, void_turns_b=VOID,
        decode_steps=np.int32(N_COLS), live_row_steps=np.int32(0))


def reference_turn_advantages(turn_rewards_bk, turn_bt, group_b, keep_b, gamma, std_normalize, eps):
    """NumPy, from the formula: G_{i,k} = sum_{j>=k} gamma^(j-k) r_{i,j}; every token of turn k of
    a kept episode i gets (G_{i,k} - mean_R G_{.,k}) / (std_R G_{.,k} + eps) over R = the episodes
    of i's group that reached turn k, or 0 when R has one episode or equal returns."""
    b, k_max = turn_rewards_bk.shape
    g = np.array([[sum(gamma ** (j - k) * float(turn_rewards_bk[i, j]) for j in range(k, k_max))
                   for k in range(k_max)] for i in range(b)])
    reached = np.array([[bool((turn_bt[i] == k).any()) for k in range(k_max)] for i in range(b)])
    adv = np.zeros(turn_bt.shape)
    for i, t in zip(*np.nonzero(turn_bt >= 0)):
        k = turn_bt[i, t]
        peers = [j for j in range(b) if group_b[j] == group_b[i] and reached[j, k]]
        values = g[peers, k]
        if not keep_b[i] or len(peers) < 2 or values.max() == values.min():
            continue
        adv[i, t] = g[i, k] - values.mean()
        if std_normalize:
            adv[i, t] /= values.std(ddof=1) + eps
    return adv, g


def _batch(credit: str, gamma: float = GAMMA):
    e = jax.tree.map(jnp.asarray, hand_built_episodes())
    groups = len(SEGMENTS) // N_SAMPLES
    prompt = jnp.ones((groups, P_COLS), jnp.int32)
    options = EpisodeOptions(max_turns=3, max_episode_tokens=N_COLS, turn_discount=gamma, credit=credit)
    return episodes_to_batch(prompt, jnp.ones((groups, P_COLS), bool), e, num_samples=N_SAMPLES,
                             options=options).batch


@pytest.fixture(scope="module")
def params():
    return M.init_params(CFG, jax.random.key(0))


def _state(params, **algo):
    return init_train_state(CFG, params, AlgorithmConfig(**{"kl_coef": 0.0, **algo}),
                            OptimConfig(learning_rate=1e-3))


def test_turn_advantages_match_a_numpy_reference_with_env_tokens_out_of_every_denominator(params):
    """Hand-built episodes of 1-3 turns, unequal turn counts within a group, gamma = 0.5 and a
    per-turn penalty, through `episodes_to_batch(credit="turn")` and the update's own
    `prepare_batch` (grpo, and dr_grpo without the std): per-token advantages equal the NumPy
    reference; the batch's turns are the sampler's (an empty observation does not merge two
    turns); env, prompt and padding tokens get exactly 0, and under every aggregation mode the
    policy-gradient loss's gradient is exactly 0 there and equals the NumPy -A m / denominator on
    model tokens (denominators from the model tokens of kept rows only).

    Catches: a baseline over the whole group instead of the episodes that reached the turn, a
    return discounted from the wrong end or not at all, turns read from the author runs (row 4
    merged), env tokens given an advantage or counted in a denominator, the void-filtered row
    trained on or dropped from its group's baselines, and std_normalize ignored."""
    batch = _batch("turn")
    e = hand_built_episodes()
    turn_bt = np.concatenate([np.full((len(SEGMENTS), P_COLS), -1), np.where(e.author_bn == MODEL, e.turn_bn, -1)], 1)
    np.testing.assert_array_equal(np.asarray(batch.turn_returns.turn_bt), turn_bt)
    group_b = np.repeat(np.arange(len(SEGMENTS) // N_SAMPLES), N_SAMPLES)
    mask = np.asarray(batch.loss_mask_bt)
    for algorithm, std_normalize in (("grpo", True), ("dr_grpo", False)):
        state = _state(params, algorithm=algorithm, aggregation="token-mean")
        prepared, _ = prepare_batch(state, batch)
        want, g = reference_turn_advantages(TURN_REWARDS, turn_bt, group_b, VOID == 0, GAMMA, std_normalize,
                                            state.algo.eps)
        np.testing.assert_allclose(np.asarray(batch.turn_returns.returns_bk), g, rtol=1e-6, atol=1e-7)
        adv = np.asarray(prepared.advantages_bt)
        np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
        assert np.all(adv[turn_bt < 0] == 0.0) and np.all(adv[5] == 0.0)
    assert len({round(float(a), 5) for a in want[0][turn_bt[0] >= 0]}) == 3  # row 0: a value per turn

    logp = jnp.asarray(prepared.old_logp_bt) - 0.1
    n_b = mask.sum(1)
    rows = (n_b > 0).sum()
    per_mode = {"token-mean": np.full_like(adv, mask.sum()), "token-sum": np.ones_like(adv),
                "seq-mean-token-mean": np.repeat(np.maximum(n_b, 1)[:, None], mask.shape[1], 1) * rows,
                "seq-mean-token-sum": np.full_like(adv, rows),
                "seq-mean-token-sum-norm": np.full_like(adv, rows * N_COLS)}
    assert set(per_mode) == set(AGGREGATIONS.names())
    for mode, den in per_mode.items():
        def objective(lp, mode=mode):
            loss_bt, _ = POLICY_LOSSES.get("pg")(lp, prepared.old_logp_bt, prepared.advantages_bt,
                                                 prepared.loss_mask_bt)
            return aggregate(loss_bt, prepared.loss_mask_bt, mode, norm_length=N_COLS)

        grad = np.asarray(jax.grad(objective)(logp))
        assert np.all(grad[~mask] == 0.0), mode
        np.testing.assert_allclose(grad, -np.exp(-0.1) * adv * mask / den, rtol=1e-5, atol=1e-7, err_msg=mode)


def test_episode_credit_is_unchanged(params):
    """`credit="episode"` (the default) attaches no turn returns, and the update's advantages are
    bit for bit those of the registry's grpo called as before turn credit existed (no turn
    keywords): one advantage per episode, from its discounted return.

    Catches: turn data attached or passed to the estimator under episode credit, and grpo
    entering its turn path when given no turns."""
    assert EpisodeOptions().credit == "episode"
    batch = _batch("episode")
    assert batch.turn_returns is None
    prepared, _ = prepare_batch(_state(params, algorithm="grpo"), batch)
    mask = batch.loss_mask_bt.astype(jnp.float32)
    old = grpo(batch.rewards_b, batch.group_ids_b, mask, std_normalize=True, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(prepared.advantages_bt), np.asarray(old))
    np.testing.assert_allclose(np.asarray(batch.rewards_b), [0.15, 0.5, 0, 0.5, 0, -0.1, 0.5, 0.5, 0.5], atol=1e-7)


def test_turn_credit_refuses_what_it_cannot_use_in_one_line(params):
    """`env.credit="turn"` with an estimator that takes one reward per row (rloo), with the KL
    folded into the reward, or with length shaping (which reaches only the episode reward), and
    an unknown credit, are one-line ConfigErrors naming the fix.

    Catches: turn returns silently ignored by an estimator or by the shaping, and an unknown
    credit mode accepted."""
    batch = _batch("turn")
    with pytest.raises(ConfigError, match="env.credit='turn' needs an advantage") as err:
        prepare_batch(_state(params, algorithm="rloo"), batch)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="kl_in_reward"):
        prepare_batch(init_train_state(CFG, params, AlgorithmConfig(algorithm="grpo", kl_coef=0.01,
                                                                    kl_in_reward=True),
                                       OptimConfig(learning_rate=1e-3)), batch)
    state = init_train_state(CFG, params, AlgorithmConfig(algorithm="grpo", kl_coef=0.0),
                             OptimConfig(learning_rate=1e-3), shaping=RewardShaping(length_penalty=0.1))
    with pytest.raises(ConfigError, match="shaping"):
        prepare_batch(state, batch)
    with pytest.raises(ConfigError, match="credit"):
        EpisodeOptions(credit="token")
    with pytest.raises(ConfigError, match="credit"):
        load_config(None, ["env.credit=token"])
    assert load_config(None, ["env.credit=turn"]).env.credit == "turn"
    # refused at load, before any warm start, when the run has an env
    assert load_config("tool_products", ["env.credit=turn"]).env.credit == "turn"
    for override, match in (("algorithm.algorithm=rloo", "needs an advantage"),
                            ("shaping.length_penalty=0.1", "shaping")):
        with pytest.raises(ConfigError, match=match) as err:
            load_config("tool_products", ["env.credit=turn", override])
        assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- one fused iteration

EOS = "<eos>"


def _observation(output: str) -> str:
    host = EpisodeHost(None, TOK, [], max_observation_tokens=20)
    return TOK.decode(host.observation_ids(FORMATS["tags"].render_observation(output)))


# Two prompts x 3 samples, every turn scripted: (author, text) segments, and the rewards per turn.
TABLE = [{"question": "2*3+1=", "answer": "7"}, {"question": "7*8=", "answer": "56"}]
SCRIPTS = [
    [(MODEL, "<tool>2*3</tool>"), (ENV, _observation("6")), (MODEL, "<tool>6+1</tool>"), (ENV, _observation("7")),
     (MODEL, "7" + EOS)],
    [(MODEL, "<tool>2*3+1</tool>"), (ENV, _observation("7")), (MODEL, "7" + EOS)],
    [(MODEL, "5" + EOS)],
    [(MODEL, "<tool>7*8</tool>"), (ENV, _observation("56")), (MODEL, "56" + EOS)],
    [(MODEL, "<tool>7*8</tool>"), (ENV, _observation("56")), (MODEL, "54" + EOS)],
    [(MODEL, "56" + EOS)],
]
SCRIPT_REWARDS = [[0, 0, 1], [0, 1], [0], [0, 1], [0, 0], [1]]
BUDGET = 72
SCRIPT = np.full((len(SCRIPTS), BUDGET), -1, np.int32)
for _r, _segments in enumerate(SCRIPTS):
    _ids = TOK.encode("".join(text for _, text in _segments))
    SCRIPT[_r, :len(_ids)] = _ids
SCRIPT_J = jnp.asarray(SCRIPT)


def scripted(logits_bv, row_b, step_b):
    """Forces the script's token (a +1e4 logit); the recorded log-prob stays the model's own."""
    want_b = SCRIPT_J[row_b, jnp.minimum(step_b, BUDGET - 1)]
    forced = logits_bv + 1e4 * jax.nn.one_hot(jnp.maximum(want_b, 0), logits_bv.shape[1])
    return jnp.where((want_b >= 0)[:, None], forced, logits_bv)


def test_one_fused_episode_iteration_with_turn_credit(params):
    """One `make_episode_iteration` step with credit="turn" and gamma = 0.5 on scripted episodes
    (3, 2 and 1 turns for one prompt; a right and a wrong answer after the tool for the other):
    the host saw the scripted turn rewards, the params move, and the update's advantage metrics
    (mean, std, max, min over the loss tokens) equal the per-token NumPy reference, in which
    episode 0's turns get different advantages (0, then below 0, then 0: its last turn no sibling
    reached), unlike episode credit's moments.

    Catches: the fused program dropping the turn returns (episode credit's advantages instead),
    turns and returns misaligned between the sampler's rows and the batch, and a turn-credit
    batch that does not trace through the fused rollout -> update program."""
    host = EpisodeHost(envs.make_env("calculator", max_turns=3, scorer_time_limit_s=None), TOK, TABLE,
                       max_observation_tokens=20, pool=VerifierPool(0))
    controls = MT.episode_controls(SampleControls(max_new_tokens=8, eos_ids=TOK.eos_ids, pad_id=TOK.pad_id,
                                                  logits_processor=scripted, num_samples=3),
                                   TOK.encode("</tool>"))
    options = EpisodeOptions(max_turns=3, max_episode_tokens=BUDGET, max_observation_tokens=20,
                             turn_discount=GAMMA, credit="turn")
    width = 8
    prompt_tokens, prompt_mask = np.zeros((2, width), np.int32), np.zeros((2, width), bool)
    for r, example in enumerate(TABLE):
        ids = TOK.encode(example["question"], add_bos=True)
        prompt_tokens[r, width - len(ids):], prompt_mask[r, width - len(ids):] = ids, True
    state = _state(jax.tree.map(jnp.copy, params), algorithm="grpo")
    before = np.asarray(state.params["embed"]).copy()
    iteration = make_episode_iteration(controls, host, options)
    state, metrics, _ = iteration(state, prompt_tokens, prompt_mask, np.arange(2, dtype=np.int32), jax.random.key(0))
    assert [[x.reward for x in row] for row in host.last.results] == SCRIPT_REWARDS
    assert not np.array_equal(np.asarray(state.params["embed"]), before)

    turn_bt = np.full((len(SCRIPTS), BUDGET), -1)
    for r, segments in enumerate(SCRIPTS):
        c, k = 0, 0
        for who, text in segments:
            n = len(TOK.encode(text))
            if who == MODEL:
                turn_bt[r, c:c + n] = k
            else:
                k += 1
            c += n
    rewards = np.zeros((len(SCRIPTS), 3), np.float32)
    for r, row in enumerate(SCRIPT_REWARDS):
        rewards[r, :len(row)] = row
    group_b = np.repeat([0, 1], 3)
    keep = np.ones(len(SCRIPTS), bool)
    want, _ = reference_turn_advantages(rewards, turn_bt, group_b, keep, GAMMA, True, 1e-6)
    episode_want, _ = reference_turn_advantages(rewards, np.where(turn_bt >= 0, 0, -1), group_b, keep, GAMMA,
                                                True, 1e-6)  # every turn read as turn 0: episode credit
    assert want[0][turn_bt[0] == 0][0] == 0.0 and want[0][turn_bt[0] == 1][0] < 0.0
    assert want[0][turn_bt[0] == 2][0] == 0.0
    model = turn_bt >= 0
    for name, fn in (("mean", np.mean), ("std", np.std), ("max", np.max), ("min", np.min)):
        got = float(metrics[f"adv/{name}"])
        np.testing.assert_allclose(got, fn(want[model]), rtol=1e-5, atol=1e-6, err_msg=name)
    assert abs(float(metrics["adv/std"]) - np.std(episode_want[model])) > 1e-2
