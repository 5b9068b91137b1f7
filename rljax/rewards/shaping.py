"""Format and length rewards.

- `TagFormat`: 1 when the completion has the ``<think>…</think><answer>…</answer>`` shape
  (DeepSeek-R1, 2025, rewards this structure alongside correctness), each tag holding text: the
  cheapest reply that maxes a format reward must not be the empty shell
  ``<think></think><answer></answer>``.
- `RegexFormat`: 1 when a regular expression matches.
- `TargetLength`: ``1 − |L − L_target| / L_target``, floored at 0, rewarding a length budget
  (in the spirit of LASER and GRPO-λ, 2025), and 0 for padding: a reply that zlib compresses to
  under `min_compression` of its size (one token or phrase repeated to the target; plain prose
  and worked arithmetic compress to 0.3-0.6 of their size).

DAPO's soft overlong punishment is not a verifier here: it exists once, as
`rljax.objectives.overlong_penalty`, applied in the update step by the reward-shaping config
(``shaping.overlong_max_length`` / ``shaping.overlong_buffer``), where the lengths are on device.

All are cheap and pure (``time_limit_s = None``), so they run inline, not in the pool. Length
verifiers read ``metadata["completion_tokens"]``, filled in by `RewardFn.batch(num_tokens=...)`
and by `as_callback`.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any, Mapping

from rljax.errors import ConfigError
from rljax.rewards.base import NUM_TOKENS_KEY

THINK_ANSWER = r"^\s*<think>\s*[^\s<].*?</think>\s*<answer>\s*[^\s<].*?</answer>\s*$"


@dataclasses.dataclass(frozen=True)
class RegexFormat:
    """1.0 if ``pattern`` matches the completion (``re.search``, DOTALL), else 0.0."""

    pattern: str
    name: str = "format"
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"RegexFormat pattern {self.pattern!r} does not compile: {e}") from e

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        return float(re.search(self.pattern, completion, re.DOTALL) is not None), {}


@dataclasses.dataclass(frozen=True)
class TagFormat:
    """1.0 for exactly ``<think>…</think><answer>…</answer>`` (each tag once, nothing around, each
    holding some text)."""

    think_tag: str = "think"
    answer_tag: str = "answer"
    name: str = "format"
    time_limit_s: float | None = None

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        t, a = re.escape(self.think_tag), re.escape(self.answer_tag)
        shaped = re.fullmatch(rf"\s*<{t}>\s*\S.*</{t}>\s*<{a}>\s*\S.*</{a}>\s*", completion, re.DOTALL)
        once = all(completion.count(f"<{x}>") == 1 and completion.count(f"</{x}>") == 1
                   for x in (self.think_tag, self.answer_tag))
        return float(bool(shaped) and once), {}


def _num_tokens(metadata: Mapping[str, Any]) -> int:
    if NUM_TOKENS_KEY not in metadata:
        raise ConfigError(f"length rewards need metadata[{NUM_TOKENS_KEY!r}]; "
                          "pass num_tokens= to RewardFn.batch")
    return int(metadata[NUM_TOKENS_KEY])


@dataclasses.dataclass(frozen=True)
class TargetLength:
    """``max(0, 1 − |L − target| / target)`` with L in tokens: 1 at the target, 0 at 0 or 2×target."""

    target_tokens: int
    name: str = "length"
    time_limit_s: float | None = None
    needs_num_tokens: bool = True
    min_compression: float = 0.15

    def __post_init__(self) -> None:
        if self.target_tokens <= 0:
            raise ConfigError(f"TargetLength.target_tokens must be > 0, got {self.target_tokens}")

    def __call__(self, metadata: Mapping[str, Any], completion: str) -> tuple[float, dict]:
        n = _num_tokens(metadata)
        ratio = compression_ratio(completion)
        if ratio < self.min_compression:
            return 0.0, {"tokens": n, "compression": ratio, "flag_padding": True}
        return max(0.0, 1.0 - abs(n - self.target_tokens) / self.target_tokens), {"tokens": n}


def compression_ratio(text: str) -> float:
    """zlib-compressed size over raw size (1.0 below 64 bytes, where the header dominates)."""
    raw = text.encode()
    return 1.0 if len(raw) < 64 else len(zlib.compress(raw, 9)) / len(raw)
