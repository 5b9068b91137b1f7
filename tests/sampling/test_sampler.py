"""Sampler: parity with transformers and the trainer, the sampling distribution, stops, compiles."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from hf_factory import make_checkpoint

import rljax.models as M
from rljax.errors import ConfigError, DataError
from rljax.sampling import (FINISH_EOS, FINISH_LENGTH, FINISH_STOP, SampleControls, filtered_logprobs,
                            generate, make_filters, sample, sample_logits, stream)

CONTROLS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.7, 10, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.8, 20, 0.9, 0.05)]


def _reference_probs(logits, temperature, top_k, top_p, min_p):
    """NumPy filtered distribution, transformers' order: temperature, top-k, top-p, min-p."""
    z = np.asarray(logits, np.float64) / temperature

    def renorm(keep):
        p = np.exp(np.where(keep, z, -np.inf) - z[keep].max())
        return p / p.sum()

    keep = np.ones(z.shape, bool)
    if top_k:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    p = renorm(keep)
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep[order[before >= top_p]] = False
        p = renorm(keep)
    if min_p > 0:
        keep &= p >= min_p * p.max()
        p = renorm(keep)
    return p


def _chi_square_pvalue(tokens, probs):
    counts = np.bincount(tokens, minlength=probs.size)
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a filtered-out token"
    expected = len(tokens) * probs[support]
    return scipy.stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("controls", CONTROLS)
def test_sample_logits_frequencies_match_filtered_distribution(controls):
    """On fixed logits, 40k draws match the NumPy filtered distribution (chi-square, p > 1e-3);
    the returned sampling log-prob and `filtered_logprobs` equal log of that distribution."""
    t, k, p, mp = controls
    logits = 1.5 * np.asarray(jax.random.normal(jax.random.key(3), (40,)))
    filters = make_filters(t, k, p, mp, False)
    draws = 40_000
    tokens, slp = jax.jit(lambda key, x: sample_logits(key, x, t, p, mp, filters=filters))(
        jax.random.key(0), jnp.tile(jnp.asarray(logits, jnp.float32), (draws, 1)))
    tokens = np.asarray(tokens)
    ref = _reference_probs(logits, t, k, p, mp)
    assert _chi_square_pvalue(tokens, ref) > 1e-3
    np.testing.assert_allclose(np.asarray(slp), np.log(ref[tokens]), atol=1e-5)
    full = np.exp(np.asarray(filtered_logprobs(jnp.asarray(logits[None], jnp.float32), t, p, mp, filters=filters)))
    np.testing.assert_allclose(full[0], ref, atol=1e-6)


def test_greedy_picks_first_maximum():
    """Greedy is the arg-max with ties to the lowest id, and reports log-prob 0."""
    logits = jnp.asarray([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    tokens, slp = sample_logits(jax.random.key(0), logits, filters=make_filters(1.0, 0, 1.0, 0.0, True))
    assert tokens.tolist() == [1, 0] and slp.tolist() == [0.0, 0.0]


# ----------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def tiny():
    cfg = M.preset("qwen2-test")
    return cfg, M.init_params(cfg, jax.random.key(0), std=0.2)


def _ragged_prompts(rng, lengths, width, vocab):
    tokens = rng.integers(0, vocab, (len(lengths), width)).astype(np.int32)
    mask = np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]
    return np.where(mask, tokens, 0), mask


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_equals_transformers_generate(family, tmp_path):
    """Greedy decoding equals transformers' greedy `generate` token for token (ragged left padding)."""
    model = make_checkpoint(family, tmp_path)
    cfg, params = M.load_hf(tmp_path)
    tokens, mask = _ragged_prompts(np.random.default_rng(0), [6, 9, 3], 9, cfg.vocab_size)
    new = 40  # three decode phases (cache widths 16, 32, 64)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                             do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    ours = generate(cfg, params, tokens, mask, key=jax.random.key(0),
                    controls=SampleControls(max_new_tokens=new, greedy=True))
    np.testing.assert_array_equal(np.asarray(ours.tokens), ref[:, tokens.shape[1]:].numpy())
    assert np.asarray(ours.mask).all() and (np.asarray(ours.finish_reason) == FINISH_LENGTH).all()


def test_policy_logprobs_equal_trainer_scoring(tiny):
    """Sampler log-probs equal token_logprobs on prompt + completion (<= 1e-5, f32), per sample row."""
    cfg, params = tiny
    n = 3
    tokens, mask = _ragged_prompts(np.random.default_rng(1), [5, 8, 2], 8, cfg.vocab_size)
    res = generate(cfg, params, tokens, mask, key=jax.random.key(4), controls=SampleControls(
        max_new_tokens=40, num_samples=n, temperature=0.9, top_k=40, top_p=0.95, eos_ids=(3, 7)))
    assert (np.asarray(res.lengths) > 32).any()  # some rows reach the third decode phase
    full = np.concatenate([np.repeat(tokens, n, 0), np.asarray(res.tokens)], 1)
    full_mask = np.concatenate([np.repeat(mask, n, 0), np.asarray(res.mask)], 1)
    logp, _ = M.token_logprobs(cfg, params, jnp.asarray(full), jnp.asarray(full_mask))
    logp = np.asarray(logp)[:, tokens.shape[1]:]
    sel = np.asarray(res.mask)
    assert sel.sum() > 20
    np.testing.assert_allclose(np.asarray(res.logprobs)[sel], logp[sel], atol=1e-5, rtol=0)
    assert (np.asarray(res.logprobs)[~sel] == 0).all() and (np.asarray(res.tokens)[~sel] == 0).all()
    # Filtering only removes mass: the sampling distribution is at least as likely on its draws.
    assert (np.asarray(res.sampling_logprobs)[sel] >= np.asarray(res.logprobs)[sel] / 0.9 - 1e-3).mean() > 0.5


def test_phased_decode_equals_one_full_width_loop(tiny):
    """Decoding in phases (cache widths N/4, N/2, N new slots, or doubling from 16) gives the
    tokens and log-probs of one loop over a cache allocated at full width from the start.

    Catches: a phase that stops one token early or late, a widening that drops the cache's keys,
    and widths that skip the bucket (rows would stop short of max_new_tokens)."""
    from rljax.sampling import decode as D
    assert D.phase_widths(64, phases=3) == (16, 32, 64) and D.phase_widths(64, 20, phases=3) == (16, 32)
    assert D.phase_widths(16, phases=3) == (16,) and D.phase_widths(1024, phases=3) == (256, 512, 1024)
    assert D.phase_widths(128, phases=9) == (16, 32, 64, 128) and D.phase_widths(64) == (64,)
    cfg, params = tiny
    tokens, mask = _ragged_prompts(np.random.default_rng(3), [5, 8], 8, cfg.vocab_size)
    controls = SampleControls(max_new_tokens=50, num_samples=2)
    full = generate(cfg, params, tokens, mask, key=jax.random.key(6), controls=controls.replace(decode_phases=1))
    for phases in (2, 3, 9):
        phased = generate(cfg, params, tokens, mask, key=jax.random.key(6),
                          controls=controls.replace(decode_phases=phases))
        np.testing.assert_array_equal(np.asarray(phased.tokens), np.asarray(full.tokens))
        # Softmax sums over a different number of (empty, zero-weight) slots: rounding-level differences.
        np.testing.assert_allclose(np.asarray(phased.logprobs), np.asarray(full.logprobs), atol=1e-5, rtol=0)
        assert int(np.asarray(phased.lengths).min()) == 50


def test_generate_first_token_frequencies_match_model(tiny):
    """End to end: first tokens of 4000 samples of one prompt follow the model's filtered
    next-token distribution (chi-square, p > 1e-3), and every row reuses the one prefill."""
    cfg, params = tiny
    prompt = np.asarray([[5, 17, 33, 2]], np.int32)
    t, k, p, mp = 0.8, 30, 0.9, 0.02
    res = generate(cfg, params, prompt, key=jax.random.key(7), controls=SampleControls(
        max_new_tokens=1, num_samples=4000, temperature=t, top_k=k, top_p=p, min_p=mp))
    logits, _ = M.forward(cfg, params, jnp.asarray(prompt))
    ref = _reference_probs(np.asarray(logits)[0, -1], t, k, p, mp)
    tokens = np.asarray(res.tokens)[:, 0]
    assert _chi_square_pvalue(tokens, ref) > 1e-3
    np.testing.assert_allclose(np.asarray(res.sampling_logprobs)[:, 0], np.log(ref[tokens]), atol=1e-4)


def test_same_key_same_tokens_and_stream_agrees(tiny):
    """The same key and inputs give the same tokens; another key gives others; `stream` yields
    exactly `generate`'s tokens in chunks."""
    cfg, params = tiny
    tokens, mask = _ragged_prompts(np.random.default_rng(2), [4, 7], 7, cfg.vocab_size)
    controls = SampleControls(max_new_tokens=20, num_samples=2, temperature=1.0, eos_ids=(9,))
    a = generate(cfg, params, tokens, mask, key=jax.random.key(1), controls=controls)
    b = generate(cfg, params, tokens, mask, key=jax.random.key(1), controls=controls)
    c = generate(cfg, params, tokens, mask, key=jax.random.key(2), controls=controls)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()
    pieces = list(stream(cfg, params, tokens, mask, key=jax.random.key(1), controls=controls, chunk=6))
    assert len(pieces) >= 2
    streamed = np.concatenate([t for t, _ in pieces], 1)
    width = streamed.shape[1]
    np.testing.assert_array_equal(streamed, np.asarray(a.tokens)[:, :width])
    assert not np.asarray(a.mask)[:, width:].any()


def test_eos_stop_sequences_and_lengths(tiny):
    """Rows stop on an EOS id or a completed stop sequence (both kept in the completion), else run
    to max_new_tokens; lengths, mask, padding and finish reasons say which."""
    cfg, params = tiny
    tokens, mask = _ragged_prompts(np.random.default_rng(3), [5, 5, 5], 5, cfg.vocab_size)
    greedy = SampleControls(max_new_tokens=10, greedy=True)
    base = np.asarray(generate(cfg, params, tokens, mask, key=jax.random.key(0), controls=greedy).tokens)
    eos = int(base[0, 3])
    stop = (int(base[1, 4]), int(base[1, 5]))
    res = generate(cfg, params, tokens, mask, key=jax.random.key(0),
                   controls=greedy.replace(eos_ids=(eos,), stop_sequences=(stop,), pad_id=1))
    lengths, reasons = np.asarray(res.lengths), np.asarray(res.finish_reason)
    expect_len = []
    for row in range(3):
        hits = [i + 1 for i in range(10) if base[row, i] == eos]
        hits += [i + 1 for i in range(1, 10) if tuple(base[row, i - 1:i + 1]) == stop]
        expect_len.append(min(hits, default=10))
    assert lengths.tolist() == expect_len and lengths[0] <= 4 and lengths[1] <= 6
    for row in range(3):
        n = lengths[row]
        np.testing.assert_array_equal(np.asarray(res.tokens)[row, :n], base[row, :n])
        assert (np.asarray(res.tokens)[row, n:] == 1).all()
        assert np.asarray(res.mask)[row].tolist() == [i < n for i in range(10)]
        last = tuple(base[row, max(n - 2, 0):n])
        want = FINISH_EOS if base[row, n - 1] == eos else FINISH_STOP if last == stop else FINISH_LENGTH
        assert reasons[row] == want
    assert FINISH_EOS in reasons.tolist()


def test_no_recompile_within_a_bucket(tiny):
    """A second call whose prompt length and max_new_tokens fall in the same buckets, with another
    temperature, compiles nothing (backend compilations counted through jax.monitoring)."""
    cfg, params = tiny
    compiles = []

    def listen(event, *_args, **_kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        rng = np.random.default_rng(4)
        controls = SampleControls(max_new_tokens=9, num_samples=2, temperature=0.7, top_k=8)
        generate(cfg, params, *_ragged_prompts(rng, [3, 6], 6, cfg.vocab_size), key=jax.random.key(0),
                 controls=controls)
        first = len(compiles)
        generate(cfg, params, *_ragged_prompts(rng, [10, 2], 11, cfg.vocab_size), key=jax.random.key(0),
                 controls=controls.replace(temperature=1.2))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert first >= 1 and len(compiles) == first


# What one `generate` configuration compiles (rljax.sampling.sampler): one program, whatever the
# scheduler or layout, for every batch and length within its buckets.
PROGRAMS_PER_CONFIGURATION = 1
_CONFIGURATIONS = {
    "static": dict(scheduler="static"),
    "continuous": dict(scheduler="continuous", slots=4),
    "paged": dict(scheduler="continuous", kv_layout="paged", max_total_tokens=256, page_size=8),
}


@pytest.mark.parametrize("name", sorted(_CONFIGURATIONS))
def test_one_configuration_compiles_a_stated_number_of_programs(tiny, name):
    """A sampler configuration compiles `PROGRAMS_PER_CONFIGURATION` programs (JAX lowerings,
    counted with `jax.monitoring`; a persistent-cache hit is still a lowering) for two batch sizes
    of one batch bucket (5 and 7 prompts: bucket 8) with prompt lengths and `max_new_tokens` in
    one length bucket each, and the rows shared by both calls draw the same tokens.

    Catches: one jitted loop per decode phase (the static sampler compiled 4 programs here: two
    phases, a widening and a trim), a prompt count that is not bucketed (a second program for 7
    prompts), a result trimmed on the device (one program per width), and padding rows that
    disturb the real ones."""
    cfg, params = tiny
    rng = np.random.default_rng(11)
    five = _ragged_prompts(rng, [3, 6, 2, 5, 4], 6, cfg.vocab_size)
    seven = _ragged_prompts(rng, [7, 2, 9, 4, 11, 1, 5], 11, cfg.vocab_size)
    seven[0][:5, -6:], seven[1][:5] = five[0], False  # its first five prompts are `five`'s
    seven[1][:5, -6:] = five[1]
    controls = SampleControls(max_new_tokens=27, num_samples=2, temperature=0.8, eos_ids=(3,),
                              **_CONFIGURATIONS[name])
    key = jax.random.key(5)
    lowerings = []

    def listen(event, *_args, **_kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowerings.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = generate(cfg, params, *seven, key=key, controls=controls)
        after_first = len(lowerings)
        second = generate(cfg, params, *five, key=key, controls=controls.replace(max_new_tokens=20))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert after_first == len(lowerings) == PROGRAMS_PER_CONFIGURATION
    assert np.asarray(first.tokens).shape == (14, 27) and np.asarray(second.tokens).shape == (10, 20)
    np.testing.assert_array_equal(np.asarray(second.tokens), np.asarray(first.tokens)[:10, :20])


def test_bad_inputs_raise_one_line_errors(tiny):
    """Empty prompts and out-of-vocabulary ids raise DataError."""
    cfg, params = tiny
    key, controls = jax.random.key(0), SampleControls(max_new_tokens=2)
    with pytest.raises(DataError, match="at least one real token"):
        generate(cfg, params, np.zeros((1, 3), np.int32), np.zeros((1, 3), bool), key=key, controls=controls)
    with pytest.raises(DataError, match=f"prompt token id 999 is outside the vocabulary \\[0, {cfg.vocab_size}\\)"):
        generate(cfg, params, np.full((1, 3), 999, np.int32), key=key, controls=controls)


# ----------------------------------------------------------------------------- SampleControls


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", 0), ("num_samples", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", 1.0), ("min_p", -0.1), ("top_k", -1), ("stop_sequences", ((4,), ())), ("top_k", "many")])
def test_bad_control_is_one_config_error_line(field, value):
    """Each out-of-range control is rejected when the controls are built (before any model runs),
    as one ConfigError line that names the field."""
    with pytest.raises(ConfigError) as err:
        SampleControls(**{"max_new_tokens": 4, field: value})
    assert "\n" not in str(err.value) and str(err.value).startswith("sampling: ")
    assert field in str(err.value) or field == "top_k" and "number" in str(err.value)


def test_controls_helpers_and_hashable_static_half():
    """`replace` re-validates; `greedy_version` keeps limits and stops; `with_tokenizer` fills only
    unset EOS / pad ids; lists become tuples, so controls and their static half are hashable."""
    c = SampleControls(max_new_tokens=6, num_samples=4, temperature=0.7, top_p=0.95, eos_ids=[5],
                       stop_sequences=[[1, 2]])
    assert c.eos_ids == (5,) and c.stop_sequences == ((1, 2),) and hash(c) == hash(c.replace())
    g = c.greedy_version()
    assert (g.greedy, g.num_samples, g.max_new_tokens, g.stop_sequences) == (True, 1, 6, ((1, 2),))
    assert g.static().filters.greedy and not c.static().filters.greedy
    with pytest.raises(ConfigError, match="top_p"):
        c.replace(top_p=0.0)

    class Tok:
        eos_ids, pad_id = (2, 3), 9

    assert c.with_tokenizer(Tok()).eos_ids == (5,)  # set explicitly: kept
    filled = SampleControls(max_new_tokens=6).with_tokenizer(Tok(), extra_eos_ids=(3, 4))
    assert (filled.eos_ids, filled.pad_id) == ((2, 3, 4), 9)
    unset = SampleControls(max_new_tokens=6).static()
    assert (unset.eos_ids, unset.pad_id) == ((), 0)
    # Traced values stay out of the static half: another temperature or length compiles nothing new.
    assert c.static() == c.replace(temperature=1.3, top_p=0.9, max_new_tokens=7).static()


# Tokens drawn before SampleControls became the only form (generate's keyword arguments), for
# qwen2-test init_params(key 0, std 0.2): greedy, then top-k/top-p/min-p sampling with an EOS id and a
# stop sequence (row 0 stops on EOS 56, row 1 on the stop sequence (38, 0), pad 1).
_PROMPTS = (np.asarray([[0, 0, 5, 17, 33], [4, 8, 15, 16, 23]], np.int32),
            np.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool))
_GREEDY = [[123, 76, 92, 14, 119, 14, 113, 58], [39, 118, 63, 114, 3, 116, 8, 54]]
_SAMPLED = [[120, 78, 35, 58, 53, 1, 1, 1], [123, 42, 61, 105, 1, 1, 1, 1],
            [63, 0, 21, 109, 60, 17, 85, 70], [100, 58, 8, 4, 44, 70, 70, 39]]


def test_sample_controls_are_the_one_form(tiny):
    """generate, stream and the traceable sample take one SampleControls and draw the same fixed
    expected runs (recorded when rows got their own keys, fold_in(key, row)); the keyword form is
    gone."""
    from rljax.sampling import sampler as S
    cfg, params = tiny
    tokens, mask = _PROMPTS
    greedy = SampleControls(max_new_tokens=8, greedy=True)
    sampled = SampleControls(max_new_tokens=8, num_samples=2, temperature=0.9, top_k=40, top_p=0.95, min_p=0.01,
                             eos_ids=(53,), stop_sequences=((61, 105),), pad_id=1)
    g = generate(cfg, params, tokens, mask, key=jax.random.key(0), controls=greedy)
    assert np.asarray(g.tokens).tolist() == _GREEDY
    res = generate(cfg, params, tokens, mask, key=jax.random.key(3), controls=sampled)
    assert np.asarray(res.tokens).tolist() == _SAMPLED
    assert np.asarray(res.lengths).tolist() == [5, 4, 8, 8]
    assert np.asarray(res.finish_reason).tolist() == [FINISH_EOS, FINISH_STOP, FINISH_LENGTH, FINISH_LENGTH]

    streamed = list(stream(cfg, params, tokens, mask, key=jax.random.key(3), controls=sampled, chunk=3))
    assert np.concatenate([t for t, _ in streamed], 1).tolist() == _SAMPLED
    padded, padded_mask = S.pad_prompts(cfg, tokens, mask, pad_id=1)
    traced = jax.jit(sample, static_argnames=("cfg", "controls"))(
        cfg, params, padded, padded_mask, jax.random.key(3), controls=sampled)
    assert np.asarray(traced.tokens).tolist() == _SAMPLED
    np.testing.assert_allclose(np.asarray(traced.logprobs), np.asarray(res.logprobs), atol=1e-5, rtol=0)
    with pytest.raises(TypeError):
        generate(cfg, params, tokens, mask, key=jax.random.key(0), max_new_tokens=8, greedy=True)


def test_train_config_sampling_is_sample_controls(tmp_path):
    """A recipe's [sampling] builds a SampleControls (no mirrored section): its keys load, EOS and pad
    default to the tokenizer's, and a bad value is one ConfigError line."""
    from rljax.train.config import load_config
    from rljax.train.run import sample_controls
    from rljax.models.setup import build_tokenizer

    cfg = load_config(overrides=["sampling.top_k=5", "sampling.max_new_tokens=7"])
    assert isinstance(cfg.sampling, SampleControls)
    assert (cfg.sampling.top_k, cfg.sampling.max_new_tokens, cfg.sampling.eos_ids, cfg.sampling.pad_id) == (
        5, 7, None, None)
    tok = build_tokenizer(cfg.model)
    controls = sample_controls(cfg, tok)
    assert controls == cfg.sampling.replace(eos_ids=tuple(tok.eos_ids), pad_id=tok.pad_id)
    with pytest.raises(ConfigError, match=r"^sampling\.top_p=0\.0 must be in \(0, 1\]$"):
        load_config(overrides=["sampling.top_p=0"])


# ----------------------------------------------------------------------------- CLI


def test_cli_sample_streams_text(tmp_path, capsys):
    """`rljax sample` loads a HF directory with its tokenizer, renders the chat template and prints
    the decoded greedy completion, with either scheduler; a missing checkpoint is a one-line error."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from rljax.cli import main

    make_checkpoint("qwen2", tmp_path)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 96)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}w5 {{ m['content'] }} w6 {% endfor %}w7"}))
    cfg, params = M.load_hf(tmp_path)
    prompt = [5, 10, 11, 6, 7]
    want = np.asarray(generate(cfg, params, np.asarray([prompt]), key=jax.random.key(0),
                               controls=SampleControls(max_new_tokens=5, greedy=True, eos_ids=(1,))).tokens)[0]
    want = " ".join(f"w{t}" for t in want if t > 1)  # <unk> and <eos> are special: not printed
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "w10 w11", "--chat", "--greedy",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.split() == want.split()
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "w10 w11", "--chat", "--greedy",
                 "--max-new-tokens", "5", "--scheduler", "continuous", "--slots", "1"]) == 0
    assert capsys.readouterr().out.split() == want.split()  # the continuous scheduler, one chunk
    assert main(["sample", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "config.json" in capsys.readouterr().err
