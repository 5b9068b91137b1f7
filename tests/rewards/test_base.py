"""rewards.compose, format/length shaping and reasoning-gym verifiers."""

import numpy as np
import pytest

from rljax import rewards
from rljax.errors import ConfigError, DataError
from rljax.rewards.pool import VerifierPool

INLINE = VerifierPool(0)


def test_overlong_penalty_lives_only_in_the_update_step():
    """DAPO's soft overlong punishment exists once: `objectives.overlong_penalty`, applied by the
    update step's reward shaping (tested in test_objectives_advantages). Catches the old second
    copy, the `rewards.OverlongPenalty` host verifier."""
    from rljax import objectives
    assert not hasattr(rewards, "OverlongPenalty") and "OverlongPenalty" not in rewards.__all__
    assert callable(objectives.overlong_penalty)


def test_target_length_and_tag_format():
    """TargetLength peaks at the target; TagFormat needs think-then-answer, each tag once."""
    tl = rewards.TargetLength(target_tokens=10)
    assert [tl({"completion_tokens": n}, "")[0] for n in (0, 5, 10, 15, 20, 30)] == \
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    fmt = rewards.TagFormat()
    assert fmt({}, "<think>a</think>\n<answer>b</answer>")[0] == 1.0
    assert fmt({}, "<answer>b</answer><think>a</think>")[0] == 0.0
    assert fmt({}, "<think>a</think><answer>b</answer><answer>c</answer>")[0] == 0.0
    assert fmt({}, "text <think>a</think><answer>b</answer>")[0] == 0.0
    assert rewards.RegexFormat(r"\\boxed\{")({}, "x \\boxed{1}")[0] == 1.0


def test_compose_weights_and_reports_parts():
    """total = Σ weight·part, each part reported unweighted under its name."""
    reward = rewards.compose(correct=(1.0, rewards.MathAnswer()), format=(0.1, rewards.TagFormat()),
                             length=(-0.5, rewards.TargetLength(target_tokens=8)))
    metas = [{"answer": "4"}] * 3
    texts = ["<think>2+2</think><answer>4</answer>", "<answer>5</answer>", "\\boxed{4}"]
    out, infos = reward.batch(metas, texts, num_tokens=[3, 8, 12], pool=INLINE)
    np.testing.assert_allclose(out.parts["correct"], [1, 0, 1])
    np.testing.assert_allclose(out.parts["format"], [1, 0, 0])
    np.testing.assert_allclose(out.parts["length"], [0.375, 1.0, 0.5])
    np.testing.assert_allclose(out.total_b, [1.1 - 0.1875, -0.5, 1.0 - 0.25], atol=1e-6)
    assert out.total_b.dtype == np.float32 and not out.failed_b.any()
    assert infos[0]["correct"]["method"] == "answer_tag"


def test_length_parts_need_num_tokens():
    """A length reward without num_tokens is a ConfigError naming the fix."""
    reward = rewards.compose(rewards.TargetLength(target_tokens=5))
    with pytest.raises(ConfigError, match="num_tokens"):
        reward.batch([{}], ["x"], pool=INLINE)


def test_reasoning_gym_task_source_and_verifier():
    """Generated problems score 1 with their gold answer in <answer> tags, 0 with a wrong one."""
    from rljax.data.sources import from_reasoning_gym
    from rljax.data.example import verifier_metadata

    examples = from_reasoning_gym("basic_arithmetic", size=4, seed=3).examples
    examples += from_reasoning_gym("chain_sum", size=2, seed=1).examples
    rows = [verifier_metadata(e) for e in examples]
    v = rewards.ReasoningGymAnswer()
    for row in rows:
        assert v(row, f"<think>…</think><answer>{row['answer']}</answer>")[0] == 1.0
        assert v(row, "<answer>not a number</answer>")[0] == 0.0
        assert v(row, "")[0] == 0.0
    with pytest.raises(DataError, match="no_such_task"):
        from_reasoning_gym("no_such_task", size=1, seed=0)


def test_pool_survives_a_killed_idle_worker():
    """A worker killed while idle (e.g. by a notebook's SIGINT) is replaced; later tasks still run."""
    import os
    import signal
    import time

    from rljax.rewards.pool import Task, VerifierPool

    with VerifierPool(1) as pool:
        assert pool.run([Task(abs, (-2,), 30.0)])[0].value == 2
        os.kill(pool._pool[0].proc.pid, signal.SIGINT)  # ignored by the worker
        time.sleep(0.3)
        assert pool._pool[0].proc.is_alive()
        os.kill(pool._pool[0].proc.pid, signal.SIGKILL)
        pool._pool[0].proc.join(5)
        out = pool.run([Task(abs, (-3,), 30.0), Task(abs, (-4,), 30.0)])
        assert [o.value for o in out] == [3, 4]
