"""Evaluation: statistics against their textbook definitions, the runner against a stub reward
whose correctness the test sets, and the one over-long-prompt rule."""

from math import comb

import numpy as np
import pytest
from scipy import stats

from rljax.evaluation.metrics import mean_pass_at_k, mean_with_ci, pass_at_k
from rljax.evaluation.runner import greedy_accuracy, sampled_eval


@pytest.mark.parametrize("n,c,k", [(10, 0, 1), (10, 3, 1), (10, 3, 4), (20, 19, 5), (5, 5, 5), (7, 2, 6)])
def test_pass_at_k_equals_combinatorial_formula(n, c, k):
    """pass@k = 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), exactly."""
    expected = 1.0 - comb(n - c, k) / comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_monotone_in_k():
    """pass@1 is c/n; pass@k never decreases with k."""
    table = np.random.default_rng(0).random((50, 8)) < 0.3
    assert mean_pass_at_k(table, 1) == pytest.approx(table.mean())
    values = [mean_pass_at_k(table, k) for k in range(1, 9)]
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="exceeds"):
        pass_at_k(3, 1, 4)


def test_mean_with_ci_matches_student_t_interval():
    """The interval is scipy's t-interval around the mean over seeds."""
    x = np.array([0.41, 0.47, 0.52, 0.44])
    mean, lo, hi = mean_with_ci(x)
    ref_lo, ref_hi = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
    assert mean == pytest.approx(x.mean())
    assert (lo, hi) == pytest.approx((ref_lo, ref_hi))
    assert mean_with_ci(np.array([0.5])) == (0.5, 0.5, 0.5)


# ----------------------------------------------------------------------------- one prompt rule


def test_over_long_prompt_dropped_alike_by_pipeline_evaluator_and_warm_start():
    """`encode_prompts`' rule holds in all three places prompts are encoded: the prompt over
    max_prompt_len is dropped and counted, never cut (the evaluator used to keep its last tokens),
    every kept prompt is its full encoding, and the warm start pads to at most max_prompt_len."""
    from rljax.data import Example, PromptFormat, encode_prompts, prompt_batches
    from rljax.evaluation.runner import EvalSetup
    from rljax.sampling import SampleControls
    from rljax.tokenizers import CharTokenizer
    from rljax.warmstart.sft import sft_pairs

    tok = CharTokenizer("0123456789+= ")
    fmt = PromptFormat("{question}")
    examples = tuple(Example(id=f"p{i}", question=q, answer="1") for i, q in
                     enumerate(["1+2=", "12+30=", "123456+1=", "4+4=", "55+5="]))  # p2: 10 ids with BOS
    limit = 8
    full = {e.id: tok.encode(e.question, add_bos=True) for e in examples}
    assert len(full["p2"]) > limit and all(len(v) <= limit for k, v in full.items() if k != "p2")
    kept = tuple(e for e in examples if e.id != "p2")

    encoded = encode_prompts(examples, tok, fmt, max_prompt_len=limit, add_bos=True)
    assert encoded.examples == kept and encoded.num_too_long == 1
    assert [list(i) for i in encoded.ids] == [full[e.id] for e in kept]

    data = prompt_batches(examples, tokenizer=tok, batch_size=2, seed=0, max_prompt_len=limit, fmt=fmt,
                          add_bos=True, process_index=0, process_count=1)
    assert data.examples == kept and data.num_too_long == 1

    setup = EvalSetup.build(None, examples, tok, fmt, reward_fn=None, controls=SampleControls(max_new_tokens=2),
                            max_prompt_len=limit, add_bos=True)
    assert setup.examples == kept and setup.num_too_long == 1
    assert [m["id"] for m in setup.metadata] == [e.id for e in kept]
    for row, e in enumerate(kept):
        assert setup.tokens_bt[row][setup.mask_bt[row]].tolist() == full[e.id]

    pairs = sft_pairs(examples, tok, fmt, max_prompt_len=limit, add_bos=True, max_completion_len=4)
    assert pairs.examples == kept and pairs.num_too_long == 1
    assert [list(p) for p in pairs.prompt_ids] == [full[e.id] for e in kept]
    assert pairs.prompt_len == max(len(full[e.id]) for e in kept) <= limit


# ----------------------------------------------------------------------------- sampled_eval


class _TableReward:
    """A stub reward whose correctness the test sets: on its s-th call, sample j of problem `p{i}`
    (its j-th row in the call) is correct iff table[s % len(table), i, j]. Records every call."""

    def __init__(self, table_spn):
        self.table = np.asarray(table_spn, bool)
        self.calls = []

    def batch(self, metadata, texts, num_tokens=None):
        from types import SimpleNamespace

        s = len(self.calls) % len(self.table)
        ids = [m["id"] for m in metadata]
        correct = np.asarray([self.table[s, int(pid[1:]), ids[:r].count(pid)] for r, pid in enumerate(ids)], float)
        self.calls.append((ids, list(texts)))
        return SimpleNamespace(parts={"correct": correct}, total_b=correct), [{}] * len(ids)


def _pass_at_k_reference(table_pn, k):
    """Chen et al. (2021), unbiased: mean over problems of 1 - C(n - c, k) / C(n, k)."""
    n = table_pn.shape[1]
    return np.mean([1.0 - comb(n - int(c), k) / comb(n, k) for c in table_pn.sum(axis=1)])


@pytest.fixture(scope="module")
def eval_model():
    import jax

    from rljax.models import ModelConfig, init_params
    from rljax.tokenizers import CharTokenizer

    tok = CharTokenizer("0123456789+= ")
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, qkv_bias=True)
    return tok, cfg, init_params(cfg, jax.random.key(0), std=0.02)  # near-uniform next-token distributions


def _eval_setup(eval_model, reward, *, batch_size, greedy=False):
    from rljax.data import Example, PromptFormat
    from rljax.evaluation.runner import EvalSetup
    from rljax.sampling import SampleControls

    tok, cfg, _ = eval_model
    examples = tuple(Example(id=f"p{i}", question=f"{i}+{i}=", answer=str(2 * i)) for i in range(5))
    controls = SampleControls(max_new_tokens=3, num_samples=1, temperature=0.5, greedy=greedy)
    return EvalSetup.build(cfg, examples, tok, PromptFormat(), reward, controls, max_prompt_len=16,
                           batch_size=batch_size)


def test_sampled_eval_matches_numpy_pass_at_k_and_t_interval(eval_model):
    """With correctness set per (seed, problem, sample) by a stub reward, sampled_eval's pass@k is
    the unbiased estimator averaged over problems then seeds, and mean@n its Student-t 95% interval
    over the seeds' accuracies, both computed here from the table. Each seed scores n samples per
    problem, drawn at the requested temperature even when the setup's controls are greedy."""
    rng = np.random.default_rng(0)
    seeds, problems, n = 3, 5, 4
    table = rng.random((seeds, problems, n)) < np.asarray([0.0, 0.2, 0.5, 0.8, 1.0])[None, :, None]
    table[:, 0], table[:, 4] = False, True  # c = 0 and c = n: pass@k exactly 0 and 1
    reward = _TableReward(table)
    setup = _eval_setup(eval_model, reward, batch_size=200, greedy=True)
    out = sampled_eval(setup, eval_model[2], num_samples=n, ks=(1, 2, 4), seeds=seeds, temperature=1.0)

    assert len(reward.calls) == seeds  # one batch per seed: call s is seed s
    for ids, texts in reward.calls:
        assert ids == [f"p{i}" for i in range(problems) for _ in range(n)]
        assert any(len(set(texts[i * n:(i + 1) * n])) > 1 for i in range(problems))  # sampled, not greedy
    for k in (1, 2, 4):
        want = np.mean([_pass_at_k_reference(table[s], k) for s in range(seeds)])
        assert out[f"pass@{k}"] == pytest.approx(want, abs=1e-12)
    acc = table.reshape(seeds, -1).mean(axis=1)
    lo, hi = stats.t.interval(0.95, seeds - 1, loc=acc.mean(), scale=stats.sem(acc))
    assert (out[f"mean@{n}"], out[f"mean@{n}/ci_low"], out[f"mean@{n}/ci_high"]) == pytest.approx(
        (acc.mean(), lo, hi), abs=1e-12)


def test_sampled_eval_ignores_filler_rows_and_greedy_is_one_sample(eval_model):
    """With 5 problems in batches of 2, the last batch is topped up with problem 0 again; those
    filler rows are not counted (problem 0, always right here, would otherwise weigh double).
    Greedy accuracy uses one greedy completion per problem."""
    table = np.zeros((1, 5, 3), bool)
    table[0, 0] = True
    table[0, 1, :2] = True
    reward = _TableReward(table)
    setup = _eval_setup(eval_model, reward, batch_size=2)
    out = sampled_eval(setup, eval_model[2], num_samples=3, ks=(1, 2), seeds=2, temperature=1.0)
    assert [ids[::3] for ids, _ in reward.calls[:3]] == [["p0", "p1"], ["p2", "p3"], ["p4", "p0"]]
    for k in (1, 2):
        assert out[f"pass@{k}"] == pytest.approx(_pass_at_k_reference(table[0], k), abs=1e-12)
    assert out["mean@3"] == pytest.approx(table.mean()) and out["mean@3/ci_low"] == pytest.approx(table.mean())

    reward.calls.clear()
    assert greedy_accuracy(setup, eval_model[2]) == pytest.approx(table[0, :, 0].mean())
    assert [ids for ids, _ in reward.calls] == [["p0", "p1"], ["p2", "p3"], ["p4", "p0"]]


class _AuditedTableReward(_TableReward):
    """`_TableReward` plus an audit part that refuses the problems in `refused`."""

    def __init__(self, table_spn, refused):
        super().__init__(table_spn)
        self.refused = set(refused)

    def batch(self, metadata, texts, num_tokens=None):
        out, infos = super().batch(metadata, texts, num_tokens)
        audit = np.asarray([0.0 if m["id"] in self.refused else c for m, c in zip(metadata, out.parts["correct"])])
        out.parts["audit"] = audit
        return out, infos


def test_greedy_judged_reports_the_audit_beside_correctness(eval_model):
    """With an audit part, greedy evaluation returns the stricter verdict per problem too, filler
    rows excluded like correctness: strict accuracy is NumPy's count over the table minus the
    refused problems. Fails if the audit table were read from `correct`, or filler rows counted."""
    from rljax.evaluation.runner import greedy_judged

    table = np.zeros((1, 5, 1), bool)
    table[0, [0, 1, 3], 0] = True
    setup = _eval_setup(eval_model, _AuditedTableReward(table, refused={"p1", "p2"}), batch_size=2)
    judged = greedy_judged(setup, eval_model[2])
    np.testing.assert_array_equal(judged["correct"], table[0, :, 0])
    np.testing.assert_array_equal(judged["audit"], [True, False, False, True, False])
    assert judged["audit"].mean() == pytest.approx(0.4) and judged["correct"].mean() == pytest.approx(0.6)
