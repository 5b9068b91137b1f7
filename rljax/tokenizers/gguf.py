"""The tokenizer stored in a GGUF file's metadata, as an `HFTokenizer` built with `tokenizers`.

A GGUF has no `tokenizer.json`: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), the
BPE merges (`tokenizer.ggml.merges`), each token's type (`tokenizer.ggml.token_type`: 1 normal,
3 control, 4 user-defined), the special token ids and the chat template (`tokenizer.chat_template`)
as metadata (format reference: llama.cpp's `gguf-py/gguf/constants.py`, key `Keys.Tokenizer`).
We rebuild the byte-level BPE tokenizer those describe the way transformers' GGUF loader does
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`: `byte_level_tokenizer`,
`add_gguf_special_tokens`, `set_split_regex`), so ids agree with
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` without transformers at run time: the
tokenizers test checks it on 200 strings and the chat template's output.

Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is supported, with the pre-tokenizer
splits named below; anything else is refused in one line naming the key, rather than
tokenised silently in a way the model was not trained on.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from rljax.errors import DataError
from rljax.tokenizers.hf import HFTokenizer

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex before byte-level encoding; None: GPT-2's own regex
# (transformers' fallback, which "smollm" gets there too: SmolLM2's vocabulary has no multi-digit
# merges, so its digit splitting changes no id).
PRE_TOKENIZER_SPLITS: dict[str | None, str | None] = {
    None: None, "default": None, "gpt-2": None, "smollm": None,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4
_NAMED_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
              "pad_token": "padding_token_id"}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level BPE vocabularies are spelled."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def _field(reader, key: str, default: Any = None) -> Any:
    """One metadata value; string arrays are decoded from the reader's parts directly (the
    generic `contents()` takes seconds for a 49k-entry vocabulary)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types and field.types[0].name == "ARRAY" and len(field.types) > 1 and field.types[1].name == "STRING":
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return field.contents()


def read_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF file (keys without the `tokenizer.` prefix), cached by
    (path, size, mtime): parsing the file's metadata takes seconds, and a run, its export and
    its evaluation each ask for the tokenizer. Treat the returned dict as read-only."""
    stat = Path(path).stat()
    return _read_tokenizer_metadata(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=2)
def _read_tokenizer_metadata(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # ValueError/IndexError on a truncated file
        raise DataError(f"{path} is not a complete GGUF file ({str(e).splitlines()[0] if str(e) else e!r}); "
                        "re-download or re-convert it") from e
    return {name[len("tokenizer."):]: _field(reader, name) for name in reader.fields if name.startswith("tokenizer.")}


def gguf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer a GGUF file describes: byte-level BPE with its control tokens as special
    tokens, its user-defined tokens as added tokens, its named special tokens and chat template."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no GGUF file at {str(path)!r}; check the path")
    meta = read_tokenizer_metadata(path)
    kind = meta.get("ggml.model")
    if kind != "gpt2":
        raise DataError(f"{path.name}: tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2' "
                        "(byte-level BPE)")
    pre = meta.get("ggml.pre")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise DataError(f"{path.name}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                        f"{', '.join(sorted(str(k) for k in PRE_TOKENIZER_SPLITS if k))}")
    tokens: list[str] = meta.get("ggml.tokens") or []
    merges: list[str] = meta.get("ggml.merges") or []
    if not tokens or not merges:
        raise DataError(f"{path.name} lacks tokenizer.ggml.{'tokens' if not tokens else 'merges'}; "
                        "it does not carry a byte-level BPE tokenizer")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges],
                                              fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    backend.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    backend.decoder = decoders.ByteLevel()
    types = meta.get("ggml.token_type") or []
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; transformers
    # skips it (adding it would grow the vocabulary past the model's), and so do we.
    backend.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab])
    named = {name: tokens[meta[f"ggml.{key}"]] for name, key in _NAMED_IDS.items()
             if meta.get(f"ggml.{key}") is not None and meta[f"ggml.{key}"] < len(tokens)}
    return HFTokenizer(backend, special_tokens=named, chat_template=meta.get("chat_template"))
