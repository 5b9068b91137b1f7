"""The host side of a multi-turn rollout: the environments the sampler steps between turns.

`EpisodeHost` is what `rljax.sampling.multiturn` calls through `io_callback`: it decodes each
finished model turn with the run's tokenizer, steps the environments through the verifier pool
(`rljax.envs.step_batch`: time limits, failures as error observations) and encodes the
observations, cut to `max_observation_tokens` with a marker. Host-side only (numpy), so the
traceable rollout (`rljax.stages.episodes`) and the greedy episode evaluation
(`rljax.evaluation.episodes`) share it. It lives with the sampler it serves: `rljax.envs` knows
nothing of sampling.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import numpy as np

from rljax.envs.base import Environment, StepResult
from rljax.envs.runner import reset_batch, step_batch
from rljax.errors import ConfigError, DataError
from rljax.rewards.pool import VerifierPool
from rljax.sampling import multiturn as MT

_KIND_IDS = {"tool_call": MT.KIND_TOOL_CALL, "answer": MT.KIND_ANSWER, "void": MT.KIND_VOID}


@dataclasses.dataclass
class _Batch:
    states: list
    actions: list[list[str]]
    results: list[list[StepResult]]


class EpisodeHost:
    """The host side of `rljax.sampling.multiturn`: ``reset(index_b) -> id`` and
    ``step(id, tokens_bn, turn_start_b, step, needs_b) -> EnvOutput``.

    ``table[i]`` is example i (an `Example` or a dict with the verifier's fields); ``tokenizer``
    decodes turns and encodes observations; ``pool`` runs the steps (None: the shared default
    pool; ``VerifierPool(0)``: inline). `last` holds the latest batch's actions and step results
    (for logs and metrics); host seconds accumulate until `take_seconds`.
    """

    def __init__(self, env: Environment, tokenizer: Any, table: Sequence[Any], *, max_observation_tokens: int,
                 truncation_marker: str = "...", pool: VerifierPool | None = None, keep: int = 2) -> None:
        self.env, self.tokenizer, self.table, self.pool = env, tokenizer, table, pool
        self.max_observation_tokens = int(max_observation_tokens)
        self.marker_ids = list(tokenizer.encode(truncation_marker)) if truncation_marker else []
        if len(self.marker_ids) >= self.max_observation_tokens:
            raise ConfigError(f"env.max_observation_tokens={self.max_observation_tokens} leaves no room beside the "
                              f"truncation marker ({len(self.marker_ids)} tokens); raise it")
        self._batches: dict[int, _Batch] = {}
        self._next_id, self._keep = 0, keep
        self._seconds = 0.0

    def reset(self, index_b) -> np.int32:
        start = time.perf_counter()
        examples = [self.table[int(i)] for i in np.asarray(index_b)]
        states, _ = reset_batch(self.env, examples)
        episode_id = self._next_id
        self._next_id += 1
        self._batches[episode_id] = _Batch(states, [[] for _ in states], [[] for _ in states])
        for old in [k for k in self._batches if k <= episode_id - self._keep]:
            del self._batches[old]
        self._seconds += time.perf_counter() - start
        return np.int32(episode_id)

    def step(self, episode_id, tokens_bn, turn_start_b, step, needs_b) -> MT.EnvOutput:
        start = time.perf_counter()
        batch = self._batches[int(episode_id)]
        tokens_bn, turn_start_b, needs_b = np.asarray(tokens_bn), np.asarray(turn_start_b), np.asarray(needs_b)
        rows = np.flatnonzero(needs_b)
        turns = self.tokenizer.decode_batch([tokens_bn[r, turn_start_b[r]:int(step)].tolist() for r in rows],
                                            skip_special=True)
        actions: list[str | None] = [None] * len(batch.states)
        for r, text in zip(rows, turns):
            actions[r] = text
        stepped = step_batch(self.env, batch.states, actions, pool=self.pool)
        b, o = len(batch.states), self.max_observation_tokens
        out = MT.EnvOutput(np.zeros((b, o), np.int32), np.zeros(b, np.int32), np.zeros(b, bool),
                           np.zeros(b, np.float32), np.zeros(b, np.int32), np.zeros(b, bool))
        for r in rows:
            result = stepped.results[r]
            ids = [] if result.done else self.observation_ids(result.observation_text)
            out.obs_bo[r, :len(ids)] = ids
            out.obs_len_b[r], out.done_b[r], out.reward_b[r] = len(ids), result.done, result.reward
            out.kind_b[r], out.tool_error_b[r] = _KIND_IDS[result.kind], result.tool_error
            batch.actions[r].append(actions[r])
            batch.results[r].append(result)
        batch.states = stepped.states
        self._seconds += time.perf_counter() - start
        return out

    def observation_ids(self, text: str) -> list[int]:
        """The observation's tokens, cut to the cap with the marker at the end."""
        ids = self._encode(text)
        if len(ids) <= self.max_observation_tokens:
            return ids
        return ids[:self.max_observation_tokens - len(self.marker_ids)] + self.marker_ids

    def _encode(self, text: str) -> list[int]:
        """`tokenizer.encode`, or, for a tokenizer that cannot spell every character (a character
        vocabulary meeting a tool's error message), the characters it can spell: an observation
        must never stop the rollout."""
        try:
            return list(self.tokenizer.encode(text))
        except DataError:
            text = text[:8 * self.max_observation_tokens]  # enough to fill the cap
            ids: list[int] = []
            for ch in text:
                try:
                    ids += self.tokenizer.encode(ch)
                except DataError:
                    pass
            return ids

    @property
    def last(self) -> _Batch | None:
        return self._batches[max(self._batches)] if self._batches else None

    def take_seconds(self) -> float:
        """Host seconds spent in reset and step since the previous call, then resets."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds
