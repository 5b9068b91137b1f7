"""rljax.envs: the registry, the calculator and Python tools, episodes, tool failures as
observations through the verifier pool, SimpleTIR's void-turn filter, and the author-based loss
mask against NumPy references.

This module imports no jax at its top: pool workers may import it to unpickle its tools and hooks
(the misbehaving tool lives in the lighter misbehaving_tools.py).
"""

import os
import random
import time

import numpy as np
import pytest

from rljax import envs
from rljax.envs import ENV, MODEL, PAD, PROMPT, FORMATS, ToolEnv
from rljax.errors import ConfigError
from rljax.rewards import MathAnswer, SandboxLimits, VerifierPool
from misbehaving_tools import MisbehavingTool
from test_sandbox import ATTACKS

LIMITS = SandboxLimits(cpu_s=1, wall_s=2.0, memory_mb=256, output_bytes=1 << 14, total_s=4.0)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(2) as p:
        yield p


def _penalize_tool_errors(parsed, tool_error):
    """A per-turn reward hook (module level, so it pickles): -0.1 per failed tool call."""
    return -0.1 if tool_error else 0.0


# ----------------------------------------------------------------------------- registry


def test_registry_errors_are_one_line():
    """An unknown environment or option raises a one-line ConfigError naming what exists.

    Catches: a KeyError/TypeError escaping make_env, or messages that do not list the choices."""
    with pytest.raises(ConfigError) as err:
        envs.make_env("calculater")
    assert "\n" not in str(err.value) and "calculator, python, reasoning_gym_tool" in str(err.value)
    with pytest.raises(ConfigError) as err:
        envs.make_env("calculator", max_turn=3)
    assert "\n" not in str(err.value) and "'max_turn'" in str(err.value) and "max_turns" in str(err.value)
    assert envs.make_env("calculator", max_turns=3).max_turns == 3


# ----------------------------------------------------------------------------- calculator


def test_calculator_multiplies_three_digit_numbers_exactly():
    """20 random 3-digit x 3-digit products, big integers, exact division and precedence match
    Python's integer arithmetic.

    Catches: float evaluation (rounding), '^' read as XOR, or int/int printed as '2.0'."""
    calc = envs.Calculator()
    rng = random.Random(0)
    for _ in range(20):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        assert calc.evaluate(f"{a} * {b}") == (str(a * b), False)
    cases = {"2^10": "1024", "3×4": "12", "6/3": "2", "7/2": "3.5", "-(2+3)*4": "-20", "17 % 5": "2",
             "2**200": str(2 ** 200), "123456789123456789 * 987654321987654321":
             str(123456789123456789 * 987654321987654321)}
    for expr, want in cases.items():
        assert calc.evaluate(expr) == (want, False), expr


@pytest.mark.parametrize("expr, reason", [
    ("__import__('os').system('true')", "only numbers"), ("abs(-1)", "only numbers"),
    ("x + 1", "only numbers"), ("'a' * 3", "only numbers"), ("(1).__class__", "only numbers"),
    ("lambda: 1", "only numbers"), ("[1, 2]", "only numbers"), ("9**9**9", "digits"),
    ("10**100", "digits"), ("1/0", "division by zero"), ("(-8) ** 0.5", "not a real"),
    ("1 +", "SyntaxError"), ("1" * 300, "longer than"),
])
def test_calculator_refuses_non_arithmetic(expr, reason):
    """Names, calls, attributes, strings, lambdas, oversized results and bad syntax are error
    outputs, and 9**9**9 is refused before it is computed.

    Catches: an eval()-based calculator (the os.system call would run), a digit cap checked only
    after computing the power (9**9**9 would hang this test), and exceptions escaping."""
    start = time.monotonic()
    text, error = envs.Calculator().evaluate(expr)
    assert error and text.startswith("error:") and reason in text
    assert time.monotonic() - start < 0.5


# ----------------------------------------------------------------------------- episodes


def test_calculator_episode_rewards_counts_and_turn_limit():
    """A call, a refused call and an answer: observations in the tag format, the answer scored
    against the example, the per-turn hook added, the counts of `episode_stats`; an episode that is
    still calling at max_turns ends without running the call.

    Catches: the hook's reward dropped or applied only to answers, a wrong answer that scores, an
    episode that runs past max_turns, and counts that miss the failed call or the env's text."""
    env = envs.make_env("calculator", max_turns=3, turn_reward=_penalize_tool_errors)
    state, question = env.reset({"question": "123 * 456 =", "answer": "56088"})
    assert question == "123 * 456 ="
    actions = ["<tool>123*456</tool>", "<tool>foo(1)</tool>", "so it is\n56088"]
    results = []
    for action in actions:
        state, result = env.step(state, action)
        results.append(result)
    assert [r.observation_text for r in results[:2]] == [
        "<result>56088</result>", "<result>error: only numbers, + - * / // % ** and parentheses are "
        "allowed</result>"]
    assert [r.reward for r in results] == [0.0, pytest.approx(-0.1), 1.0]
    assert [r.done for r in results] == [False, False, True] and state.done
    stats = envs.episode_stats(actions, results)
    assert stats == envs.EpisodeStats(turns=3, tool_calls=2, tool_errors=1, void_turns=0,
                                      model_chars=sum(map(len, actions)),
                                      env_chars=sum(len(r.observation_text) for r in results[:2]))
    state, _ = env.reset({"question": "1+1=", "answer": "2"})
    state, wrong = env.step(state, "3")
    assert wrong.reward == 0.0 and wrong.done and wrong.kind == "answer"
    state, _ = env.reset({"question": "1+1=", "answer": "2"})
    for _ in range(3):
        state, last = env.step(state, "<tool>1+1</tool>")
    assert last.done and last.kind == "tool_call" and last.observation_text == ""
    assert last.info == {"truncated": "max_turns"}


def test_python_tool_keeps_state_across_turns():
    """Variables and functions defined in earlier cells exist in later ones; a failing cell shows
    its exception and is not kept; earlier cells' output is not shown again.

    Catches: a tool that runs each cell fresh (NameError on turn 2), one that replays the failed
    cell (every later turn would fail), and one that shows replayed output."""
    env = envs.make_env("python", format="qwen", max_turns=5, limits=LIMITS)
    state, _ = env.reset({"question": "q", "answer": "1"})
    call = lambda code: FORMATS["qwen"].render_call("python", {"code": code})  # noqa: E731
    outputs = []
    for code in ["x = 6\ndef f(y):\n    return x * y\nprint('defined')", "print(f(7))",
                 "z = 1\nprint(undefined_name)", "print(z if 'z' in dir() else 'no z', f(2))"]:
        state, result = env.step(state, call(code))
        outputs.append(result)
    prefix, suffix = FORMATS["qwen"].observation_prefix, FORMATS["qwen"].observation_suffix
    bodies = [r.observation_text.removeprefix(prefix).removesuffix(suffix) for r in outputs]
    assert bodies == ["defined\n", "42\n", "NameError: name 'undefined_name' is not defined\n", "no z 12\n"]
    assert [r.tool_error for r in outputs] == [False, False, True, False]
    assert len(state.histories["python"]) == 3


def test_sandbox_attacks_are_error_observations(pool):
    """The code verifier's attacks (infinite loop, fork bomb, stdout flood, memory hog, ctypes)
    plus a write outside the sandbox and a crash, run as Python tool calls in one pooled batch:
    each row gets an error observation and the episode goes on, within the sandbox's wall limit
    plus a margin.

    Catches: a tool whose failures raise or end the episode, a flood shown uncut to the model,
    and a batch that waits past the limit for a hanging row."""
    env = envs.make_env("python", format="tags", max_turns=3, limits=LIMITS)
    cells = {name: ATTACKS[name] for name in ("infinite_loop", "fork_bomb", "stdout_flood",
                                              "memory_hog", "ctypes_escape")}
    cells["write_outside"] = "open('/tmp/rljax-envs-escape', 'w').write('x')"
    cells["crash"] = "raise ValueError('bad')"
    expected = {"infinite_loop": "stopped", "fork_bomb": "PermissionError",
                "stdout_flood": "[output truncated]",
                "memory_hog": "MemoryError", "ctypes_escape": "PermissionError",
                "write_outside": "PermissionError", "crash": "ValueError: bad"}
    states, _ = envs.reset_batch(env, [{"question": "q", "answer": "1"}] * len(cells))
    start = time.monotonic()
    batch = envs.step_batch(env, states, [f"<tool>{c}</tool>" for c in cells.values()], pool=pool)
    took = time.monotonic() - start
    for name, result in zip(cells, batch.results):
        assert result.kind == "tool_call" and result.tool_error and not result.done, name
        assert expected[name] in result.observation_text, (name, result.observation_text)
        assert len(result.observation_text) < 700, name
    assert not os.path.exists("/tmp/rljax-envs-escape")
    assert took < LIMITS.wall_s + 3.0  # only the loop runs to a limit; the rest finish at once


def test_pool_failures_become_observations(pool):
    """A step that hangs is killed at the env's time limit, one that kills its worker and one that
    raises become error observations (the pool's flag in info), and a healthy row in the same
    batch is unaffected; rows with no action are left alone.

    Catches: step_batch waiting on a hung tool, an exception or dead worker that propagates, a
    failure that ends the episode, and rows shifted by the skipped one."""
    env = ToolEnv((MisbehavingTool(),), FORMATS["tags"], MathAnswer(time_limit_s=None), max_turns=3)
    assert env.time_limit_s == 1.5
    states, _ = envs.reset_batch(env, [{"question": "q", "answer": "1"}] * 5)
    start = time.monotonic()
    batch = envs.step_batch(env, states, ["<tool>hang</tool>", "<tool>die</tool>", "<tool>raise</tool>",
                                          None, "<tool>fine</tool>"], pool=pool)
    took = time.monotonic() - start
    hang, die, raised, skipped, fine = batch.results
    assert hang.info["flag"] == "timeout" and "timed out" in hang.observation_text
    assert die.info["flag"] == "error" and "worker process died" in die.observation_text
    assert raised.observation_text == "<result>error: RuntimeError: tool bug</result>"
    assert all(r.tool_error and not r.done for r in (hang, die, raised))
    assert skipped is None and batch.states[3] is states[3]
    assert fine.observation_text == "<result>ok fine</result>" and not fine.tool_error
    assert [s.turn for s in batch.states] == [1, 1, 1, 0, 1]
    assert took < env.time_limit_s + 5.0  # the hang sleeps 60 s; 5 s covers respawning 2 workers


def test_reasoning_gym_tool_scores_with_the_task_scorer():
    """A reasoning-gym products problem: the calculator answers the call, and the final answer is
    scored by the task's own score_answer from the Example's entry.

    Catches: an env that scores against the wrong field (the entry's answer is the reference),
    or that loses the Example's entry in reset."""
    import reasoning_gym

    from rljax.data import Example

    entry = reasoning_gym.create_dataset("products", size=1, seed=3, min_digits=3, max_digits=3,
                                         min_terms=2, max_terms=2)[0]
    example = Example(id="p0", question=entry["question"], answer=entry["answer"], entry=entry)
    env = envs.make_env("reasoning_gym_tool", tool="calculator", format="tags")
    state, question = env.reset(example)
    assert question == entry["question"]
    state, result = env.step(state, f"<tool>{entry['metadata']['expression']}</tool>")
    assert result.observation_text == f"<result>{entry['answer']}</result>"
    _, right = env.step(state, entry["answer"])
    _, wrong = env.step(state, str(int(entry["answer"]) + 1))
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    assert right.info["score"]["task"] == "products"


# ----------------------------------------------------------------------------- void-turn filter

# Hand-labelled trajectories (model turns, tag format, answers in <answer> tags) and whether
# SimpleTIR's filter drops them.
TRAJECTORIES = [
    (["<tool>1+1</tool>", "<answer>2</answer>"], False),
    (["<answer>5</answer>"], False),
    (["I think it is 5"], True),                                   # neither call nor answer
    (["<tool>12*1"], True),                                        # call cut off
    (["<tool>2*3</tool>", "<tool>6*7</tool>", "<answer>42</answer>"], False),
    (["<tool>2*3</tool>", "hmm, so"], True),                       # void after a good call
    (["<tool>bad ((</tool>", "<answer>1</answer>"], False),        # a failed call is not void
    ([""], True),
    (["<tool>1</tool>", "<tool>2</tool>"], False),                 # out of turns while calling
    (["<answer>3</answer"], True),                                 # unclosed answer tag
    (["</tool><answer>4</answer>"], False),
]


def test_void_turn_filter_drops_exactly_the_labelled_trajectories():
    """Turn kinds from the tag format, then `void_turn_keep`: exactly the hand-labelled rows drop.

    Catches: a filter that drops failed tool calls, keeps cut-off calls, or looks only at the
    last turn (row 6 has its void turn last, row 4 its only turn cut off)."""
    kinds = [[FORMATS["tags"].parse(t, ("answer_tag",)).kind for t in turns] for turns, _ in TRAJECTORIES]
    keep = envs.void_turn_keep(kinds)
    assert keep.tolist() == [not drop for _, drop in TRAJECTORIES]
    assert envs.trajectory_has_void_turn(["tool_call", "void", "answer"])
    with pytest.raises(ValueError):
        envs.trajectory_has_void_turn(["tool", "answer"])
    stats = [envs.EpisodeStats(len(k), k.count("tool_call"), 0, k.count("void"), 0, 0) for k in kinds]
    metrics = envs.episode_metrics(stats)
    assert metrics["rollout/void_episode_fraction"] == pytest.approx(5 / 11)
    assert metrics["rollout/tool_calls_per_episode"] == pytest.approx(7 / 11)


# ----------------------------------------------------------------------------- masks

AUTHORS = np.stack([
    envs.author_row([(PROMPT, 2), (MODEL, 3), (ENV, 2), (MODEL, 2)], 10),
    envs.author_row([(PROMPT, 3), (MODEL, 1), (ENV, 4), (MODEL, 1), (ENV, 1)], 10),
    envs.author_row([(PROMPT, 4), (ENV, 3)], 10),                 # the model wrote nothing
    envs.author_row([(PROMPT, 1), (MODEL, 9)], 10),
])


def test_author_helpers_match_loops():
    """loss_mask, tokens_by_author, turn_index, discounted_turn_returns and
    turn_values_to_tokens against Python loops and hand-written rows.

    Catches: a mask that lets env or prompt tokens through, turns split at the wrong place (a turn
    must restart after each observation), and discounting in the wrong direction."""
    mask = envs.loss_mask(AUTHORS)
    assert mask.tolist() == [[float(a == MODEL) for a in row] for row in AUTHORS.tolist()]
    model_b, env_b = envs.tokens_by_author(AUTHORS)
    assert model_b.tolist() == [5, 2, 0, 9] and env_b.tolist() == [2, 5, 3, 0]
    want = []
    for row in AUTHORS.tolist():
        turn, prev, out = -1, None, []
        for a in row:
            turn += a == MODEL and prev != MODEL
            out.append(turn if a == MODEL else -1)
            prev = a
        want.append(out)
    assert envs.turn_index(AUTHORS).tolist() == want
    assert envs.turn_index(AUTHORS)[0].tolist() == [-1, -1, 0, 0, 0, -1, -1, 1, 1, -1]
    r_bk = np.array([[1.0, 0.0, 2.0], [0.0, 0.0, 1.0]], np.float32)
    gamma = 0.9
    loop = [[sum(gamma ** (j - k) * row[j] for j in range(k, 3)) for k in range(3)] for row in r_bk]
    np.testing.assert_allclose(envs.discounted_turn_returns(r_bk, gamma), loop, rtol=1e-6)
    values_bk = np.array([[10.0, 20.0, 30.0]] * 4, np.float32)
    assert envs.turn_values_to_tokens(values_bk, envs.turn_index(AUTHORS))[1].tolist() == [
        0, 0, 0, 10, 0, 0, 0, 0, 20, 0]
    assert PAD == 0 and set(np.unique(AUTHORS)) == {PAD, PROMPT, MODEL, ENV}


def test_aggregation_denominators_count_only_model_tokens():
    """Every aggregation mode's (numerator, denominator) with the author mask equals a NumPy
    reference that sums over model tokens only: env tokens never enter a denominator, and a row
    with no model tokens is not a row of the seq-mean modes.

    Catches: a mask built from 'not prompt' (env tokens would count), and seq-mean modes that
    count the model-less row."""
    import jax.numpy as jnp

    from rljax.objectives import AGGREGATIONS, aggregate_parts

    loss_bt = np.random.default_rng(0).normal(size=AUTHORS.shape).astype(np.float32)
    m = (AUTHORS == MODEL).astype(np.float32)
    n_b = m.sum(-1)
    rows = float((n_b > 0).sum())
    sums_b = (loss_bt * m).sum(-1)
    reference = {
        "token-mean": (sums_b.sum(), m.sum()),
        "token-sum": (sums_b.sum(), 1.0),
        "seq-mean-token-mean": ((sums_b / np.maximum(n_b, 1)).sum(), rows),
        "seq-mean-token-sum": (sums_b.sum(), rows),
        "seq-mean-token-sum-norm": (sums_b.sum(), rows * AUTHORS.shape[1]),
    }
    assert set(reference) == set(AGGREGATIONS.names())
    assert m.sum() == 16 and rows == 3
    for mode, (num, den) in reference.items():
        got_num, got_den = aggregate_parts(jnp.asarray(loss_bt), envs.loss_mask(jnp.asarray(AUTHORS)), mode)
        np.testing.assert_allclose([float(got_num), float(got_den)], [num, den], rtol=1e-6, err_msg=mode)


def test_env_tokens_get_exactly_zero_gradient():
    """Through every registered policy loss and aggregation, d loss / d logp is exactly 0 on env
    (and prompt, padding) tokens and not all 0 on model tokens.

    Catches: a loss that mixes tokens across the row without the mask (GSPO's sequence ratio over
    unmasked tokens would give env tokens gradient), or an aggregation that weights by an unmasked
    quantity."""
    import jax
    import jax.numpy as jnp

    from rljax.objectives import AGGREGATIONS, POLICY_LOSSES, aggregate

    rng = np.random.default_rng(1)
    logp = jnp.asarray(rng.normal(-1.0, 0.3, AUTHORS.shape).astype(np.float32))
    old_logp = logp + jnp.asarray(rng.normal(0, 0.05, AUTHORS.shape).astype(np.float32))
    adv = jnp.asarray(np.repeat(np.array([[1.0], [-0.5], [2.0], [-1.0]], np.float32), AUTHORS.shape[1], 1))
    mask = envs.loss_mask(jnp.asarray(AUTHORS))
    not_model = AUTHORS != MODEL
    for loss_name in POLICY_LOSSES.names():
        for mode in AGGREGATIONS.names():
            def objective(lp):
                loss_bt, _ = POLICY_LOSSES.get(loss_name)(lp, old_logp, adv, mask)
                return aggregate(loss_bt, mask, mode)
            grad = np.asarray(jax.grad(objective)(logp))
            assert np.all(grad[not_model] == 0.0), (loss_name, mode)
            assert np.any(grad[~not_model] != 0.0), (loss_name, mode)


def test_run_episode_transcript_and_authors():
    """A scripted policy plays the calculator episode; the transcript joins prompt, model turns and
    observations in order, and per-segment encoding gives each character its author, so the loss
    mask covers exactly the model's text and turn_index finds its two turns.

    Catches: observations credited to the model (the mask would cover "<result>"), segments out
    of order, and an episode loop that does not stop at done."""
    env = envs.make_env("calculator", max_turns=4)

    def policy(text):
        return "<tool>141*365</tool>" if "<result>" not in text else text.rsplit("<result>", 1)[1][:-9]

    episode = envs.run_episode(env, {"question": "141 * 365 =", "answer": "51465"}, policy)
    assert episode.transcript.text == "141 * 365 =<tool>141*365</tool><result>51465</result>51465"
    assert episode.actions == ("<tool>141*365</tool>", "51465") and episode.total_reward == 1.0
    ids, authors = envs.encode_transcript(episode.transcript, lambda s: [ord(c) for c in s])
    assert "".join(map(chr, ids)) == episode.transcript.text
    model_text = episode.transcript.by(MODEL)
    assert "".join(chr(i) for i, a in zip(ids, authors) if envs.loss_mask(np.asarray(a)) == 1) == model_text
    model_b, env_b = envs.tokens_by_author(authors[None])
    assert (int(model_b[0]), int(env_b[0])) == (len(model_text), len("<result>51465</result>"))
    assert envs.turn_index(authors[None]).max() == 1
