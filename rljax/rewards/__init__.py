"""Verifiable rewards: verifiers, their composition, and the host callback that runs them from jit.

```python
from rljax import rewards
reward = rewards.compose(correct=(1.0, rewards.MathAnswer()), format=(0.1, rewards.TagFormat()))
scores, infos = reward.batch([{"answer": "1/2"}], ["<think>…</think><answer>\\frac12</answer>"])
```
"""

from rljax.rewards.answer_form import parse_value, restates
from rljax.rewards.audit import AUDIT_PART, ExactValue, GymExact, LastNumber, audit_metrics, audit_verifier
from rljax.rewards.base import (
    FunctionVerifier,
    Part,
    RewardFn,
    Rewards,
    Verifier,
    compose,
    verifier,
)
from rljax.rewards.callback import RewardCallback, as_callback
from rljax.rewards.code import CodeTests, extract_code
from rljax.rewards.extract import answer_tag, boxed, extract_answer, final_line, hash_answer
from rljax.rewards.math import MathAnswer, math_verify
from rljax.rewards.pool import Outcome, Task, VerifierPool, default_pool
from rljax.rewards.reasoning import ReasoningGymAnswer
from rljax.rewards.routing import TASK_KEY, RoutedVerifier
from rljax.rewards.sandbox import ProgramRun, SandboxLimits, run_code, run_program
from rljax.rewards.shaping import RegexFormat, TagFormat, TargetLength

__all__ = [
    "AUDIT_PART", "CodeTests", "ExactValue", "FunctionVerifier", "GymExact", "LastNumber", "audit_metrics", "audit_verifier",
    "parse_value", "restates", "MathAnswer", "Outcome", "Part", "ProgramRun",
    "ReasoningGymAnswer", "RegexFormat", "RewardCallback", "RewardFn", "Rewards", "RoutedVerifier", "SandboxLimits",
    "TASK_KEY",
    "TagFormat", "TargetLength", "Task", "Verifier", "VerifierPool", "answer_tag", "as_callback",
    "boxed", "compose", "default_pool", "extract_answer", "extract_code", "final_line",
    "hash_answer", "math_verify", "run_code", "run_program", "verifier",
]
