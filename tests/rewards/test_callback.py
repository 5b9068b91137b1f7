"""rewards.as_callback and the pool: io_callback parity with the eager call, failures flagged."""

import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax import rewards
from rljax.errors import ConfigError
from rljax.rewards.pool import Task, VerifierPool
from misbehaving_verifiers import crash, imported, slow

ALPHABET = "0123456789<>/abcdefghijklmnopqrstuvwxyz{}\\ ."


def decode(batch_ids):
    return ["".join(ALPHABET[i] for i in ids) for ids in batch_ids]


def encode(text, length):
    ids = [ALPHABET.index(c) for c in text]
    return ids + [0] * (length - len(ids)), [True] * len(ids) + [False] * (length - len(ids))


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(2) as p:
        yield p


TABLE = [{"answer": "12"}, {"answer": "7"}, {"answer": "1/2"}, {"answer": "3"}]
TEXTS = ["<answer>12</answer>", "<answer>8</answer>", "the answer is \\boxed{0.5}", "3",
         "<think>x</think><answer>7</answer>", "<answer>3</answer>", "nothing", "12"]
INDEX = [0, 1, 2, 3, 1, 3, 2, 0]


def _reward():
    return rewards.compose(correct=(1.0, rewards.MathAnswer()),
                           format=(0.5, rewards.TagFormat()),
                           length=(-0.5, rewards.TargetLength(target_tokens=20)))


def test_callback_in_jit_matches_eager_and_sharded(pool):
    """io_callback inside jit returns the eager scores, also with inputs sharded over 8 devices."""
    cb = rewards.as_callback(_reward(), decode, TABLE, pool=pool)
    toks, mask = zip(*(encode(t, 40) for t in TEXTS))
    tokens_bt, mask_bt = np.array(toks, np.int32), np.array(mask)
    index_b = np.array(INDEX, np.int32)
    eager = cb.eager(tokens_bt, mask_bt, index_b)
    np.testing.assert_array_equal(eager.parts["correct"], [1, 0, 1, 1, 1, 1, 0, 1])
    np.testing.assert_array_equal(eager.parts["format"], [0, 0, 0, 0, 1, 0, 0, 0])
    lengths = mask_bt.sum(1)
    expected_length = np.maximum(0.0, 1 - np.abs(lengths - 20) / 20)  # reads the token counts
    np.testing.assert_allclose(eager.parts["length"], expected_length, rtol=1e-6)
    np.testing.assert_allclose(eager.total_b, eager.parts["correct"] + 0.5 * eager.parts["format"]
                               - 0.5 * eager.parts["length"], rtol=1e-6)

    @jax.jit
    def step(tokens_bt, mask_bt, index_b):
        r = cb(tokens_bt, mask_bt, index_b)
        return r, r.total_b - r.total_b.mean()  # downstream compiled use (a baseline)

    jitted, adv = step(tokens_bt, mask_bt, index_b)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a), b)
    mesh = jax.make_mesh((8,), ("data",))
    rows, cols = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", None))
    sharded, _ = step(jax.device_put(tokens_bt, cols), jax.device_put(mask_bt, cols),
                      jax.device_put(index_b, rows))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a), b)
    np.testing.assert_allclose(adv, eager.total_b - eager.total_b.mean(), rtol=1e-6, atol=1e-6)


def test_hung_and_crashing_verifiers_score_zero_with_flags(pool):
    """A hanging verifier is killed at its limit, a crashing one is caught; both score 0, flagged."""
    reward = rewards.compose(ok=rewards.MathAnswer(),
                             hang=rewards.verifier(slow, time_limit_s=1.0),
                             boom=rewards.verifier(crash))
    t0 = time.monotonic()
    out, infos = reward.batch([{"answer": "2"}] * 2, ["\\boxed{2}", "\\boxed{3}"], pool=pool)
    assert time.monotonic() - t0 < 15  # one second limit per hung row, plus a worker restart
    np.testing.assert_array_equal(out.parts["ok"], [1, 0])
    np.testing.assert_array_equal(out.parts["hang"], [0, 0])
    assert out.failed_b.tolist() == [True, True]
    assert infos[0]["hang"]["flag"] == "timeout" and infos[0]["boom"]["flag"] == "error"
    assert "verifier bug" in infos[1]["boom"]["message"]
    # the pool still works after killing workers
    again, _ = rewards.compose(rewards.MathAnswer()).batch([{"answer": "5"}], ["\\boxed{5}"],
                                                           pool=pool)
    assert again.total_b.tolist() == [1.0]


def test_new_workers_import_the_verifiers_libraries_before_their_first_task():
    """A worker has math-verify imported before its first task, so no task's time limit pays the
    import (0.24 s of CPU; seconds under load).

    Catches: the import left to the first `MathAnswer` call, which timed out at a 1.5 s limit in
    workers respawned under load (tests/sampling/test_multiturn.py's failing-tools test, at load 6-7)."""
    with VerifierPool(1) as fresh:
        assert fresh.run([Task(imported, ("math_verify",), 60.0)])[0].value is True


def test_pool_matches_inline_run():
    """The pool returns the same values, in order, as running the tasks inline."""
    tasks = [Task(divmod, (i, 3), 5.0) for i in range(10)]
    assert [o.value for o in VerifierPool(0).run(tasks)] == [divmod(i, 3) for i in range(10)]


def test_compose_rejects_bad_parts():
    """compose() refuses non-verifiers and duplicate names with a ConfigError."""
    with pytest.raises(ConfigError, match="not a verifier"):
        rewards.compose(lambda m, c: 1.0)
    with pytest.raises(ConfigError, match="duplicate"):
        rewards.compose(rewards.MathAnswer(), rewards.MathAnswer())


def test_host_seconds_sum_over_calls_until_taken():
    """An iteration that calls the verifiers twice (ReMax: samples, then the greedy baseline)
    reports the time of both: `take_seconds` sums every call since the last take, then resets.
    The old `last_seconds` kept only the latest call's time (about half here)."""
    def sleepy(batch_ids):
        time.sleep(0.3)
        return decode(batch_ids)

    cb = rewards.as_callback(rewards.compose(correct=rewards.MathAnswer(time_limit_s=None)), sleepy, TABLE)
    toks, mask = zip(*(encode(t, 40) for t in TEXTS[:2]))
    args = (np.array(toks, np.int32), np.array(mask), np.array(INDEX[:2], np.int32))
    cb.eager(*args)  # warm-up: math-verify's first call imports and compiles for seconds
    cb.take_seconds()
    cb.eager(*args)
    cb.eager(*args)
    assert cb.take_seconds() >= 0.6  # two calls of >= 0.3 s each
    assert cb.take_seconds() == 0.0
