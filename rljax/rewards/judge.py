"""A generative judge's two traceable halves: the judge's input rows, built on device from the
rollout's prompt and completion tokens and a tokenised template, and its verdict, parsed from the
tokens it decodes (LLM-as-a-judge, Zheng et al., 2023; verl's generative reward models). The
decode between them is the sampler's (`rljax.update.advantages` runs it inside the update).

    template "Q: {prompt}\\nA: {completion}\\nCorrect? "  ->  prefix, middle, suffix token ids
    row = prefix + prompt (its real tokens) + middle + completion (real, EOS dropped) + suffix

Verdicts are token sequences with scores ("Yes" -> 1, "No" -> 0): a decode that starts with one
of them scores it (the first listed wins); any other decode scores `default` and is counted as
unparsed.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
    """A judge's static settings, as token ids: the template's pieces, the verdicts and their
    scores, the unparsed score, how many tokens it decodes, the ids it stops on, and the policy's
    ids left out of a completion (EOS) and its pad id."""

    prefix: tuple[int, ...]
    middle: tuple[int, ...]
    suffix: tuple[int, ...]
    verdicts: tuple[tuple[tuple[int, ...], float], ...]
    default: float
    max_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int


def judge_rows(prompt_tokens_bp, prompt_mask_bp, completion_tokens_bc, completion_mask_bc, *,
               prefix: Sequence[int], middle: Sequence[int], suffix: Sequence[int], pad_id: int,
               drop_ids: Sequence[int] = ()):
    """The judge's input rows [B, W] and mask, left-padded: the template's pieces around each
    row's real prompt and completion tokens (`drop_ids`, e.g. EOS, left out of the completion),
    W = len(prefix) + P + len(middle) + C + len(suffix). The valid tokens of the concatenation
    are moved to the right in order (a stable sort on validity)."""
    b = prompt_tokens_bp.shape[0]

    def const(ids):
        ids = jnp.asarray(list(ids), jnp.int32).reshape(1, -1)
        return jnp.broadcast_to(ids, (b, ids.shape[1])), jnp.ones((b, ids.shape[1]), bool)

    keep_c = completion_mask_bc.astype(bool)
    for i in drop_ids:
        keep_c = keep_c & (completion_tokens_bc != i)
    parts = [const(prefix), (prompt_tokens_bp.astype(jnp.int32), prompt_mask_bp.astype(bool)), const(middle),
             (completion_tokens_bc.astype(jnp.int32), keep_c), const(suffix)]
    tokens = jnp.concatenate([t for t, _ in parts], axis=1)
    valid = jnp.concatenate([m for _, m in parts], axis=1)
    order = jnp.argsort(valid.astype(jnp.int32), axis=1, stable=True)  # padding first, real tokens in order
    tokens, valid = jnp.take_along_axis(tokens, order, 1), jnp.take_along_axis(valid, order, 1)
    return jnp.where(valid, tokens, pad_id), valid


def parse_verdicts(tokens_bk, mask_bk, verdicts: Sequence[tuple[Sequence[int], float]], default: float):
    """(scores [B] f32, parsed [B] bool) of decoded verdict tokens [B, K]: the score of the first
    verdict whose ids the decode starts with, else `default` (unparsed)."""
    b, k = tokens_bk.shape
    score = jnp.full((b,), default, jnp.float32)
    parsed = jnp.zeros((b,), bool)
    for ids, value in reversed(list(verdicts)):  # reversed: the first listed is applied last and wins
        ids = list(ids)
        if not ids or len(ids) > k:
            continue
        want = jnp.asarray(ids, tokens_bk.dtype)[None, :]
        hit = jnp.all((tokens_bk[:, :len(ids)] == want) & mask_bk[:, :len(ids)].astype(bool), axis=1)
        score = jnp.where(hit, jnp.float32(value), score)
        parsed = parsed | hit
    return score, parsed


def split_template(template: str) -> tuple[str, str, str]:
    """(prefix, middle, suffix) around "{prompt}" and "{completion}", which must each appear once,
    in that order."""
    if template.count("{prompt}") != 1 or template.count("{completion}") != 1 \
            or template.index("{prompt}") > template.index("{completion}"):
        raise ValueError("a judge template holds {prompt} then {completion}, once each")
    prefix, rest = template.split("{prompt}")
    middle, suffix = rest.split("{completion}")
    return prefix, middle, suffix

