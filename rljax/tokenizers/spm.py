"""sentencepiece models (`tokenizer.model` files: Llama 1/2, Gemma, T5-style vocabularies).

Ids are exactly sentencepiece's `encode(text, out_type=int)`. Special ids come from the model
(`pad_id()`, `bos_id()`, `eos_id()`; -1 means none), and are overridden by a `tokenizer_config.json`
next to the model when one names them; its chat template (or `chat_template.jinja`) is used too.
sentencepiece does not parse control tokens written in text ("<s>" encodes as characters);
user-defined symbols (Gemma's "<start_of_turn>") it does.
"""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

from rljax.errors import DataError
from rljax.tokenizers.base import Tokenizer, check_token_ids
from rljax.tokenizers.hf import (
    NAMED_SPECIALS,
    chat_template_from_dir,
    config_eos_ids,
    read_json,
    token_content,
    unique,
)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model behind the rljax `Tokenizer` interface."""

    def __init__(self, model_file: str | Path, *, config_dir: str | Path | None = None):
        model_file = Path(model_file)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        except (OSError, RuntimeError) as e:
            raise DataError(
                f"{model_file} is not a sentencepiece model ({e}); pass a valid .model file"
            ) from e
        sp = self.sp
        self.vocab_size = sp.get_piece_size()
        named = {
            "bos_token": sp.bos_id(),
            "eos_token": sp.eos_id(),
            "unk_token": sp.unk_id(),
            "pad_token": sp.pad_id(),
        }
        self.special_tokens = {n: sp.id_to_piece(i) for n, i in named.items() if i >= 0}
        config, extra_eos, self.chat_template = {}, [], None
        if config_dir is not None:
            config_dir = Path(config_dir)
            config = read_json(config_dir / "tokenizer_config.json")
            extra_eos = config_eos_ids(config_dir)
            self.chat_template = chat_template_from_dir(config_dir, config)
        for name in NAMED_SPECIALS:
            token = token_content(config.get(name))
            if token and (
                sp.piece_to_id(token) != sp.unk_id() or token == sp.id_to_piece(sp.unk_id())
            ):
                self.special_tokens[name] = token
        ids = {n: sp.piece_to_id(t) for n, t in self.special_tokens.items()}
        self.bos_id = ids.get("bos_token")
        self.eos_ids = unique([i for i in (ids.get("eos_token"), *extra_eos) if i is not None])
        pad = ids.get("pad_token")
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        # ids sentencepiece's decoder silently drops: control symbols (bos/eos/pad)
        self._control = frozenset(i for i in range(self.vocab_size) if sp.is_control(i))

    def save(self, directory: str | Path) -> list[str]:
        """`tokenizer.model` (the sentencepiece model, byte for byte) + `tokenizer_config.json`
        (the special tokens and chat template). `rljax.tokenizers.load` reads the directory back
        to the same ids. transformers has no loader for a bare sentencepiece model: its
        family's slow tokenizer class reads the file (`LlamaTokenizer.from_pretrained(dir)`,
        `GemmaTokenizer`, ...), with that family's own pre-processing, so its ids are that
        class's, not necessarily these."""
        from rljax.tokenizers.hf import write_tokenizer_config

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / "tokenizer.model").write_bytes(self.sp.serialized_model_proto())
        write_tokenizer_config(path, self.special_tokens, self.chat_template)
        return ["tokenizer.model", "tokenizer_config.json"]

    def _encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int)

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        check_token_ids(ids, self.vocab_size, "sentencepiece token id")
        if skip_special:
            return self.sp.decode([i for i in ids if i not in self._control])
        # Keep control symbols as their piece text, decoding the runs between them.
        parts, run = [], []
        for i in ids:
            if i in self._control:
                parts += [self.sp.decode(run), self.sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        parts.append(self.sp.decode(run))
        return "".join(parts)
