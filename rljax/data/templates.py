"""Prompt text from examples, its tokens, and the bucket each batch of prompt tokens is padded to.

A `PromptFormat` is a format string over ``{question}`` and the example's metadata keys,
optionally wrapped in the tokenizer's chat template. `encode_prompts` renders and tokenises a
set of examples once, for training, evaluation and the warm start alike, with one rule for a
prompt longer than the limit: it is dropped and counted, never cut. Prompts are left-padded (by
`rljax.tokenizers.pad_batch`) so every row's last prompt token sits in the same column, where
the sampler starts generating.
The reference answer is deliberately not a template field: it must never reach the prompt.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Sequence
from typing import Any, Protocol

from rljax.data.example import Example
from rljax.errors import ConfigError, DataError


class PromptTokenizer(Protocol):
    """The part of `rljax.tokenizers.Tokenizer` that prompt rendering uses (`encode_batch` is used
    when the tokenizer has it)."""

    pad_id: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str: ...


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How an `Example` becomes prompt text.

    template: ``str.format`` string over ``question`` and the example's metadata keys.
    chat: wrap the formatted text as a user message in the tokenizer's chat template
      (examples that carry `messages` use those as they are).
    system: an optional system message for chat prompts.
    """

    template: str = "{question}"
    chat: bool = False
    system: str | None = None

    def __post_init__(self):
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        except ValueError as err:
            raise ConfigError(f"prompt template {self.template!r} is not a format string: {err}") from None
        if "answer" in names:
            raise ConfigError("prompt template must not use {answer}: the reference answer would leak into the prompt")
        if any(not n or not n.isidentifier() for n in names):
            raise ConfigError(f"prompt template {self.template!r} needs named fields such as {{question}}")

    def fields(self) -> tuple[str, ...]:
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None)


def render_prompt(example: Example, fmt: PromptFormat, tokenizer: PromptTokenizer | None = None) -> str:
    """Prompt text for one example: the filled template, chat-wrapped when `fmt.chat`."""
    if example.messages is not None:
        if not fmt.chat:
            raise ConfigError(f"example {example.id!r} is a chat conversation; set the prompt format's chat=True")
        messages = list(example.messages)
    else:
        values: dict[str, Any] = {**example.metadata, "question": example.question}
        missing = [f for f in fmt.fields() if f not in values]
        if missing:
            raise ConfigError(f"prompt template field {missing[0]!r} is not in example {example.id!r}; "
                              f"available: {sorted(values)}")
        text = fmt.template.format(**values)
        if not fmt.chat:
            return text
        messages = [{"role": "user", "content": text}]
    if fmt.system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": fmt.system}, *messages]
    if tokenizer is None:
        raise ConfigError("a chat prompt format needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


@dataclasses.dataclass(frozen=True)
class EncodedPrompts:
    """The prompts that fit: `examples[i]` renders and encodes to `ids[i]` (at most `max_prompt_len`
    ids); `num_too_long` examples were dropped for encoding to more."""

    examples: tuple[Example, ...]
    ids: tuple[tuple[int, ...], ...]
    num_too_long: int
    max_prompt_len: int


def encode_prompts(examples: Sequence[Example], tokenizer: PromptTokenizer, fmt: PromptFormat, *,
                   max_prompt_len: int, add_bos: bool) -> EncodedPrompts:
    """Renders (`render_prompt`) and tokenises every example's prompt, keeping those that fit.

    The rule: a prompt whose encoding is longer than `max_prompt_len` ids is dropped and counted
    in `num_too_long`, never cut. Cutting its start would drop the instructions or the question's
    beginning, and cutting its end the generation prompt, so the model would answer a question
    nobody asked. The data pipeline, the evaluator and the warm start all use this function.
    """
    if max_prompt_len < 1:
        raise ConfigError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    texts = [render_prompt(ex, fmt, tokenizer) for ex in examples]
    if hasattr(tokenizer, "encode_batch"):
        ids = tokenizer.encode_batch(texts, add_bos=add_bos)
    else:
        ids = [tokenizer.encode(t, add_bos=add_bos) for t in texts]
    keep = [i for i, t in enumerate(ids) if len(t) <= max_prompt_len]
    return EncodedPrompts(tuple(examples[i] for i in keep), tuple(tuple(ids[i]) for i in keep),
                          len(examples) - len(keep), max_prompt_len)


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest of `buckets` that holds `length` tokens.

    A jitted consumer compiles once per bucket, not once per batch; a single bucket (the max
    prompt length) means one compilation.
    """
    for b in sorted(buckets):
        if length <= b:
            return b
    raise DataError(f"a prompt of {length} tokens is longer than the largest bucket {max(buckets)}; "
                    "raise the max prompt length")
