"""The verifier protocol, weighted composition and the eager batch call.

A verifier maps ``(metadata, completion) -> (score, info)``: ``metadata`` is the example's dict
(gold answer, unit tests, task name...), ``completion`` the decoded model text. Rule-based
verifiable rewards are the core of RLVR (Tülu 3, 2024; DeepSeek-R1, 2025).

A verifier with ``time_limit_s = None`` is cheap and pure (a regex, a length) and runs inline in the
caller. Any other verifier runs in a `VerifierPool` worker and is killed past its limit. Either way,
a verifier that raises, hangs or dies scores 0 and its info carries ``{"flag": "error"|"timeout"}``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from rljax.errors import ConfigError
from rljax.rewards.pool import Task, VerifierPool, default_pool

NUM_TOKENS_KEY = "completion_tokens"  # metadata key the batch call fills with each completion's length
QUESTION_KEY = "question"  # metadata key holding the question text, for guards against restating it


@runtime_checkable
class Verifier(Protocol):
    """``(metadata, completion) -> (score, info)``; ``time_limit_s=None`` means cheap, run inline."""

    name: str
    time_limit_s: float | None

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]: ...


@dataclasses.dataclass(frozen=True)
class FunctionVerifier:
    """Wraps a plain function returning a float or ``(float, info)`` as a `Verifier`.

    The function must be importable by name (defined at module level) to run in the pool.
    """

    fn: Callable[[Mapping[str, Any], str], Any]
    name: str
    time_limit_s: float | None = 5.0

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        return _as_result(self.fn(metadata, completion))


def verifier(fn: Callable[[Mapping[str, Any], str], Any], *, name: str | None = None,
             time_limit_s: float | None = 5.0) -> FunctionVerifier:
    """Makes a `Verifier` from ``fn(metadata, completion) -> float | (float, info)``."""
    return FunctionVerifier(fn, name or getattr(fn, "__name__", "verifier"), time_limit_s)


def _as_result(out: Any) -> tuple[float, dict]:
    score, info = out if isinstance(out, tuple) else (out, {})
    return float(score), dict(info)


class Rewards(NamedTuple):
    """Batch scores (a pytree: NumPy on the host, jax arrays out of `as_callback`).

    ``total_b = Σ_k weight_k · parts[k]_b``; ``parts`` holds each verifier's unweighted score;
    ``failed_b`` marks rows where any verifier crashed, hung or exceeded its limit.
    """

    total_b: Any
    parts: dict[str, Any]
    failed_b: Any


@dataclasses.dataclass(frozen=True)
class Part:
    """One named, weighted verifier of a composite reward."""

    name: str
    weight: float
    verifier: Verifier


@dataclasses.dataclass(frozen=True)
class RewardFn:
    """A weighted sum of verifiers: ``r = Σ_k w_k · s_k(metadata, completion)``. Build with `compose`."""

    parts: tuple[Part, ...]

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        """One example, inline in this process (no pool): ``(total, {part: info})``."""
        rewards, infos = self.batch([metadata], [completion], pool=VerifierPool(0))
        return float(rewards.total_b[0]), infos[0]

    def batch(self, metadatas: Sequence[Mapping[str, Any]], completions: Sequence[str], *,
              num_tokens: Sequence[int] | None = None,
              pool: VerifierPool | None = None) -> tuple[Rewards, list[dict]]:
        """Scores a batch: returns (`Rewards` of NumPy arrays, per-row ``{part: info}``).

        ``num_tokens[i]`` (the completion's length in tokens) is added to row i's metadata under
        ``"completion_tokens"``; length-based verifiers need it. ``pool`` defaults to the shared
        process-wide `default_pool`.
        """
        if len(metadatas) != len(completions):
            raise ConfigError(f"got {len(metadatas)} metadata rows for {len(completions)} "
                              "completions; pass one metadata dict per completion")
        metas = [dict(m) for m in metadatas]
        if num_tokens is not None:
            for m, n in zip(metas, num_tokens, strict=True):
                m[NUM_TOKENS_KEY] = int(n)
        needs_tokens = [p.name for p in self.parts if getattr(p.verifier, "needs_num_tokens", False)]
        if needs_tokens and num_tokens is None and any(NUM_TOKENS_KEY not in m for m in metas):
            raise ConfigError(f"parts {needs_tokens} measure length in tokens; pass num_tokens= "
                              "to batch() (as_callback passes it for you)")
        b, k = len(completions), len(self.parts)
        scores = np.zeros((k, b), np.float32)
        infos: list[dict] = [{} for _ in range(b)]
        failed = np.zeros((b,), bool)
        pooled: list[tuple[int, int]] = []
        tasks: list[Task] = []
        for j, part in enumerate(self.parts):
            for i in range(b):
                if part.verifier.time_limit_s is None:
                    self._record(scores, infos, failed, j, i, _call_inline(part.verifier, metas[i],
                                                                           completions[i]))
                else:
                    pooled.append((j, i))
                    tasks.append(Task(_call_verifier, (part.verifier, metas[i], completions[i]),
                                      float(part.verifier.time_limit_s)))
        if tasks:
            outcomes = (pool or default_pool()).run(tasks)
            for (j, i), out in zip(pooled, outcomes):
                res = out.value if out.flag is None else (0.0, {"flag": out.flag,
                                                               "message": out.message})
                self._record(scores, infos, failed, j, i, res)
        weights = np.asarray([p.weight for p in self.parts], np.float32)
        total = (weights[:, None] * scores).sum(0).astype(np.float32)
        parts = {p.name: scores[j] for j, p in enumerate(self.parts)}
        return Rewards(total, parts, failed), infos

    def _record(self, scores: np.ndarray, infos: list[dict], failed: np.ndarray, j: int, i: int,
                result: tuple[float, dict]) -> None:
        score, info = result
        if not math.isfinite(score):
            score, info = 0.0, {**info, "flag": "error", "message": f"non-finite score {score}"}
        scores[j, i] = score
        infos[i][self.parts[j].name] = info
        failed[i] |= "flag" in info


def _call_verifier(v: Verifier, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
    return _as_result(v(metadata, completion))


def _call_inline(v: Verifier, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
    try:
        return _call_verifier(v, metadata, completion)
    except Exception as e:  # noqa: BLE001  # a crashing verifier scores 0 and is flagged
        return 0.0, {"flag": "error", "message": f"{type(e).__name__}: {e}"[:500]}


def compose(*verifiers: Verifier, **terms: Verifier | tuple[float, Verifier]) -> RewardFn:
    """Combines verifiers into one reward ``r = Σ_k w_k · s_k``, each part reported by name.

    Positional verifiers get weight 1 and their own ``name``; keywords name the part and give
    ``(weight, verifier)`` or a bare verifier. Example::

        reward = compose(correct=(1.0, MathAnswer()), format=(0.1, TagFormat()),
                         length=(0.1, TargetLength(target_tokens=512)))
    """
    parts = [Part(getattr(v, "name", repr(v)), 1.0, v) for v in verifiers]
    for name, term in terms.items():
        weight, v = term if isinstance(term, tuple) else (1.0, term)
        parts.append(Part(name, float(weight), v))
    if not parts:
        raise ConfigError("compose() needs at least one verifier")
    for p in parts:
        if not isinstance(p.verifier, Verifier):
            raise ConfigError(f"part {p.name!r} is not a verifier (needs name, time_limit_s and "
                              "__call__(metadata, completion)); wrap functions with verifier(fn)")
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise ConfigError(f"duplicate part names {names}; name the parts with keywords")
    return RewardFn(tuple(parts))
