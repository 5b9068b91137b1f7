"""Multi-turn episodes in the decode loop: continue equals re-prefill, authors and masks, tool
failures as observations, determinism, and the two drivers agreeing.

One tiny model (qwen2-test over a character vocabulary) and one compiled episode program serve
every test: a logits processor scripts what the model writes where a script is given (rows 0-2,
4-6) and leaves the rest to sampling, and the environment behind the compiled program is swapped
through `SwitchHost`, so no test compiles the program again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from misbehaving_tools import MisbehavingTool

import rljax.models as M
from rljax import envs
from rljax.envs import ENV, FORMATS, MODEL, PAD, ToolEnv
from rljax.objectives import AlgorithmConfig
from rljax.optim import OptimConfig
from rljax.rewards.math import MathAnswer
from rljax.rewards.pool import VerifierPool
from rljax.sampling import SampleControls
from rljax.sampling import multiturn as MT
from rljax.tokenizers.char import CharTokenizer
from rljax.envs.config import EnvConfig as EpisodeOptions
from rljax.sampling.episode_host import EpisodeHost
from rljax.sampling.fp8 import sampler_params
from rljax.stages.episodes import episode_metrics, episodes_to_batch, turn_returns
from rljax.update import init_train_state, prepare_batch
from rljax.update.loss import aggregation_denominator

TOK = CharTokenizer("0123456789+-*= <>/.tolresuhangdi")
EOS = "<eos>"
OPTIONS = EpisodeOptions(max_turns=3, max_episode_tokens=80, max_observation_tokens=20)


def _observation(output: str) -> str:
    """What the host appends for a tool output: the tags format's wrapping, spelt in the
    character vocabulary and cut to the cap with the marker."""
    host = EpisodeHost(None, TOK, [], max_observation_tokens=OPTIONS.max_observation_tokens)
    return TOK.decode(host.observation_ids(FORMATS["tags"].render_observation(output)))


# the pool's error outputs for the hanging and the dying tool (`rljax.envs.runner`); both are cut to
# the same 20 tokens, so a script stays aligned whichever comes, and the test reads them uncut
HANG_ERROR = "error: the tool timed out (exceeded 1.5 s)"
DIE_ERROR = "error: the tool failed (worker process died)"

# (question, answer, [(author, text)...] scripting what the model writes, or None: sampled)
M_, E_ = MODEL, ENV  # short, for the table
ROWS = [
    ("2*3+1=", "7", [(M_, "<tool>2*3</tool>"), (E_, "<result>6</result>"), (M_, "<tool>6+1</tool>"),
                     (E_, "<result>7</result>"), (M_, "7" + EOS)]),
    ("123*456=", "56088", [(M_, "<tool>123*456</tool>"), (E_, "<result>56088</re..."), (M_, "5608" + EOS)]),
    ("7*8=", "56", [(M_, "<tool>7*8</tool>")]),
    ("9*9=", "81", None),
    ("1=", "1", [(M_, "<tool>hang</tool>"), (E_, _observation(HANG_ERROR)), (M_, "1" + EOS)]),
    ("2=", "2", [(M_, "<tool>die</tool>"), (E_, _observation(DIE_ERROR)), (M_, "2" + EOS)]),
    ("3=", "3", [(M_, "<tool>raise</tool>"), (E_, _observation("error: RuntimeError: tool bug")),
                 (M_, "3" + EOS)]),
    ("4=", "4", [(M_, "<tool>1+" + EOS)]),  # a call cut off: a void turn
]
TABLE = [{"question": q, "answer": a} for q, a, _ in ROWS]


def _joined(r: int) -> str:
    return "".join(text for _, text in ROWS[r][2])


def _script() -> np.ndarray:
    script = np.full((len(ROWS), OPTIONS.max_episode_tokens), -1, np.int32)
    for r, (_, _, segments) in enumerate(ROWS):
        if segments is not None:
            ids = TOK.encode(_joined(r))
            script[r, :len(ids)] = ids
    return script


SCRIPT = jnp.asarray(_script())


def scripted(logits_bv, row_b, step_b):
    """Forces the script's token where it has one (a +1e4 logit); the policy log-prob stays the
    model's own (the sampler records it from the raw logits)."""
    want_b = SCRIPT[row_b, jnp.minimum(step_b, SCRIPT.shape[1] - 1)]
    forced = logits_bv + 1e4 * jax.nn.one_hot(jnp.maximum(want_b, 0), logits_bv.shape[1])
    return jnp.where((want_b >= 0)[:, None], forced, logits_bv)


class SwitchHost:
    """The compiled program closes over this object; tests point `inner` at another host."""

    def __init__(self, inner):
        self.inner = inner

    def reset(self, index_b):
        return self.inner.reset(index_b)

    def step(self, *args):
        return self.inner.step(*args)


def calculator_host() -> EpisodeHost:
    env = envs.make_env("calculator", max_turns=OPTIONS.max_turns, scorer_time_limit_s=None)
    return EpisodeHost(env, TOK, TABLE, max_observation_tokens=OPTIONS.max_observation_tokens, pool=VerifierPool(0))


CFG = M.preset("qwen2-test", vocab_size=TOK.vocab_size)
CONTROLS = MT.episode_controls(SampleControls(max_new_tokens=8, eos_ids=TOK.eos_ids, pad_id=TOK.pad_id,
                                              logits_processor=scripted), TOK.encode("</tool>"))
P = 16


def _prompts():
    tokens, mask = np.zeros((len(ROWS), P), np.int32), np.zeros((len(ROWS), P), bool)
    for r, (q, _, _) in enumerate(ROWS):
        ids = TOK.encode(q, add_bos=True)
        tokens[r, P - len(ids):], mask[r, P - len(ids):] = ids, True
    return tokens, mask


PROMPT_TOKENS, PROMPT_MASK = _prompts()
INDEX = np.arange(len(ROWS), dtype=np.int32)
SIZES = dict(budget=OPTIONS.max_episode_tokens, max_turns=OPTIONS.max_turns,
             max_observation_tokens=OPTIONS.max_observation_tokens)


@pytest.fixture(scope="module")
def model():
    params = M.init_params(CFG, jax.random.key(0), std=0.2)
    host = SwitchHost(calculator_host())
    run = jax.jit(lambda params, key: MT.sample_episodes(CFG, params, PROMPT_TOKENS, PROMPT_MASK, INDEX, key,
                                                         controls=CONTROLS, host=host, **SIZES))
    return params, host, run


@pytest.fixture(scope="module")
def calculator_episodes(model):
    params, host, run = model
    host.inner = calculator_host()
    return jax.device_get(run(params, jax.random.key(1))), host.inner


def _text(episodes, r) -> str:
    n = int(episodes.lengths_b[r])
    return TOK.decode(episodes.tokens_bn[r, :n].tolist(), skip_special=False)


def test_scripted_calculator_episodes_have_the_expected_transcripts_and_authors(calculator_episodes):
    """Scripted rows play whole calculator episodes inside the compiled loop: the calculator's
    observations land after each call, written by ENV; the answer ends the episode with its
    score; a 22-token observation is cut to the 20-token cap with the marker; counts add up.

    Catches: observations credited to the model or written at the wrong column, a turn that does
    not stop at "</tool>", a host that steps rows that did not stop, turn indices or turn
    rewards in the wrong slot, and a cap applied without its marker."""
    e, host = calculator_episodes
    for r in (0, 1):
        assert _text(e, r) == _joined(r), r
        n = int(e.lengths_b[r])
        expected = [a for a, text in ROWS[r][2] for _ in TOK.encode(text)]
        assert e.author_bn[r, :n].tolist() == expected, r
        turns = np.cumsum([a == MODEL and (i == 0 or ROWS[r][2][i - 1][0] == ENV)
                           for i, (a, _) in enumerate(ROWS[r][2])]) - 1
        assert e.turn_bn[r, :n].tolist() == [k for k, (_, text) in zip(turns, ROWS[r][2]) for _ in TOK.encode(text)]
        np.testing.assert_array_equal(envs.turn_index(e.author_bn[r, :n]) == e.turn_bn[r, :n],
                                      e.author_bn[r, :n] == MODEL)  # model tokens: rljax.envs.turn_index
        assert np.all(e.author_bn[r, n:] == PAD)
    assert e.turns_b[:2].tolist() == [3, 2] and e.tool_calls_b[:2].tolist() == [2, 1]
    assert e.rewards_b[:2].tolist() == [1.0, 0.0] and e.turn_rewards_bk[0].tolist() == [0.0, 0.0, 1.0]
    assert e.finish_b[:2].tolist() == [MT.FINISH_ENV] * 2 and e.finish_b[7] == MT.FINISH_ENV
    assert e.lengths_b[3] < OPTIONS.max_episode_tokens or e.finish_b[3] == MT.FINISH_BUDGET
    assert host.last.actions[0] == ["<tool>2*3</tool>", "<tool>6+1</tool>", "7"]
    assert host.last.results[1][0].observation_text == "<result>56088</result>"  # the env's text, uncut
    assert _text(e, 2).startswith("<tool>7*8</tool><result>56</result>")


def test_continued_episode_logprobs_equal_rescoring_the_conversation(model, calculator_episodes):
    """Every model token's sampler log-prob, after observations appended through the cached step,
    equals the trainer's `token_logprobs` on the whole conversation (prompt + episode) scored
    from scratch, within 1e-5 in f32; rows with 1-3 turns and a cut observation included.

    Catches: observation tokens fed at wrong positions or cache slots, a stop token or observation
    token skipped or fed twice, a re-prefill that differs from the cached path, and log-probs
    recorded from processed (scripted) logits instead of the policy's."""
    params, _, _ = model
    e, _ = calculator_episodes
    tokens = np.concatenate([PROMPT_TOKENS, e.tokens_bn], axis=1)
    mask = np.concatenate([PROMPT_MASK, e.author_bn != PAD], axis=1)
    logp, _ = M.token_logprobs(CFG, params, jnp.asarray(tokens), jnp.asarray(mask))
    logp = np.asarray(logp)[:, P:]
    model_tokens = e.author_bn == MODEL
    assert model_tokens[:4].sum() > 100 and (e.author_bn[:4] == ENV).sum() > 40
    np.testing.assert_allclose(logp[model_tokens], e.logprobs_bn[model_tokens], atol=1e-5, rtol=0)
    assert np.all(e.logprobs_bn[~model_tokens] == 0.0)


def test_fp8_cache_episodes_stay_within_the_fp8_gap_of_rescoring(model, calculator_episodes):
    """With `kv_dtype = "fp8"` (prompt cache quantised after the prefill, every fed token and
    observation token where the cached step writes it), the scripted rows' tool calls and
    observations are the model-dtype run's, and the model tokens' log-probs sit within the FP8
    gap of the f32 trainer's rescoring of the whole conversation: off it (mean > 1e-4; the
    model-dtype cache is within 1e-5), bounded (measured mean 0.093, max 0.56 nats on this std 0.2
    model; bounds 0.2 and 1.0), and no worse after an observation than before the first one
    (measured 0.101 against 0.090 mean). Fails if multi-turn refuses FP8 or ignores it (gap
    ~1e-7), or if observation tokens are written at the wrong slots or unquantised into an FP8
    cache with stale scales (the gap after observations then grows to O(1))."""
    params, host, _ = model
    e, _ = calculator_episodes
    host.inner = calculator_host()
    fp8 = jax.device_get(jax.jit(lambda p, k: MT.sample_episodes(
        CFG, p, PROMPT_TOKENS, PROMPT_MASK, INDEX, k, controls=CONTROLS.replace(kv_dtype="fp8"), host=host,
        **SIZES))(params, jax.random.key(1)))
    for name in ("tokens_bn", "author_bn", "turns_b"):  # the scripted rows do not depend on the cache
        np.testing.assert_array_equal(getattr(fp8, name)[:2], getattr(e, name)[:2], err_msg=name)
    tokens = np.concatenate([PROMPT_TOKENS, fp8.tokens_bn], axis=1)
    mask = np.concatenate([PROMPT_MASK, fp8.author_bn != PAD], axis=1)
    logp = np.asarray(M.token_logprobs(CFG, params, jnp.asarray(tokens), jnp.asarray(mask))[0])[:, P:]
    gap = np.abs(logp - fp8.logprobs_bn)
    model_tokens = fp8.author_bn == MODEL
    first_env = np.where((fp8.author_bn == ENV).any(1), (fp8.author_bn == ENV).argmax(1), gap.shape[1])
    col = np.arange(gap.shape[1])[None]
    before, after = gap[model_tokens & (col < first_env[:, None])], gap[model_tokens & (col > first_env[:, None])]
    assert (fp8.author_bn[:2] == ENV).sum() > 20 and after.size > 20
    assert 1e-4 < gap[model_tokens].mean() < 0.2 and gap[model_tokens].max() < 1.0
    assert after.mean() < 2 * before.mean()


def test_fp8_weights_are_the_sampler_copy_of_the_params(model):
    """`weight_dtype = "fp8"` samples episodes with the sampler's FP8 copy of the layer weights
    (`rljax.sampling.fp8.sampler_params`): bitwise the episodes of the model-dtype sampler handed
    that copy by hand, and not those of the params as they are. Fails if multi-turn ignores
    `weight_dtype` (as it did) or quantises something else."""
    params, host, run = model
    host.inner = calculator_host()
    fp8 = jax.device_get(jax.jit(lambda p, k: MT.sample_episodes(
        CFG, p, PROMPT_TOKENS, PROMPT_MASK, INDEX, k, controls=CONTROLS.replace(weight_dtype="fp8"), host=host,
        **SIZES))(params, jax.random.key(1)))
    host.inner = calculator_host()
    by_hand = jax.device_get(run(sampler_params(params, "fp8"), jax.random.key(1)))
    for name in ("tokens_bn", "author_bn", "logprobs_bn", "turns_b"):
        np.testing.assert_array_equal(getattr(fp8, name), getattr(by_hand, name), err_msg=name)
    host.inner = calculator_host()
    plain = jax.device_get(run(params, jax.random.key(1)))
    assert not np.array_equal(plain.logprobs_bn, fp8.logprobs_bn)


def test_same_key_same_episodes_and_the_host_loop_driver_agrees(model, calculator_episodes):
    """The same key gives the same episodes (tokens, authors, log-probs bitwise); another key
    changes the sampled rows; the host-loop driver gives the compiled driver's episodes.

    Catches: keys that depend on the batch or the environment rounds, host state leaking between
    batches, and a driver that applies observations at a different step."""
    params, host, run = model
    e, _ = calculator_episodes
    host.inner = calculator_host()
    again = jax.device_get(run(params, jax.random.key(1)))
    for name in ("tokens_bn", "author_bn", "logprobs_bn", "rewards_b", "turns_b"):
        np.testing.assert_array_equal(getattr(again, name), getattr(e, name), err_msg=name)
    other = jax.device_get(run(params, jax.random.key(2)))
    assert not np.array_equal(other.tokens_bn[3], e.tokens_bn[3])
    np.testing.assert_array_equal(other.tokens_bn[:2], e.tokens_bn[:2])  # scripted rows
    looped = jax.device_get(MT.sample_episodes_host_loop(
        CFG, params, PROMPT_TOKENS, PROMPT_MASK, INDEX, jax.random.key(1), controls=CONTROLS,
        host=calculator_host(), **SIZES))
    for name in ("tokens_bn", "author_bn", "lengths_b", "turns_b", "tool_calls_b", "rewards_b", "finish_b"):
        np.testing.assert_array_equal(getattr(looped, name), getattr(e, name), err_msg=name)
    np.testing.assert_allclose(looped.logprobs_bn, e.logprobs_bn, atol=1e-6, rtol=0)


def test_failing_tools_are_observations_inside_the_rollout(model, tmp_path):
    """A tool that hangs (killed at its 1.5 s limit), one that kills its pool worker and one that
    raises give error observations inside the compiled rollout, and the episodes go on: each of
    the three rows answers after its error (the whole episode is scripted) and is scored. Each
    tool runs once (the tool's own call log, written in the worker) and errors once.

    Catches: a pool failure propagating through io_callback (the rollout would raise), an error
    that ends the episode, a hang that waits for the tool, a crashed or timed-out call run again
    (a second line in the call log) and an error counted twice."""
    params, host, run = model
    calls = tmp_path / "calls"
    env = ToolEnv((MisbehavingTool(calls=str(calls)),), FORMATS["tags"], MathAnswer(time_limit_s=None), max_turns=3)
    with VerifierPool(2) as pool:
        host.inner = EpisodeHost(env, TOK, TABLE, max_observation_tokens=OPTIONS.max_observation_tokens, pool=pool)
        e = jax.device_get(run(params, jax.random.key(1)))
    results, actions = host.inner.last.results, host.inner.last.actions
    assert [results[r][0].info.get("flag") for r in (4, 5, 6)] == ["timeout", "error", None]
    assert [results[r][0].observation_text for r in (4, 5)] == [f"<result>{HANG_ERROR}</result>",
                                                                f"<result>{DIE_ERROR}</result>"]
    assert [actions[r] for r in (4, 5, 6)] == [["<tool>hang</tool>", "1"], ["<tool>die</tool>", "2"],
                                               ["<tool>raise</tool>", "3"]]
    ran = calls.read_text().split()
    assert [ran.count(what) for what in ("hang", "die", "raise")] == [1, 1, 1], ran
    assert e.tool_calls_b[4:7].tolist() == [1, 1, 1] and e.tool_errors_b[4:7].tolist() == [1, 1, 1]
    assert e.turns_b[4:7].tolist() == [2, 2, 2] and e.rewards_b[4:7].tolist() == [1.0, 1.0, 1.0]
    for r in (4, 5, 6):
        assert _text(e, r) == _joined(r), r


def test_batch_masks_env_tokens_out_of_the_loss_and_its_denominator(model, calculator_episodes):
    """The RolloutBatch from episodes: loss mask = model tokens of kept rows; the void-turn row
    (budget ran out mid-turn) is dropped and counted; through the update's own prepare_batch,
    aggregation denominator and policy loss, d loss / d logp is exactly 0 on every env, prompt
    and dropped token and nonzero on kept model tokens, and the token-mean denominator is the
    kept model-token count (NumPy).

    The discounted option: gamma = 0.5 makes a 3-turn episode's reward 0.25, and each model
    token's turn return gamma^(2 - turn).

    Catches: env tokens in the loss mask or the denominator, a void filter that drops the wrong
    rows or none, batch columns misaligned with the sampler's log-probs, and a discount applied
    from the wrong end of the episode."""
    from rljax.objectives import POLICY_LOSSES, aggregate

    params, _, _ = model
    e, _ = calculator_episodes
    e = jax.tree.map(jnp.asarray, e)
    out = episodes_to_batch(jnp.asarray(PROMPT_TOKENS), jnp.asarray(PROMPT_MASK), e, num_samples=1, options=OPTIONS)
    author = np.asarray(e.author_bn)
    void = np.asarray(e.void_turns_b) > 0
    assert not void[:2].any() and void.any()  # the scripted rows answer; some sampled row is void
    keep_model = (author == MODEL) & ~void[:, None]
    loss_mask = np.asarray(out.batch.loss_mask_bt)
    np.testing.assert_array_equal(loss_mask, np.concatenate([np.zeros_like(PROMPT_MASK), keep_model], 1))
    np.testing.assert_array_equal(np.asarray(out.batch.sampler_logp_bt)[:, P:], np.asarray(e.logprobs_bn))
    discounted = episodes_to_batch(jnp.asarray(PROMPT_TOKENS), jnp.asarray(PROMPT_MASK), e, num_samples=1,
                                   options=dataclasses.replace(OPTIONS, turn_discount=0.5))
    assert float(discounted.batch.rewards_b[0]) == 0.25  # the answer on turn 3: 0.5^2 * 1
    returns = np.asarray(turn_returns(e, 0.5))[0]
    model0 = author[0] == MODEL
    np.testing.assert_array_equal(returns[model0], 0.5 ** (2 - np.asarray(e.turn_bn)[0][model0]))
    metrics = episode_metrics(out)
    assert int(metrics["rollout/void_filtered"]) == void.sum()
    assert int(metrics["rollout/env_tokens"]) == (author == ENV).sum()

    algo = AlgorithmConfig(algorithm="grpo", aggregation="token-mean")
    state = init_train_state(CFG, params, algo, OptimConfig(learning_rate=1e-3))
    one_group = out.batch.replace(group_ids_b=jnp.zeros_like(out.batch.group_ids_b))  # n = 1: no group baseline
    prepared, _ = jax.jit(prepare_batch)(state, one_group)
    assert float(aggregation_denominator(prepared, algo, out.batch.completion_len)) == keep_model.sum()
    logp = jnp.asarray(np.asarray(prepared.old_logp_bt) - 0.1)

    def objective(lp):
        loss_bt, _ = POLICY_LOSSES.get(algo.policy_loss)(lp, prepared.old_logp_bt, prepared.advantages_bt,
                                                         prepared.loss_mask_bt)
        return aggregate(loss_bt, prepared.loss_mask_bt, algo.aggregation)

    grad = np.asarray(jax.grad(objective)(logp))
    assert np.all(grad[~loss_mask] == 0.0)
    advantages = np.asarray(prepared.advantages_bt)
    assert np.all(advantages[~loss_mask] == 0.0)
    assert np.count_nonzero(grad[loss_mask]) == np.count_nonzero(advantages[loss_mask]) > 0


def test_one_fused_iteration_trains_on_episodes(model):
    """`make_episode_iteration` runs episodes and the update as one program: the params move, and
    the rollout metrics agree with what the host saw (turns, tool calls and void trajectories per
    episode, from its step results).

    Catches: a rollout that never reaches the update (params unchanged), metrics computed on
    other rows than the host stepped, and metric names clashing with the update's."""
    from rljax.stages.episodes import make_episode_iteration

    params, _, _ = model
    host = calculator_host()
    algo = AlgorithmConfig(algorithm="grpo")
    state = init_train_state(CFG, jax.tree.map(jnp.copy, params), algo, OptimConfig(learning_rate=1e-2))
    controls = CONTROLS.replace(num_samples=2)
    iteration = make_episode_iteration(controls, host, OPTIONS)
    before = np.asarray(state.params["embed"]).copy()
    state, metrics, _ = iteration(state, PROMPT_TOKENS, PROMPT_MASK, INDEX, jax.random.key(3))
    assert not np.array_equal(np.asarray(state.params["embed"]), before)
    results = host.last.results
    assert len(results) == 2 * len(ROWS)
    assert float(metrics["rollout/turns_per_episode"]) == np.mean([len(r) for r in results])
    assert float(metrics["rollout/tool_calls_per_episode"]) == np.mean(
        [sum(x.kind == "tool_call" for x in r) for r in results])
    assert int(metrics["rollout/void_filtered"]) == sum(any(x.kind == "void" for x in r) for r in results) > 0
