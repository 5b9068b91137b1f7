"""HF `tokenizer.json` through the `tokenizers` library, configured as transformers configures it.

From a directory (what `save_pretrained` writes):
  - `tokenizer.json`: the fast tokenizer (normaliser, pre-tokeniser, model, decoder, added tokens);
  - `tokenizer_config.json`: named special tokens (`bos_token`, `eos_token`, `pad_token`, ... as a
    string or an AddedToken dict), `added_tokens_decoder`, `extra_special_tokens` /
    `additional_special_tokens`, `clean_up_tokenization_spaces`, and maybe `chat_template`;
  - `chat_template.jinja` (transformers v5), which wins over the config's template, or the legacy
    `chat_template.json`;
  - `generation_config.json` / `config.json`: their `eos_token_id` (int or list) joins `eos_ids`.
Special tokens named in the config but missing from the vocabulary are added, as transformers adds
them, so ids agree with `AutoTokenizer.from_pretrained` on the same directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from rljax.errors import DataError
from rljax.tokenizers.base import Tokenizer

NAMED_SPECIALS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); re-save it") from e


def token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict `{"content": ...}`."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def chat_template_from_dir(path: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The chat template: `chat_template.jinja` > tokenizer_config > `chat_template.json`."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None:
        template = read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def config_eos_ids(path: Path) -> list[int]:
    """`eos_token_id` from generation_config.json, then config.json (each an int or a list)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        eos = read_json(path / name).get("eos_token_id")
        ids.extend([eos] if isinstance(eos, int) else list(eos or []))
    return ids


def write_tokenizer_config(path: Path, special_tokens: Mapping[str, str], chat_template: str | None,
                           **fields: Any) -> None:
    """`tokenizer_config.json` as transformers and `from_dir` read it: the named special tokens,
    the chat template (inline, which transformers 4 and 5 both read) and any other `fields`."""
    config = {**fields, **{n: t for n, t in special_tokens.items() if n in NAMED_SPECIALS}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                encoding="utf-8")


def unique(ids: list[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` with special ids and a chat template (see the module docstring)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        extra_eos_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
        clean_up_spaces: bool = False,
    ):
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._clean_up_spaces = clean_up_spaces
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        ids = {name: backend.token_to_id(tok) for name, tok in self.special_tokens.items()}
        self.bos_id = ids.get("bos_token")
        self.eos_ids = unique([i for i in (ids.get("eos_token"), *extra_eos_ids) if i is not None])
        pad = ids.get("pad_token")
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load `path/tokenizer.json` plus the config files listed in the module docstring."""
        path = Path(path)
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust error names the bad field
            raise DataError(
                f"{path / 'tokenizer.json'} could not be read by `tokenizers`: {e}"
            ) from e
        config = read_json(path / "tokenizer_config.json")
        named = {n: token_content(config.get(n)) for n in NAMED_SPECIALS}
        named = {n: t for n, t in named.items() if t}
        extras = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extras = list(extras.values()) if isinstance(extras, Mapping) else list(extras)
        declared = [
            v for v in config.get("added_tokens_decoder", {}).values() if isinstance(v, Mapping)
        ]
        # transformers adds declared and named special tokens that the vocabulary lacks
        for entry in declared:
            if entry.get("content") and backend.token_to_id(entry["content"]) is None:
                token = tokenizers.AddedToken(entry["content"], special=bool(entry.get("special")))
                backend.add_tokens([token])
        # ... and registers every named special token as special, even one that is an ordinary
        # vocabulary entry (e.g. "[UNK]" in a WordLevel vocab), so decode(skip_special) drops it.
        wanted = [
            t for t in dict.fromkeys([*named.values(), *(token_content(t) for t in extras)]) if t
        ]
        backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in wanted])
        model_is_bpe = type(backend.model).__name__ == "BPE"
        clean = bool(config.get("clean_up_tokenization_spaces", False)) and (
            not model_is_bpe
            or bool(
                config.get(
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
                )
            )
        )
        return cls(
            backend,
            special_tokens=named,
            extra_eos_ids=tuple(config_eos_ids(path)),
            chat_template=chat_template_from_dir(path, config),
            clean_up_spaces=clean,
        )

    def save(self, directory: str | Path) -> list[str]:
        """`tokenizer.json` (the backend as loaded, added tokens included) and a
        `tokenizer_config.json`, which `from_dir` and transformers' `AutoTokenizer` both read
        back to the same ids; eos ids beyond the named eos token go to `generation_config.json`
        (unless one is there), where `from_dir` found them."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        write_tokenizer_config(path, self.special_tokens, self.chat_template,
                               tokenizer_class="PreTrainedTokenizerFast",
                               clean_up_tokenization_spaces=self._clean_up_spaces)
        written = ["tokenizer.json", "tokenizer_config.json"]
        named_eos = self.backend.token_to_id(self.special_tokens.get("eos_token") or "")
        if set(self.eos_ids) - {named_eos} and not (path / "generation_config.json").exists():
            (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(self.eos_ids)}) + "\n")
            written.append("generation_config.json")
        return written

    def _encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self._clean(self.backend.decode(ids, skip_special_tokens=skip_special))

    def _decode_many(self, batch_ids: list[list[int]], skip_special: bool) -> list[str]:
        texts = self.backend.decode_batch(batch_ids, skip_special_tokens=skip_special)
        return [self._clean(t) for t in texts]

    def _clean(self, text: str) -> str:
        """transformers' `clean_up_tokenization` (WordPiece-era space fixes), when configured."""
        if not self._clean_up_spaces:
            return text
        for before, after in (
            (" .", "."),
            (" ?", "?"),
            (" !", "!"),
            (" ,", ","),
            (" ' ", "'"),
            (" n't", "n't"),
            (" 'm", "'m"),
            (" 's", "'s"),
            (" 've", "'ve"),
            (" 're", "'re"),
        ):
            text = text.replace(before, after)
        return text
