"""The warm start's stopping target relative to the constant-answer baseline (issue 24)."""

import math

import numpy as np
import pytest

from rljax.data import Example
from rljax.warmstart.sft import constant_answer_baseline, relative_target, stop_reason


def test_constant_answer_baseline_matches_reference_on_gcd_pairs():
    """On gcd of uniform random pairs the best constant answer is "1", solving the fraction of coprime
    pairs (about 6/pi^2); the function equals a NumPy count of the most common answer.
    Catches: counting distinct answers instead of the most common one, or ignoring surrounding
    whitespace so " 1" and "1" count as different answers."""
    rng = np.random.default_rng(0)
    pairs = rng.integers(1, 200, (400, 2))
    answers = [str(math.gcd(int(a), int(b))) for a, b in pairs]
    examples = [Example(id=str(i), question=f"gcd {a},{b} =", answer=ans + (" " if i % 3 else ""))
                for i, ((a, b), ans) in enumerate(zip(pairs, answers))]
    values, counts = np.unique(np.array(answers), return_counts=True)
    answer, baseline = constant_answer_baseline(examples)
    assert answer == values[counts.argmax()] == "1"
    assert baseline == counts.max() / len(answers)
    assert abs(baseline - 6 / math.pi ** 2) < 0.06  # the coprime fraction, within sampling noise of 400 pairs


@pytest.mark.parametrize("target,baseline,want", [(0.3, 0.0, 0.3), (0.3, 0.6, 0.72), (0.0, 0.6, 0.0)])
def test_relative_target_is_a_normalised_gain(target, baseline, want):
    """b + t (1 - b): unchanged without a repeated answer, 72% for 30% above a 60% constant
    answer, and no target stays no target; a constant-answer policy's accuracy never stops it.
    Catches: an absolute target that a constant-answer policy meets (gcd stopped at step 50 on
    answering "1"), or a zero target turned into a positive one by the baseline."""
    assert relative_target(target, baseline) == pytest.approx(want)
    assert stop_reason([baseline], target=relative_target(target, baseline), patience=0, min_delta=0.01) is None


def test_empty_validation_has_no_baseline():
    """An empty validation set has baseline 0, so the target stays absolute.
    Catches: a ZeroDivisionError or IndexError on an empty set."""
    assert constant_answer_baseline([]) == ("", 0.0)


def test_warm_start_validates_on_problems_it_never_trains_on(tmp_path, monkeypatch):
    """`rljax train`'s warm start (start.warm_start) trains on the pool minus its validation problems
    and validates on exactly those; auto_curriculum calibrates on the same per-source fronts. A
    pool too small to spare them trains on all of it. Catches: validating on the SFT set (a
    2,000-problem pool read 46% on its own problems against 19.5% held out, issue 24), an
    off-by-`validation_size` split, a split that drops problems from both sides, or one that
    keeps a later copy of a validation question in the SFT set."""
    from rljax.train import start
    from rljax.train.run import build_run
    from rljax.train.config import load_config
    from rljax.data.splits import warm_start_split

    pool = tuple(Example(id=str(i), question=f"{i % 700} + 1 =", answer=str(i % 700 + 1)) for i in range(1000))
    sft, validation = warm_start_split(pool, 200)
    assert validation == pool[:200]
    assert sft == tuple(e for e in pool[200:] if not 700 <= int(e.id) < 900)  # copies of 0..199 dropped too
    assert warm_start_split(pool[:300], 200) == (pool[:300], ())  # too small to spare 200
    assert warm_start_split(pool, 0) == (pool, ())

    seen = {}

    def capture(cfg, model_cfg, params, tokenizer, examples, fmt, key, *, validation=None, images=None, log=print):
        seen["sft"], seen["validation"] = examples, validation
        return params

    monkeypatch.setattr(start, "run_warm_start", capture)
    from rljax.train.config import recipe_path

    small = tmp_path / "learn_gcd_small.toml"  # the packaged recipe with 600-problem pools
    small.write_text(recipe_path("learn_gcd").read_text().replace("size = 20000", "size = 600"))
    cfg = load_config(small, [f"output_dir='{tmp_path}'", "warm_start.validation_size=100", "warm_start.steps=5"])
    run = build_run(cfg, resume=False, log=lambda *_: None)
    start.warm_start(run)
    validation_ids = {e.id for e in seen["validation"].examples}
    from rljax.data.example import question_key

    validation_questions = {question_key(e) for e in run.train_set[:100]}
    assert validation_ids == {e.id for e in run.train_set[:100]}
    assert [e.id for e in seen["sft"]] == [e.id for e in run.train_set[100:]
                                           if question_key(e) not in validation_questions]
    assert len(seen["sft"]) < len(run.train_set) - 100  # gcd's pools repeat a few validation questions
    assert not validation_questions & {question_key(e) for e in seen["sft"]}
    fronts = {e.id for src in run.sampler.sources for e in src.train[:100 // len(run.sampler.sources)]}
    assert fronts == validation_ids  # what `calibrate` measures is what the warm start never saw


@pytest.mark.parametrize("accs,nlls,want", [
    ([0.04, 0.06, 0.05, 0.04, 0.05, 0.06], [1.30, 1.20, 1.10, 1.00, 0.95, 0.90], None),  # accuracy noise, still learning
    ([0.04, 0.06, 0.05, 0.04, 0.05, 0.06], [1.00, 0.90, 0.899, 0.90, 0.91, 0.95], "plateau"),  # both stalled
    ([0.10, 0.12, 0.15, 0.20, 0.25, 0.30], [0.90, 0.90, 0.90, 0.90, 0.90, 0.90], None),  # accuracy still rising
    ([0.04, 0.06, 0.05, 0.04, 0.05, 0.06], None, "plateau"),  # no NLL: the accuracy rule alone
])
def test_plateau_needs_accuracy_and_validation_nll_to_stall(accs, nlls, want):
    """With patience 3 the plateau rule fires only when neither the best accuracy rose by 0.01 nor
    the best validation NLL fell by 1% (relative) in the last 3 checks. Catches: the old
    accuracy-only rule, which stopped decimal_chain_sum at step 550 at 6% accuracy while its NLL
    was still falling (row 1), an absolute instead of relative NLL delta (row 2's 0.001 drop
    would count), or an NLL rule that overrides rising accuracy (row 3)."""
    assert stop_reason(accs, target=0.9, patience=3, min_delta=0.01, nlls=nlls, nll_rel_delta=0.01) == want


def test_validation_nll_is_the_sft_loss_without_the_update():
    """make_nll_eval on a batch equals the loss make_sft_step reports for the same batch and params.
    Catches: a different mask (prompt tokens counted) or a sum instead of a mean."""
    import jax
    import optax

    from rljax.models import ModelConfig, init_params
    from rljax.warmstart.sft import make_nll_eval, make_sft_step, pack_prompt_completion

    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, max_positions=16)
    params = init_params(cfg, jax.random.key(0))
    batch = pack_prompt_completion([[1, 2, 3], [4, 5]], [[6, 7, 0], [8, 0]], 15, 3, 3)
    want = make_nll_eval(cfg)(params, *batch)
    _, _, got = make_sft_step(cfg, optax.sgd(0.0))(jax.tree.map(lambda x: x.copy(), params), optax.sgd(0.0).init(params),
                                                   *batch)
    assert float(got) == pytest.approx(float(want), rel=1e-6) and 1.0 < float(want) < 10.0
