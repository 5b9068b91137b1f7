"""Environments for multi-turn episodes with tools: the protocol, chat formats, built-in tools and
environments, the pooled batch step, SimpleTIR's void-turn filter and the author-based loss mask.

```python
from rljax import envs
env = envs.make_env("calculator", format="tags", max_turns=3)
state, question = env.reset({"question": "123 * 456 =", "answer": "56088"})
state, result = env.step(state, "<tool>123*456</tool>")   # observation "<result>56088</result>"
state, result = env.step(state, "56088")                  # result.reward == 1.0, result.done
```

Host-side and jax-free on import: pool workers unpickle environments from here.
"""

from rljax.envs.base import ENVIRONMENTS, Environment, StepResult, make_env, register_env
from rljax.envs.formats import (FORMATS, TURN_KINDS, ParsedTurn, ToolCall, ToolFormat, TurnKind,
                                get_format)
from rljax.envs.masks import (ENV, MODEL, PAD, PROMPT, author_row, discounted_turn_returns, loss_mask,
                              tokens_by_author, turn_index, turn_values_to_tokens)
from rljax.envs.metrics import (EpisodeStats, episode_metrics, episode_stats, trajectory_has_void_turn,
                                void_turn_keep)
from rljax.envs.runner import StepBatch, reset_batch, step_batch
from rljax.envs.tool_env import (ToolEnv, ToolEpisode, calculator_env, python_env,
                                 reasoning_gym_tool_env)
from rljax.envs.tools import Calculator, PythonTool, Tool, ToolOutput
from rljax.envs.transcript import Episode, Transcript, encode_transcript, run_episode

__all__ = [
    "ENVIRONMENTS", "Environment", "StepResult", "make_env", "register_env",
    "FORMATS", "TURN_KINDS", "ParsedTurn", "ToolCall", "ToolFormat", "TurnKind", "get_format",
    "ENV", "MODEL", "PAD", "PROMPT", "author_row", "discounted_turn_returns", "loss_mask",
    "tokens_by_author", "turn_index", "turn_values_to_tokens",
    "EpisodeStats", "episode_metrics", "episode_stats", "trajectory_has_void_turn", "void_turn_keep",
    "StepBatch", "reset_batch", "step_batch",
    "ToolEnv", "ToolEpisode", "calculator_env", "python_env", "reasoning_gym_tool_env",
    "Calculator", "PythonTool", "Tool", "ToolOutput",
    "Episode", "Transcript", "encode_transcript", "run_episode",
]
