"""Data: task sources, held-out splits, prompt rendering, the grain pipeline, dynamic sampling."""

import json

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rljax.data import (Example, FieldMap, PromptFormat, accuracy_band, drop_overlap, dynamic_sample,
                        from_jsonl, from_parquet, from_reasoning_gym, from_tfds, heldout_split, index_batches,
                        load_task, normalize_question, prompt_batches, refill, render_prompt)
from rljax.errors import ConfigError, DataError
from rljax.tokenizers import CharTokenizer

TOK = CharTokenizer("0123456789+-*= ?:abcdefghijklmnopqrstuvwxyzQA")


def _examples(n):
    return tuple(Example(id=f"t:{i}", question=f"{i}+1=", answer=str(i + 1), metadata={"n": i}) for i in range(n))


def _take(it, k):
    return [np.asarray(next(it)) for _ in range(k)]


# -- the grain pipeline ---------------------------------------------------------------------
def test_order_is_deterministic_per_seed():
    """The same seed gives the same batches; another seed gives a different order; each epoch is
    a reshuffled permutation cut into full batches (leftovers dropped, no repeats in an epoch)."""
    def run(seed):
        return np.stack(_take(iter(index_batches(22, 5, seed=seed, process_index=0, process_count=1)), 8))

    a, b, c = run(1), run(1), run(2)
    assert a.shape == (8, 5)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    epoch0, epoch1 = a[:4].ravel(), a[4:].ravel()  # 22 // 5 = 4 batches per epoch
    assert len(set(epoch0.tolist())) == 20 and len(set(epoch1.tolist())) == 20
    assert not np.array_equal(epoch0, epoch1)
    unshuffled = index_batches(7, 3, seed=0, shuffle=False, num_epochs=2, process_index=0, process_count=1)
    assert [b.tolist() for b in unshuffled] == [[0, 1, 2], [3, 4, 5]] * 2  # finite epochs end


def test_process_shards_partition_each_batch():
    """With P processes each keeps a disjoint slice of every global batch, and their union is the
    single-process batch (so the data a step sees does not depend on the process count)."""
    single = _take(iter(index_batches(37, 8, seed=3, process_index=0, process_count=1)), 10)
    shards = [_take(iter(index_batches(37, 8, seed=3, process_index=p, process_count=4)), 10) for p in range(4)]
    for step in range(10):
        parts = [shards[p][step] for p in range(4)]
        assert all(part.shape == (2,) for part in parts)
        np.testing.assert_array_equal(np.concatenate(parts), single[step])
        assert len(set(np.concatenate(parts).tolist())) == 8
    with pytest.raises(ConfigError, match="divisible"):
        index_batches(37, 8, seed=3, process_index=0, process_count=3)


def test_iterator_state_resumes_exactly():
    """A fresh pipeline given the JSON-saved iterator state yields exactly the batches the original
    iterator yields next, across an epoch boundary."""
    examples = _examples(10)
    def build():
        return prompt_batches(examples, tokenizer=TOK, batch_size=4, seed=5, max_prompt_len=8,
                              process_index=0, process_count=1).dataset

    it = iter(build())
    for _ in range(3):  # 10 // 4 = 2 batches per epoch: the resumed part crosses two epochs
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(4)]
    resumed = iter(build())
    resumed.set_state(state)
    got = [next(resumed) for _ in range(4)]
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e.tokens_bt, g.tokens_bt)
        np.testing.assert_array_equal(e.indices_b, g.indices_b)
        assert [x.id for x in e.examples] == [x.id for x in g.examples]


def test_prompt_batches_left_pad_to_buckets_and_drop_long():
    """Prompts are left-padded to the smallest bucket that fits; over-long prompts are dropped
    and counted; the tokens decode back to the rendered prompt."""
    examples = (*_examples(6), Example(id="long", question="1" * 40, answer="1"))
    data = prompt_batches(examples, tokenizer=TOK, batch_size=2, seed=0, max_prompt_len=16, buckets=(4, 16),
                          fmt=PromptFormat("Q:{question}"), shuffle=False, process_index=0, process_count=1)
    assert data.num_too_long == 1 and len(data.examples) == 6
    batch = next(iter(data.dataset))
    assert batch.tokens_bt.shape == (2, 16) and batch.tokens_bt.dtype == np.int32
    for row, ex in enumerate(batch.examples):
        n = int(batch.mask_bt[row].sum())
        assert not batch.mask_bt[row, :-n].any() and batch.mask_bt[row, -n:].all()
        assert TOK.decode(batch.tokens_bt[row, -n:].tolist()) == f"Q:{ex.question}"
    short = prompt_batches(_examples(4), tokenizer=TOK, batch_size=2, seed=0, max_prompt_len=16, buckets=(4, 16),
                           process_index=0, process_count=1)
    assert next(iter(short.dataset)).tokens_bt.shape == (2, 4)


def test_encode_prompts_drops_over_long_prompts_never_cuts():
    """A prompt of exactly max_prompt_len ids is kept whole; one id more and it is dropped and
    counted (with or without the tokenizer's `encode_batch`); a limit below 1 is a ConfigError."""
    from rljax.data import encode_prompts

    class OneAtATime:  # a tokenizer with `encode` only
        pad_id = TOK.pad_id
        encode = staticmethod(TOK.encode)

    examples = (Example(id="fits", question="12+3=", answer="15"), Example(id="over", question="12+34=", answer="46"))
    for tok in (TOK, OneAtATime()):
        enc = encode_prompts(examples, tok, PromptFormat(), max_prompt_len=6, add_bos=True)
        assert [e.id for e in enc.examples] == ["fits"] and enc.num_too_long == 1
        assert list(enc.ids[0]) == TOK.encode("12+3=", add_bos=True) and len(enc.ids[0]) == 6
    with pytest.raises(ConfigError, match="max_prompt_len"):
        encode_prompts(examples, TOK, PromptFormat(), max_prompt_len=0, add_bos=False)


def test_templates_and_chat():
    """Format strings fill {question} and metadata keys; chat formats go through the tokenizer's
    chat template with the system message first; {answer} and unknown fields are refused."""
    ex = Example(id="a", question="2+2=", answer="4", metadata={"level": "easy"})
    assert render_prompt(ex, PromptFormat("[{level}] {question}")) == "[easy] 2+2="

    class Chat:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + ("|assistant:" * add_generation_prompt)

    assert (render_prompt(ex, PromptFormat("Q {question}", chat=True, system="be brief"), Chat())
            == "system:be brief|user:Q 2+2=|assistant:")
    convo = Example(id="c", question="", answer="1", messages=({"role": "user", "content": "hi"},))
    assert render_prompt(convo, PromptFormat(chat=True), Chat()) == "user:hi|assistant:"
    with pytest.raises(ConfigError, match="answer"):
        PromptFormat("{question} {answer}")
    with pytest.raises(ConfigError, match="'nope'"):
        render_prompt(ex, PromptFormat("{nope}"))
    with pytest.raises(ConfigError, match="chat=True"):
        render_prompt(convo, PromptFormat())


# -- sources --------------------------------------------------------------------------------
def test_jsonl_skips_malformed_rows(tmp_path):
    """Bad JSON, non-object rows and rows missing the prompt or answer are skipped and counted;
    good rows map through the field mapping (answer_after, tests, metadata, id)."""
    lines = [
        json.dumps({"problem": "1+1?", "solution": "so 2 #### 2", "tests": ["assert f()==2"], "uid": "x1", "lvl": 1}),
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"problem": "no answer"}),
        "",
        json.dumps({"problem": [{"role": "user", "content": "3+3?"}], "solution": 6}),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    src = from_jsonl(path, FieldMap(prompt="problem", answer="solution", tests="tests", id="uid", answer_after="####"))
    assert src.num_skipped == 3 and len(src) == 2 and len(src.skip_reasons) == 3
    assert "rows:2" in src.skip_reasons[0] and "invalid JSON" in src.skip_reasons[0]
    first, chat = src.examples
    assert (first.id, first.question, first.answer, first.tests, dict(first.metadata)) == (
        "x1", "1+1?", "2", ["assert f()==2"], {"lvl": 1})
    assert chat.id == "rows:6" and chat.answer == "6" and chat.messages == ({"role": "user", "content": "3+3?"},)


def test_missing_file_is_one_line_error(tmp_path):
    """A missing JSONL/Parquet file raises DataError with one line naming the path; an unknown
    source kind or field-mapping key is a ConfigError listing the choices."""
    for loader in (from_jsonl, from_parquet):
        with pytest.raises(DataError) as err:
            loader(tmp_path / "absent.file")
        assert "\n" not in str(err.value) and "absent.file" in str(err.value)
    with pytest.raises(ConfigError, match="jsonl"):
        load_task("csv", path="x")
    with pytest.raises(ConfigError, match="prompt"):
        load_task("jsonl", path="x", fields={"promt": "q"})


def test_parquet_source(tmp_path):
    """Parquet rows map like JSONL rows; a row with a null answer is skipped and counted."""
    table = pa.table({"q": ["1+2=", "5+5=", "7+1="], "a": ["3", None, "8"], "src": ["s", "s", "t"]})
    pq.write_table(table, tmp_path / "t.parquet")
    src = load_task("parquet", path=str(tmp_path / "t.parquet"), fields={"prompt": "q", "answer": "a"})
    assert [e.question for e in src.examples] == ["1+2=", "7+1="] and src.num_skipped == 1
    assert src.examples[1].id == "t:2" and dict(src.examples[1].metadata) == {"src": "t"}


def test_tfds_custom_builder_offline(tmp_path):
    """A custom TFDS builder prepared as array_record in a tmp data_dir loads back by name and
    data_dir through `tfds.data_source`, without TensorFlow or network (read-only builder)."""
    tfds = pytest.importorskip("tensorflow_datasets")

    class RljaxTinyArith(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"question": tfds.features.Text(), "answer": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(6), "test": self._generate_examples(2)}

        def _generate_examples(self, n):
            for i in range(n):
                yield i, {"question": f"{i}+{n}=", "answer": str(i + n)}

    RljaxTinyArith(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    src = from_tfds("rljax_tiny_arith", data_dir=tmp_path, split="train")
    assert len(src) == 6 and src.num_skipped == 0
    assert sorted((e.question, e.answer) for e in src.examples) == [(f"{i}+6=", str(i + 6)) for i in range(6)]
    with pytest.raises(DataError) as err:
        from_tfds("rljax_not_there", data_dir=tmp_path)
    assert "\n" not in str(err.value)


def test_reasoning_gym_source_and_scorer():
    """reasoning-gym examples are reproducible per seed, carry stable ids and metadata, and the
    source's scorer is the generator's own score_answer."""
    kw = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2)
    a = from_reasoning_gym("chain_sum", size=8, seed=4, **kw)
    b = load_task("reasoning_gym", name="chain_sum", size=8, seed=4, **kw)
    assert [e.question for e in a.examples] == [e.question for e in b.examples]
    ex = a.examples[3]
    assert ex.id == "chain_sum/4/3" and ex.metadata["num_terms"] == 2
    assert a.scorer(ex.answer, ex) == 1.0 and a.scorer("nonsense", ex) == 0.0
    with pytest.raises(DataError, match="not registered"):
        from_reasoning_gym("no_such_task", size=2, seed=0)


# -- held-out split -------------------------------------------------------------------------
def test_heldout_split_is_disjoint_on_normalised_questions():
    """No eval question (after case/space/Unicode normalisation) appears in train, even when the
    pool repeats questions under different ids; drop_overlap removes them from a separate train set."""
    base = [Example(id=f"p{i}", question=f"What is {i % 30} + 1 ?", answer="x") for i in range(90)]
    respaced = [Example(id=f"r{i}", question=f"  what IS {i}  +\t1 ? ", answer="x") for i in range(30)]
    pool = base + respaced
    train, held = heldout_split(pool, eval_size=10, seed=0)
    keys = {normalize_question(e.question) for e in held}
    assert len(keys) == 10
    assert not keys & {normalize_question(e.question) for e in train}
    assert len(train) == len(pool) - 10 * 4  # each held question had 3 copies + 1 respaced copy
    kept, dropped = drop_overlap(respaced, held)
    assert dropped == 10 and not keys & {normalize_question(e.question) for e in kept}
    with pytest.raises(DataError, match="distinct"):
        heldout_split(pool, eval_size=31, seed=0)


# -- dynamic sampling -----------------------------------------------------------------------
def _reference_selection(rewards_pn, num_groups, atol=0.0):
    """DAPO's rule in NumPy: keep a group when its reward spread exceeds `atol`; the batch is the
    kept groups then the dropped ones, each in pool order, cut to `num_groups`."""
    keep_p = np.ptp(rewards_pn, axis=1) > atol
    order = np.concatenate([np.flatnonzero(keep_p), np.flatnonzero(~keep_p)])[:num_groups]
    return order.tolist(), keep_p[order].tolist(), int(keep_p.sum())


def test_dynamic_sampling_matches_reference_with_static_shapes():
    """Under jit, groups whose rewards are not all equal come first (in pool order), the batch is
    refilled to exactly G groups with filler marked invalid, and counts match a NumPy reference;
    one compile serves every pool content.

    Catches: an order that leaves pool order inside the kept or dropped block (e.g.
    `argsort(keep)[::-1]`), filler marked valid, `>=` instead of `>` against `atol` (the graded
    groups below sit exactly on it), wrong counts, and a selection whose shapes depend on the
    data (a second compile)."""
    select = jax.jit(dynamic_sample, static_argnums=(1, 2))
    rng = np.random.default_rng(0)
    for trial in range(6):
        rewards_pn = rng.integers(0, 2, size=(12, 4)).astype(np.float32)
        rewards_pn[: trial * 2] = 1.0  # more and more all-correct groups
        for atol, num_groups in ((0.0, 5), (0.0, 12)):
            sel = select(rewards_pn, num_groups, atol)
            chosen, valid, kept = _reference_selection(rewards_pn, num_groups, atol)
            assert sel.indices_g.shape == (num_groups,) and sel.valid_g.shape == (num_groups,)
            assert sel.indices_g.tolist() == chosen and sel.valid_g.tolist() == valid
            assert int(sel.num_kept) == kept and int(sel.num_dropped) == 12 - kept
            assert int(sel.num_padded) == max(num_groups - kept, 0)
    assert select._cache_size() == 2  # one compile per (G, atol), none per pool content

    # Graded rewards (multiples of 1/64, so every spread is exact in f32): spread exactly atol
    # (dropped), atol + 1/64 (kept) and 0 (dropped).
    base_p1 = rng.integers(-8, 8, size=(10, 1)) / 8
    spread_p3 = np.zeros((10, 3))
    spread_p3[::2] = [0.0, 0.25, 0.125]
    spread_p3[1::4] = [0.0, 0.0, 0.25 + 1 / 64]
    rewards_pn = (base_p1 + spread_p3).astype(np.float32)
    sel = dynamic_sample(rewards_pn, 6, 0.25)
    chosen, valid, kept = _reference_selection(rewards_pn, 6, 0.25)
    assert kept == 3 and valid == [True] * 3 + [False] * 3
    assert sel.indices_g.tolist() == chosen and sel.valid_g.tolist() == valid
    assert int(sel.num_kept) == kept and int(sel.num_padded) == max(6 - kept, 0)


def test_accuracy_band_and_refill_errors():
    """accuracy_band keeps groups with low < accuracy < high; asking for more groups than the
    pool holds is a ConfigError."""
    rewards_pn = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], np.float32)
    assert accuracy_band(rewards_pn).tolist() == [False, True, True, False]
    assert accuracy_band(rewards_pn, low=0.3, high=1.0).tolist() == [False, False, True, False]
    with pytest.raises(ConfigError, match="pool"):
        refill(np.ones(3, bool), 4)


def test_compiled_stages_import_without_grain():
    """The iteration, the memory plan and the remat choice import with grain absent (as on a GPU
    machine without it): grain is imported where a dataset is built. Catches: a module-level
    `import grain` on the path from `rljax.stages` or `rljax.plan`."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['grain'] = None\n"
            "import rljax.stages.iteration, rljax.plan.memory, rljax.plan.remat, rljax.train.config\n"
            "assert 'grain' not in [m for m, v in sys.modules.items() if v is not None]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
