"""An episode as text segments with their authors, a reference host loop, and per-token authors.

`run_episode` is the multi-turn loop written plainly: the policy writes a turn, the environment
answers, until the episode is done. The compiled rollout does the same inside its decode loop;
this version is the reference for it, and it scripts demonstrations (a warm start that shows a
tiny model how to call a tool) and the transcripts that docs colour by author.

`encode_transcript` tokenises each segment on its own. That is what the rollout does (the model's
tokens are the ones it sampled; an observation is encoded when it arrives), and it is not the
same as encoding the joined text: a BPE merge across a segment boundary would move tokens from one
author to the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from rljax.envs.base import Environment, StepResult
from rljax.envs.masks import ENV, MODEL, PROMPT


@dataclasses.dataclass(frozen=True)
class Transcript:
    """``segments``: ``(author, text)`` pairs in order, authors from `rljax.envs.masks`."""

    segments: tuple[tuple[int, str], ...] = ()

    def add(self, author: int, text: str) -> Transcript:
        return Transcript((*self.segments, (author, text))) if text else self

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.segments)

    def by(self, author: int) -> str:
        """Everything one author wrote, joined."""
        return "".join(t for a, t in self.segments if a == author)


@dataclasses.dataclass(frozen=True)
class Episode:
    """A finished (or turn-limited) episode: its transcript, model turns and the env's answers."""

    transcript: Transcript
    actions: tuple[str, ...]
    results: tuple[StepResult, ...]

    @property
    def total_reward(self) -> float:
        return float(sum(r.reward for r in self.results))


def run_episode(env: Environment, example: Any, policy: Callable[[str], str], prompt: str | None = None,
                max_steps: int = 64) -> Episode:
    """Plays one episode inline: ``policy(transcript_text) -> next model turn``.

    ``prompt`` is the rendered prompt (default: the environment's first observation). Stops when
    the environment says done, or after ``max_steps`` turns as a guard against an environment
    that never ends.
    """
    state, first = env.reset(example)
    transcript = Transcript().add(PROMPT, first if prompt is None else prompt)
    actions, results = [], []
    for _ in range(max_steps):
        action = policy(transcript.text)
        state, result = env.step(state, action)
        transcript = transcript.add(MODEL, action).add(ENV, result.observation_text)
        actions.append(action)
        results.append(result)
        if result.done:
            break
    return Episode(transcript, tuple(actions), tuple(results))


def encode_transcript(transcript: Transcript, encode: Callable[[str], Sequence[int]]
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(ids_t, author_t): each segment encoded on its own with ``encode`` (e.g. a tokenizer's
    ``encode``), and the author of every token."""
    pieces = [(a, list(encode(text))) for a, text in transcript.segments]
    ids = np.asarray([i for _, p in pieces for i in p], np.int32)
    authors = np.asarray([a for a, p in pieces for _ in p], np.int32)
    return ids, authors
