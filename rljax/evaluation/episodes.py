"""Held-out accuracy of greedy episodes with the environment's tool: the multi-turn
`rljax.evaluation.greedy_accuracy`."""

from __future__ import annotations

import jax
import numpy as np

from rljax.envs.base import Environment
from rljax.envs.config import EnvConfig
from rljax.sampling.episode_host import EpisodeHost
from rljax.evaluation.runner import EvalSetup
from rljax.rewards.pool import VerifierPool
from rljax.sampling import SampleControls
from rljax.sampling import multiturn as MT


def episode_accuracy(setup: EvalSetup, params, env: Environment, options: EnvConfig,
                     controls: SampleControls, *, pool: VerifierPool | None = None) -> float:
    """Fraction of held-out problems solved by the greedy episode (with the tool), the multi-turn
    `rljax.evaluation.greedy_accuracy`: solved means the episode's reward is above 0.5, i.e. the
    environment scored its answer correct (turn rewards, if any, are small beside it)."""
    if not setup.examples:
        return float("nan")
    host = EpisodeHost(env, setup.tokenizer, setup.examples, max_observation_tokens=options.max_observation_tokens,
                       truncation_marker=options.truncation_marker, pool=pool)
    greedy = controls.greedy_version()
    solved = []
    for idx, real in setup.batches():
        e = MT.sample_episodes_host_loop(setup.model_cfg, params, setup.tokens_bt[idx], setup.mask_bt[idx],
                                         idx.astype(np.int32), jax.random.key(0), controls=greedy, host=host,
                                         budget=options.max_episode_tokens, max_turns=options.max_turns,
                                         max_observation_tokens=options.max_observation_tokens)
        solved.append(np.asarray(jax.device_get(e.rewards_b))[:real] > 0.5)
    return float(np.mean(np.concatenate(solved)))
