"""A character-level tokenizer for tiny jobs (arithmetic prompts like "12+34=").

Ids: 0 = pad, 1 = bos, 2 = eos, then one id per alphabet character in the given order.
The special-token strings ("<pad>", "<bos>", "<eos>" by default) are recognised in text, as HF
added tokens are, so a chat template may write `{{ bos_token }}`.

`save` writes it as a Hugging Face fast tokenizer (a merge-free BPE over the same pieces, so
every character is one token) that `rljax.tokenizers.load` and transformers read back to the
same ids (`CharTokenizer.save` says which transformers loader, for which alphabet).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from rljax.errors import ConfigError, DataError
from rljax.tokenizers.base import Tokenizer, check_token_ids

# The `model.tokenizer` spelling of a character tokenizer: "chars:0123456789+-= ".
CHARS_PREFIX = "chars:"

# Messages' contents, one after another: tiny alphabets have no room for role markers.
CONCAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


class CharTokenizer(Tokenizer):
    """One id per character of `alphabet`, after pad/bos/eos (ids 0, 1, 2)."""

    def __init__(
        self,
        alphabet: str | Sequence[str],
        *,
        pad_token: str = "<pad>",
        bos_token: str = "<bos>",
        eos_token: str = "<eos>",
        chat_template: str | None = CONCAT_TEMPLATE,
    ):
        chars = list(alphabet)
        if not chars:
            raise ConfigError(
                "CharTokenizer needs a non-empty alphabet, e.g. CharTokenizer('0123456789+= ')"
            )
        if any(not isinstance(c, str) or len(c) != 1 for c in chars):
            raise ConfigError("CharTokenizer alphabet entries must be single characters")
        dupes = sorted({c for c in chars if chars.count(c) > 1})
        if dupes:
            raise ConfigError(
                f"CharTokenizer alphabet repeats {''.join(dupes)!r}; list each character once"
            )
        specials = (pad_token, bos_token, eos_token)
        if len(set(specials)) != 3 or any(len(s) < 2 for s in specials):
            raise ConfigError(
                "CharTokenizer pad/bos/eos tokens must be distinct strings of 2+ characters"
            )
        self.alphabet = "".join(chars)
        self.pieces = (*specials, *chars)
        self._ids = {p: i for i, p in enumerate(self.pieces)}
        self._special_re = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
        self.vocab_size = len(self.pieces)
        self.pad_id, self.bos_id, self.eos_ids = 0, 1, (2,)
        self.special_tokens = {
            "pad_token": pad_token,
            "bos_token": bos_token,
            "eos_token": eos_token,
        }
        self.chat_template = chat_template

    def _encode(self, text: str) -> list[int]:
        ids = []
        for k, part in enumerate(self._special_re.split(text)):
            if k % 2:  # a special-token string
                ids.append(self._ids[part])
                continue
            for ch in part:
                i = self._ids.get(ch)
                if i is None:
                    raise DataError(
                        f"character {ch!r} (U+{ord(ch):04X}) in {text!r} is not in the "
                        f"CharTokenizer alphabet {self.alphabet!r}; add it to the alphabet"
                    )
                ids.append(i)
        return ids

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        check_token_ids(ids, self.vocab_size, "CharTokenizer token id")
        return "".join(self.pieces[i] for i in ids if not (skip_special and i < 3))

    def save(self, directory: str | Path) -> list[str]:
        """`tokenizer.json` + `tokenizer_config.json`: a BPE with no merges over the same pieces in
        the same order (one token per character), the specials as added tokens, and a
        post-processor that prepends bos, so transformers' default `tokenizer(text)` gives
        `encode(text, add_bos=True)`.

        An ASCII alphabet is written byte-level (space as "Ġ", a ByteLevel pre-tokenizer and
        decoder), the form GPT-2-style tokenizers use: transformers 5 loads a directory whose
        config.json says `qwen2` with its Qwen2 tokenizer class whatever tokenizer_config says,
        and that class imposes a byte-level pipeline, which then reads these pieces to the same
        ids. Another alphabet is written plain (a `Fuse` decoder joins the pieces), which
        `rljax.tokenizers.load` and `PreTrainedTokenizerFast.from_pretrained(dir)` read to the same
        ids. A character outside the alphabet, which `encode` refuses, is dropped by the HF form."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as Backend

        from rljax.tokenizers.hf import write_tokenizer_config

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        byte_level = all(32 <= ord(c) < 127 for c in self.alphabet)
        chars = self.pieces[3:]
        if byte_level:  # GPT-2's byte-to-unicode map: printable ASCII is itself, space is U+0120 "Ġ"
            chars = tuple("\u0120" if c == " " else c for c in chars)
        backend = Backend(models.BPE(vocab={p: i for i, p in enumerate((*self.pieces[:3], *chars))}, merges=[]))
        backend.add_special_tokens([AddedToken(t, special=True) for t in self.pieces[:3]])
        if byte_level:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            backend.decoder = decoders.ByteLevel()
        else:
            backend.decoder = decoders.Fuse()
        bos = self.pieces[self.bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])
        backend.save(str(path / "tokenizer.json"))
        write_tokenizer_config(path, self.special_tokens, self.chat_template,
                               tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False)
        return ["tokenizer.json", "tokenizer_config.json"]
