"""The one tokenizer interface every rljax module codes against.

A `Tokenizer` turns text into token ids and back, knows its pad/bos/eos ids, and renders
chat messages through a jinja chat template the way transformers does (`chat.py`).
Backends (`hf.py`, `spm.py`, `qwen.py`, `char.py`) implement three small hooks.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rljax.errors import ConfigError, DataError
from rljax.tokenizers.chat import render_chat


def as_int_list(ids: Iterable[Any]) -> list[int]:
    """Plain Python ints from a list, tuple or NumPy/JAX array of ids."""
    return [int(i) for i in ids]


def check_token_ids(ids: Any, vocab_size: int, what: str = "token id") -> None:
    """Raises a DataError naming the first id of `ids` (any shape) outside [0, vocab_size).

    `what` names the ids in the message, e.g. "prompt token id" or "CharTokenizer token id".
    """
    ids = np.asarray(ids)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise DataError(f"{what} {int(bad.flat[0])} is outside the vocabulary [0, {vocab_size})")


class Tokenizer(abc.ABC):
    """Text <-> ids, special ids, and chat templates.

    Attributes:
      vocab_size: one more than the largest id this tokenizer can produce.
      pad_id: id used for padding (the configured pad token, else the first eos id, else 0;
        padded positions are always masked, so the value never reaches a loss).
      bos_id: begin-of-sequence id, or None when the vocabulary has none (Qwen).
      eos_ids: every id that ends a generation (tokenizer eos first, then generation/model
        config eos).
      chat_template: the jinja chat template, or None.
      special_tokens: named special tokens given to chat templates (`bos_token`, `eos_token`, ...).
    """

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: Mapping[str, str]

    # Backend hooks -------------------------------------------------------------------------
    @abc.abstractmethod
    def _encode(self, text: str) -> list[int]:
        """Ids of `text`, special-token strings in the text included, with no bos/eos added."""

    @abc.abstractmethod
    def _decode(self, ids: list[int], skip_special: bool) -> str:
        """Text of `ids`; special tokens dropped when `skip_special`."""

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(t) for t in texts]

    def save(self, directory) -> list[str]:
        """Writes this tokenizer into `directory` (beside exported weights) in a form
        `rljax.tokenizers.load` reads back to the same ids; returns the file names written.
        Each backend says which other loaders read its files."""
        raise ConfigError(f"{type(self).__name__} cannot be saved; implement save(directory) for it")

    def _decode_many(self, batch_ids: list[list[int]], skip_special: bool) -> list[str]:
        return [self._decode(ids, skip_special) for ids in batch_ids]

    # Public interface ----------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; with `add_bos`, `bos_id` is prepended (a no-op when there is none).

        No other post-processing is applied (this is transformers' `add_special_tokens=False`),
        so a rendered chat template, which already holds its own special tokens, encodes as is.
        """
        ids = self._encode(text)
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        """`encode` for each text (the HF backend runs them in parallel in Rust)."""
        batch = self._encode_many(list(texts))
        if add_bos and self.bos_id is not None:
            batch = [[self.bos_id, *ids] for ids in batch]
        return batch

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids` (a list or a 1-D array); special tokens are dropped when `skip_special`."""
        return self._decode(as_int_list(ids), skip_special)

    def decode_batch(
        self, batch_ids: Iterable[Iterable[int]], skip_special: bool = True
    ) -> list[str]:
        """`decode` for each row of `batch_ids`."""
        return self._decode_many([as_int_list(ids) for ids in batch_ids], skip_special)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role", "content"}, ...]) with the chat template, as text.

        Equals transformers' `apply_chat_template(messages, tokenize=False, ...)`; encode the
        result with `encode(text)` (no `add_bos`: templates write their own bos). Extra keyword
        arguments (`tools`, `enable_thinking`, ...) are passed to the template.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ConfigError(
                f"{type(self).__name__} has no chat template; pass chat_template='...' or load a "
                "tokenizer whose tokenizer_config.json or chat_template.jinja provides one"
            )
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, pad_id={self.pad_id}, "
            f"bos_id={self.bos_id}, eos_ids={self.eos_ids})"
        )
