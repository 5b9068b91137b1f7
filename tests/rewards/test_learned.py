"""Learned reward models (issue 40): Hugging Face's sequence- and token-classification formats
load into the backbone plus a `score` head, and their scores equal transformers' (Qwen2 and
Llama, left-padded rows included); rljax writes the format back so transformers loads it."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rljax.models.setup import policy_config
from rljax.rewards.config import build_reward_model
from rljax.errors import CheckpointError
from rljax.models import load_hf, save_hf
from rljax.models.heads import read_head, sequence_scores, token_scores

from hf_factory import FAMILIES
from test_distill import TINY_RUN as DISTILL_TINY_RUN

TOL = 1e-4
PAD = 0


def _make(family: str, kind: str, num_labels: int, path, seed: int = 0):
    """A random-init HF classification model of `family`, norms, biases and head randomised too."""
    torch.manual_seed(seed)
    cfg = FAMILIES[family]()
    cfg.num_labels, cfg.pad_token_id = num_labels, PAD
    cfg._attn_implementation = "eager"
    auto = {"sequence": transformers.AutoModelForSequenceClassification,
            "token": transformers.AutoModelForTokenClassification}[kind]
    model = auto.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.startswith("score"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


def _left_padded(rng, batch, length, vocab):
    """Left-padded rows of ragged length whose real tokens never equal the pad id (transformers
    finds a row's last real token by its pad id, rljax by the attention mask)."""
    tokens = rng.integers(1, vocab, (batch, length))
    mask = np.ones((batch, length), bool)
    for i in range(batch):
        n_pad = i * 3 % length
        tokens[i, :n_pad] = PAD
        mask[i, :n_pad] = False
    return tokens, mask


def _hf(model, tokens, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                    position_ids=torch.tensor(positions))
    return out.logits.float().numpy()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_sequence_classification_scores_equal_transformers(family, tmp_path):
    """A Bradley-Terry reward model's score per row, read at the last real token of left-padded
    rows, equals transformers' `*ForSequenceClassification` within 1e-4. Catches the head read at
    the last column (a left-padded row's real end is elsewhere only with right padding: the
    batch has both a full row and padded ones), a head not transposed from torch's [L, D], and
    the backbone's final norm skipped."""
    model = _make(family, "sequence", 1, tmp_path)
    assert read_head(tmp_path) == ("sequence", 1)
    cfg, params = load_hf(tmp_path, num_labels=1)
    assert "lm_head" not in params and params["score"].shape == (cfg.hidden_size, 1)
    tokens, mask = _left_padded(np.random.default_rng(0), 4, 11, cfg.vocab_size)
    # A right-padded row too: its last real token is not the last column.
    tokens[3, 8:], mask[3, 8:] = PAD, False
    ours = sequence_scores(cfg, params, jnp.asarray(tokens), jnp.asarray(mask))
    ref = _hf(model, tokens, mask)
    assert np.std(ref) > 10 * TOL  # rows score differently
    np.testing.assert_allclose(np.asarray(ours), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_token_classification_scores_equal_transformers(family, tmp_path):
    """A process reward model's head (`*ForTokenClassification`, 2 labels) at every real token
    equals transformers'. Catches a head applied before the final norm and misaligned positions."""
    model = _make(family, "token", 2, tmp_path, seed=1)
    assert read_head(tmp_path) == ("token", 2)
    cfg, params = load_hf(tmp_path, num_labels=2)
    tokens, mask = _left_padded(np.random.default_rng(1), 3, 10, cfg.vocab_size)
    ours = token_scores(cfg, params, jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(ours)[mask], _hf(model, tokens, mask)[mask], atol=TOL, rtol=0)


def test_save_hf_writes_a_classifier_transformers_loads(tmp_path):
    """rljax's export of a reward model (backbone + score, architectures and num_labels in its
    config) loads in transformers and scores as rljax does."""
    _make("qwen2", "sequence", 1, tmp_path / "src")
    cfg, params = load_hf(tmp_path / "src", num_labels=1)
    save_hf(cfg, params, tmp_path / "out", extra_config={"architectures": ["Qwen2ForSequenceClassification"],
                                                         "num_labels": 1, "pad_token_id": PAD})
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    tokens, mask = _left_padded(np.random.default_rng(2), 3, 9, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(sequence_scores(cfg, params, jnp.asarray(tokens), jnp.asarray(mask))),
                               _hf(model, tokens, mask), atol=TOL, rtol=0)


def test_a_causal_lm_is_no_reward_model(tmp_path):
    """A causal LM given as a reward model fails in one line naming what it holds."""
    from hf_factory import make_checkpoint

    make_checkpoint("qwen2", tmp_path)
    with pytest.raises(CheckpointError, match="Qwen2ForCausalLM, not a classification model"):
        read_head(tmp_path)
    with pytest.raises(CheckpointError, match="lacks 'score'"):
        load_hf(tmp_path, num_labels=1)


# ----------------------------------------------------------------------------- the learned reward


def test_normalisations_match_numpy():
    """`group`: (r - group mean) / (group std + eps), unbiased std, over valid rows only;
    `running`: Welford's moments over every valid row seen so far, this batch included; `none`:
    weight x r. Catches a biased std, padded rows counted into a group's moments, and running
    moments that forget earlier batches."""
    from rljax.models.auxiliary import FrozenModel
    from rljax.rewards.learned import LearnedReward

    rng = np.random.default_rng(0)
    raw1, raw2 = rng.normal(size=(2, 8)).astype(np.float32) * 3
    groups = np.repeat(np.arange(2), 4)
    valid = np.ones(8, bool)
    valid[3] = False
    model = FrozenModel(None, None)
    g = LearnedReward.create(model, weight=0.5, normalize="group")
    got = np.asarray(g.rewards(jnp.asarray(raw1), jnp.asarray(groups), jnp.asarray(valid)))
    for k in range(2):
        rows = (groups == k) & valid
        want = 0.5 * (raw1[groups == k] - raw1[rows].mean()) / (raw1[rows].std(ddof=1) + 1e-6)
        np.testing.assert_allclose(got[groups == k], want, rtol=1e-5, atol=1e-6)
    r = LearnedReward.create(model, weight=2.0, normalize="running")
    r = r.observe(jnp.asarray(raw1), jnp.asarray(valid))
    got = np.asarray(r.rewards(jnp.asarray(raw2), jnp.asarray(groups), jnp.asarray(np.ones(8, bool))))
    seen = np.concatenate([raw1[valid], raw2]).astype(np.float64)
    np.testing.assert_allclose(got, 2.0 * (raw2 - seen.mean()) / (seen.std(ddof=1) + 1e-6), rtol=1e-5, atol=1e-6)
    n = LearnedReward.create(model, weight=3.0, normalize="none")
    np.testing.assert_allclose(np.asarray(n.rewards(jnp.asarray(raw1), jnp.asarray(groups), jnp.asarray(valid))),
                               3.0 * raw1, rtol=1e-6)


def test_pairwise_loss_equals_numpy_on_a_fixed_batch():
    """`rljax train-rm`'s loss on a fixed batch of encoded pairs, through the model, equals NumPy's
    -mean log sigmoid(r_c - r_r - m) of the model's own scores, margins included; its accuracy is
    the share of pairs with r_c > r_r. Catches chosen and rejected rows swapped, the margin added
    with the wrong sign, and a mean over rows instead of pairs."""
    from rljax.models import preset
    from rljax.tokenizers import load as load_tokenizer
    from rljax.train.reward_model import encode_pairs, init_reward_params, pairwise_loss

    import jax

    tok = load_tokenizer("chars:0123456789+-= ")
    rows = [{"prompt": "12 + 5 =", "chosen": "17", "rejected": "18", "margin": 0.5},
            {"prompt": "3 - 9 =", "chosen": "-6", "rejected": "6", "margin": 2.0},
            {"prompt": "40 + 40 =", "chosen": "80", "rejected": "8", "margin": 0.0}]
    pairs = encode_pairs(rows, tok, max_tokens=32, add_bos=True, use_margin=True)
    cfg = preset("qwen2-test", vocab_size=tok.vocab_size)
    params = init_reward_params(cfg, None, jax.random.key(0))
    params["score"] = params["score"] * 40.0  # scores well apart
    r = np.asarray(sequence_scores(cfg, params, jnp.asarray(pairs.tokens), jnp.asarray(pairs.mask))[:, 0], np.float64)
    diff = r[:3] - r[3:] - np.array([0.5, 2.0, 0.0])
    want = float(np.mean(np.log1p(np.exp(-diff))))
    loss, acc = pairwise_loss(jnp.asarray(r[:3]), jnp.asarray(r[3:]), jnp.asarray(pairs.margins))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(acc) == np.mean(r[:3] > r[3:])
    assert np.ptp(diff) > 0.1


TINY_RUN = DISTILL_TINY_RUN + ["algorithm.kl_coef=0"]  # tests/objectives/test_distill.py's tiny run, no KL reference
RM_WIDTH = 48  # the reward model's width, unlike the policy's: its head is f32[48,1] in the program


def _reward_model_dir(tmp_path):
    """A random reward model for TINY_RUN's policy vocabulary, written as `rljax train-rm` writes one."""
    import dataclasses

    import jax

    from rljax.tokenizers import load as load_tokenizer
    from rljax.train.config import load_config
    from rljax.train.reward_model import init_reward_params

    tok = load_tokenizer("chars:0123456789+-= ")
    policy = policy_config(load_config(None, TINY_RUN).model, tok)
    cfg = dataclasses.replace(policy, hidden_size=RM_WIDTH, intermediate_size=96, num_heads=2, head_dim=24)
    params = init_reward_params(cfg, None, jax.random.key(5))
    params["score"] = params["score"] * 30.0
    path = tmp_path / "rm"
    save_hf(cfg, params, path, extra_config={"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1})
    tok.save(path)
    return path


def test_rl_with_a_learned_reward_scores_inside_the_update(tmp_path):
    """Two iterations of `rljax train` whose reward is the reward model alone (the verifier's
    weight 0, no normalisation): the metrics are finite, the rewards the loss sees are exactly
    the reward model's (its scores reach the loss), the verifier is still logged, and `rljax
    plan` counts the reward model's bytes exactly."""
    import jax

    from rljax.plan.memory import state_memory
    from rljax.train.config import load_config
    from rljax.train.loop import train

    cfg = load_config(None, TINY_RUN + [f"reward.model={{checkpoint = '{_reward_model_dir(tmp_path)}', "
                                        "normalize = 'none'}", "reward.correct_weight=0",
                                        f"output_dir='{tmp_path / 'run'}'"])
    lines = []
    result = train(cfg, log=lines.append)
    assert any(line.startswith("reward model qwen2") for line in lines), lines
    rows = [r for r in result.history if "reward_model/score_mean" in r]
    assert len(rows) == 2
    for r in rows:
        assert all(np.isfinite(v) for k, v in r.items() if isinstance(v, float)), r
        np.testing.assert_allclose(r["train/reward_mean"], r["reward_model/reward_mean"], rtol=1e-5, atol=1e-6)
        assert abs(r["reward_model/reward_mean"]) > 1e-3 and "rollout/reward_correct" in r
        assert 0.0 <= r["reward_model/pair_agreement"] <= 1.0
    assert float(result.state.reward_model.moments.count) == 2 * 8 * 4  # two batches of rows observed
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(result.state.reward_model.model.params))
    assert state_memory(cfg).reward_model_bytes == held > 0


def test_the_fused_iteration_runs_the_reward_model_without_a_host_hop(tmp_path):
    """The one-program iteration with a reward model holds its forward (its head, f32[48,1], is in
    the lowered program) and exactly as many host callbacks as without one (the verifier's).
    Catches a reward model scored through io_callback, or one left out of the program."""
    import jax

    from rljax.plan.memory import _Pieces
    from rljax.train.config import load_config
    from rljax.stages.iteration import make_iteration

    texts = []
    for extra in ([], [f"reward.model={{checkpoint = '{_reward_model_dir(tmp_path)}'}}"]):
        pieces = _Pieces.build(load_config(None, TINY_RUN + extra), None, None)
        iteration = make_iteration(pieces.controls, pieces.callback, num_groups=8)
        key = jax.eval_shape(lambda: jax.random.key(0))
        texts.append(iteration.lower(pieces.state, *pieces.prompts, key).as_text())
    plain, with_rm = texts
    assert plain.count("callback") == with_rm.count("callback") > 0
    assert f"{RM_WIDTH}x1xf32" in with_rm and f"{RM_WIDTH}x1xf32" not in plain


def test_reward_model_refusals_are_one_line(tmp_path):
    """A causal LM as the reward model, and a reward model beside dynamic sampling."""
    from hf_factory import make_checkpoint

    from rljax.tokenizers import load as load_tokenizer
    from rljax.train.config import load_config

    with pytest.raises(Exception, match="drop rl.dynamic_sampling or reward.model"):
        load_config(None, TINY_RUN + ["reward.model={checkpoint = 'x'}", "rl.dynamic_sampling=true"])
    make_checkpoint("qwen2", tmp_path / "lm")
    cfg = load_config(None, TINY_RUN + [f"reward.model={{checkpoint = '{tmp_path / 'lm'}'}}"])
    tok = load_tokenizer("chars:0123456789+-= ")
    with pytest.raises(CheckpointError, match="not a classification model"):
        build_reward_model(cfg.reward.model, policy_config(cfg.model, tok), tok)


def test_train_rm_learns_and_exports_a_reward_model(tmp_path):
    """`rljax train-rm` (the CLI), from scratch, on pairs of 1-digit sums and differences whose
    rejected answer is the right one with a stray digit appended: held-out pair accuracy goes from
    a coin's to >= 90% in 300 steps, and the export loads in transformers and in rljax with equal
    scores. This checks the trainer's loop, loss direction and export on a signal a tiny model
    learns in seconds; verifying the arithmetic itself (near-miss wrong answers, >= 90% held out
    on the default task) is bench/reward_model_learning.py's, from a supervised base model.
    Catches a loss that does not separate chosen from rejected (accuracy stays near 0.5) and an
    export that transformers cannot load or that scores differently."""
    import json
    import random

    from rljax.cli import main
    from rljax.models.heads import read_head

    rng = random.Random(0)
    problems = [(a, op, b) for a in range(10) for b in range(10) for op in "+-"]
    rng.shuffle(problems)

    def pair(a, op, b):
        answer = a + b if op == "+" else a - b
        return {"prompt": f"{a} {op} {b} =", "chosen": str(answer),
                "rejected": str(answer) + str(rng.randint(0, 9))}

    train = [pair(*p) for p in problems for _ in range(6)]
    held = [pair(*p) for p in problems for _ in range(1)]
    for name, rows in (("train", train), ("held", held)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    assert main(["train-rm", f"pairs={tmp_path / 'train.jsonl'}", f"eval_pairs={tmp_path / 'held.jsonl'}",
                 f"output_dir={out}", "steps=300", "batch_size=64", "learning_rate=2e-3", "eval_every=100",
                 "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
                 "model.num_kv_heads=1", "model.head_dim=32"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"]["eval/pair_accuracy"] < 0.7
    assert summary["after"]["eval/pair_accuracy"] >= 0.9, summary["history"]
    assert read_head(out) == ("sequence", 1)
    cfg, params = load_hf(out, num_labels=1)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    from rljax.tokenizers import load as load_tokenizer
    from rljax.train.reward_model import encode_pairs

    pairs = encode_pairs(held[:4], load_tokenizer(out), max_tokens=32, add_bos=True, use_margin=False)
    ours = np.asarray(sequence_scores(cfg, params, jnp.asarray(pairs.tokens), jnp.asarray(pairs.mask)))
    mask = pairs.mask
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():  # transformers finds the last real token by the pad id, which a row never holds
        ref = model(torch.tensor(pairs.tokens.astype(np.int64)), attention_mask=torch.tensor(mask.astype(np.int64)),
                    position_ids=torch.tensor(positions)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


# ----------------------------------------------------------------------------- process rewards


def test_prm_step_aggregation_and_token_rewards_match_numpy():
    """A PRM's outcome score per row from its step scores, against NumPy loops: min, last, and
    sum_k gamma^k p_k (k counted from the first step); a row without a step scores 0; token
    credit puts weight x p on each separator token only. Catches steps counted off the
    completion (prompt separators), the discount counted in tokens instead of steps, and a
    stepless row scored +inf by min."""
    from rljax.models.auxiliary import FrozenModel
    from rljax.rewards.learned import LearnedReward

    rng = np.random.default_rng(3)
    sep = 7
    tokens = rng.integers(0, 6, (4, 12))
    tokens[0, [5, 8, 11]] = sep
    tokens[1, [2, 9]] = sep  # column 2 is in the prompt: not a step
    tokens[3, [6]] = sep
    loss = np.zeros((4, 12), bool)
    loss[:, 4:] = True  # row 2 has no separator at all
    p = rng.uniform(size=(4, 12)).astype(np.float32)
    steps_np = (tokens == sep) & loss
    for agg, gamma in (("min", 1.0), ("last", 1.0), ("sum", 0.9)):
        rm = LearnedReward.create(FrozenModel(None, None), weight=2.0, kind="prm", step_token=sep,
                                  step_aggregation=agg, step_discount=gamma)
        steps = rm.steps(jnp.asarray(tokens), jnp.asarray(loss))
        np.testing.assert_array_equal(np.asarray(steps), steps_np)
        want = []
        for i in range(4):
            ps = p[i][steps_np[i]]
            if not len(ps):
                want.append(0.0)
            elif agg == "min":
                want.append(ps.min())
            elif agg == "last":
                want.append(ps[-1])
            else:
                want.append(sum(gamma ** k * x for k, x in enumerate(ps)))
        np.testing.assert_allclose(np.asarray(rm.aggregate_steps(jnp.asarray(p), steps)), want, rtol=1e-6, err_msg=agg)
        np.testing.assert_allclose(np.asarray(rm.token_rewards(jnp.asarray(p), steps)), 2.0 * np.where(steps_np, p, 0.0))


def test_prm_token_credit_reaches_the_dense_advantages():
    """prepare_batch with a PRM (token credit) and REINFORCE++: the advantages equal NumPy's
    whitened reward-to-go of weight x p(good) on the completion's separator tokens, with p from
    the PRM's own head. Catches step rewards that never reach the estimator, or land on the
    wrong column."""
    import jax

    from rljax.models import preset
    from rljax.models.auxiliary import FrozenModel
    from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
    from rljax.optim import OptimConfig
    from rljax.rewards.learned import LearnedReward
    from rljax.train.reward_model import init_reward_params
    from rljax.update import RolloutBatch, init_train_state, prepare_batch
    from rljax.models import init_params

    cfg = preset("qwen2-test")
    prm_params = init_reward_params(cfg, None, jax.random.key(2))
    prm_params["score"] = jnp.concatenate([prm_params["score"], -prm_params["score"]], axis=1) * 20.0  # 2 labels
    sep = 9
    rm = LearnedReward.create(FrozenModel(cfg, prm_params), weight=0.5, kind="prm", step_token=sep, credit="token")
    rng = np.random.default_rng(4)
    b, t = 8, 12
    toks = rng.integers(10, cfg.vocab_size, (b, t))
    toks[:, [7, 10]] = sep
    attn = np.ones((b, t), bool)
    loss = np.zeros((b, t), bool)
    loss[:, 5:] = True
    batch = RolloutBatch(tokens_bt=jnp.asarray(toks), attn_mask_bt=jnp.asarray(attn), loss_mask_bt=jnp.asarray(loss),
                         sampler_logp_bt=jnp.zeros((b, t)), rewards_b=jnp.zeros((b,)),
                         group_ids_b=prompt_major_group_ids(b, 4), completion_len=t - 5)
    algo = AlgorithmConfig(algorithm="reinforce_pp", kl_coef=0.0)
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), algo, OptimConfig(), reward_model=rm)
    prepared, metrics = prepare_batch(state, batch)
    p = np.asarray(jax.nn.softmax(token_scores(cfg, prm_params, jnp.asarray(toks), jnp.asarray(attn)), -1)[..., 1],
                   np.float64)
    r = 0.5 * np.where((toks == sep) & loss, p, 0.0)
    g = np.where(loss, np.cumsum(r[:, ::-1], axis=1)[:, ::-1], 0.0)
    vals = g[loss]
    want = np.where(loss, (g - vals.mean()) / (vals.std(ddof=1) + 1e-6), 0.0)
    assert vals.std() > 0.01
    np.testing.assert_allclose(np.asarray(prepared.advantages_bt), want, rtol=1e-4, atol=1e-5)
    assert float(metrics["reward_model/steps_mean"]) == 2.0


# ----------------------------------------------------------------------------- generative judges


def test_judge_rows_and_verdict_parsing_match_python():
    """The judge's input rows: template prefix, the prompt's real tokens, the middle, the
    completion's real tokens without EOS, the suffix, left-padded; and the verdict parser on stub
    decodes: the first listed verdict that the decode starts with scores, a decode that starts
    with none (or ends before a verdict's last token) scores the default and counts as unparsed.
    Catches padding left inside a row, EOS fed to the judge, and a partial verdict accepted."""
    from rljax.rewards.judge import judge_rows, parse_verdicts

    prompt = np.array([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompt_mask = prompt > 0
    completion = np.array([[11, 2, 0], [12, 13, 2]])  # 2 is EOS
    completion_mask = np.array([[True, True, False], [True, True, True]])
    rows, mask = judge_rows(jnp.asarray(prompt), jnp.asarray(prompt_mask), jnp.asarray(completion),
                            jnp.asarray(completion_mask), prefix=[1, 20], middle=[21], suffix=[22, 23], pad_id=0,
                            drop_ids=[2])
    want = [[1, 20, 5, 6, 21, 11, 22, 23], [1, 20, 7, 8, 9, 10, 21, 12, 13, 22, 23]]
    width = 2 + 4 + 1 + 3 + 2
    for i, w in enumerate(want):
        np.testing.assert_array_equal(np.asarray(rows)[i], [0] * (width - len(w)) + w)
        np.testing.assert_array_equal(np.asarray(mask)[i], [False] * (width - len(w)) + [True] * len(w))
    decoded = np.array([[30, 31, 5], [40, 0, 0], [30, 7, 7], [30, 31, 0], [9, 9, 9]])
    dmask = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], bool)
    scores, parsed = parse_verdicts(jnp.asarray(decoded), jnp.asarray(dmask),
                                    [((30, 31), 1.0), ((40,), 0.0), ((30,), 0.25)], default=-1.0)
    # row 0 "Yes"; row 1 "No"; row 2 only the 1-token verdict; row 3 stops after 30: the 1-token
    # verdict; row 4 none.
    np.testing.assert_array_equal(np.asarray(scores), [1.0, 0.0, 0.25, 0.25, -1.0])
    np.testing.assert_array_equal(np.asarray(parsed), [True, True, True, True, False])


def test_a_generative_judge_scores_inside_the_update(tmp_path):
    """prepare_batch with a judge (a random causal LM): its verdict scores, defaults and unparsed
    count equal a decode of the same rows by the sampler outside the update, parsed in Python,
    with one verdict set to what the judge says for row 0 (so both outcomes occur); the scores
    reach the rewards the loss sees (the verifier's weight is 0 here)."""
    import jax

    from rljax.models import init_params, preset
    from rljax.models.auxiliary import FrozenModel
    from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
    from rljax.optim import OptimConfig
    from rljax.rewards.judge import JudgeSpec, judge_rows
    from rljax.rewards.learned import LearnedReward
    from rljax.sampling import SampleControls, sample
    from rljax.update import RolloutBatch, init_train_state, prepare_batch

    cfg = preset("qwen2-test")
    judge_params = init_params(cfg, jax.random.key(9))
    rng = np.random.default_rng(5)
    b, p, c = 8, 5, 4
    toks = rng.integers(3, cfg.vocab_size, (b, p + c))
    attn = np.ones((b, p + c), bool)
    attn[:, :2] = rng.uniform(size=(b, 2)) < 0.5
    attn[:, :1] &= attn[:, 1:2]  # left padding only
    loss = np.zeros_like(attn)
    loss[:, p:] = True
    batch = RolloutBatch(tokens_bt=jnp.asarray(toks), attn_mask_bt=jnp.asarray(attn), loss_mask_bt=jnp.asarray(loss),
                         sampler_logp_bt=jnp.zeros((b, p + c)), rewards_b=jnp.zeros((b,)),
                         group_ids_b=prompt_major_group_ids(b, 4), completion_len=c)
    # No suffix: each row ends with its own completion's last token, so a random judge's first
    # verdict token varies by row (both a parsed and an unparsed verdict occur).
    base = dict(prefix=(1, 40), middle=(41,), suffix=(), default=-0.5, max_tokens=2, eos_ids=(2,), pad_id=0)
    rows, mask = judge_rows(jnp.asarray(toks[:, :p]), jnp.asarray(attn[:, :p]), jnp.asarray(toks[:, p:]),
                            jnp.asarray(attn[:, p:]), prefix=base["prefix"], middle=base["middle"],
                            suffix=base["suffix"], pad_id=0, drop_ids=(2,))
    out = sample(cfg, judge_params, rows, mask, jax.random.key(0),
                 SampleControls(max_new_tokens=2, num_samples=1, greedy=True, eos_ids=(2,), pad_id=0))
    decoded = np.asarray(out.tokens)
    yes = int(decoded[0, 0])
    spec = JudgeSpec(verdicts=(((yes,), 1.0), ((yes + 1,), 0.0)), **base)
    want = np.array([1.0 if d[0] == yes else 0.0 if d[0] == yes + 1 else -0.5 for d in decoded])
    assert (want == -0.5).any() and (want == 1.0).any()
    rm = LearnedReward.create(FrozenModel(cfg, judge_params), kind="judge", judge=spec, normalize="none")
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(kl_coef=0.0), OptimConfig(),
                             reward_model=rm)
    _, metrics = prepare_batch(state, batch)
    assert int(metrics["reward_model/judge_unparsed"]) == int(np.sum(want == -0.5))
    np.testing.assert_allclose(float(metrics["reward_model/score_mean"]), want.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["train/reward_mean"]), want.mean(), rtol=1e-6)


def test_running_moments_survive_a_resume(tmp_path):
    """A run with a running-normalised reward model, stopped after 2 iterations and resumed to 3:
    the moments count all three batches (they are checkpointed; the model is reloaded)."""
    from rljax.train.config import load_config
    from rljax.train.loop import train

    rm = _reward_model_dir(tmp_path)
    common = TINY_RUN + [f"reward.model={{checkpoint = '{rm}', normalize = 'running'}}", "checkpoint.every=1",
                         f"output_dir='{tmp_path / 'run'}'"]
    train(load_config(None, common + ["rl.iterations=2"]), log=lambda *_: None)
    result = train(load_config(None, common + ["rl.iterations=3"]), resume=True, log=lambda *_: None)
    assert float(result.state.reward_model.moments.count) == 3 * 8 * 4
    assert len([r for r in result.history if "reward_model/score_mean" in r]) == 3
