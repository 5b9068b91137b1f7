"""`rljax eval`, `rljax export` and `rljax inspect` on a tiny trained run, called in-process
through `rljax.cli.main` (and `python -m rljax` once), each checked against an independent path:
transformers for the export, the run's own evaluation and `greedy_accuracy` for eval."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rljax.checkpoint import load_params
from rljax.cli import main
from rljax.evaluation.runner import EvalSetup, greedy_accuracy
from rljax.models import forward, load_hf
from rljax.train import setup
from rljax.train.config import load_config
from rljax.train.loop import sample_controls, train

# One-digit sums, a short warm start (held-out greedy accuracy 7/32 with these seeds, so the
# accuracy comparisons below are not 0 == 0), then one GRPO iteration: about 20 s on 2 cores.
RUN = [
    "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
    "model.num_kv_heads=1", "model.head_dim=32",
    "data.task_kwargs={min_terms=2, max_terms=2, min_digits=1, max_digits=1}", "data.size=400",
    "data.eval_size=32", "eval.size=32", "eval.every=1",
    "warm_start.steps=60", "warm_start.batch_size=64", "warm_start.learning_rate=3e-3", "warm_start.target_accuracy=0",
    "rl.iterations=1", "rl.prompts_per_iteration=4", "sampling.num_samples=2", "checkpoint.every=1",
    "mesh.devices=1", "metrics.tensorboard=false", "metrics.progress_bar=false", "metrics.samples_every=0",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(None, RUN + [f"output_dir='{out}'"])
    return cfg, train(cfg, log=lambda *_: None)


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main(list(map(str, args)))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_reports_the_accuracy_of_the_named_checkpoint(run, capsys):
    """`rljax eval` prints, for the latest checkpoint, the greedy accuracy the loop measured at that
    step and that `greedy_accuracy` gives on the checkpoint's params, plus pass@1 and mean@2.

    Catches: evaluating other params than the named step's (the warm-started model scores
    7/32 where a fresh one scores 0), another held-out slice, and printing the step's name
    ("latest") instead of its number."""
    cfg, result = run
    code, out, _ = _cli(capsys, "eval", result.output_dir, "--step", "latest", "--samples", "2", "--seeds", "1")
    assert code == 0
    report = json.loads(out)
    assert report["step"] == 1 and report["problems"] == cfg.eval.size
    assert report["greedy_accuracy"] > 0
    assert report["greedy_accuracy"] == result.final_accuracy

    tokenizer = setup.build_tokenizer(cfg.model)
    _, held_out, _ = setup.build_splits(cfg.data)
    model_cfg, params = load_params(result.output_dir / "checkpoints", 1)
    evaluator = EvalSetup.build(model_cfg, held_out[:cfg.eval.size], tokenizer, setup.prompt_format(cfg.data),
                                setup.build_reward(cfg.reward), sample_controls(cfg, tokenizer),
                                max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos)
    assert report["greedy_accuracy"] == greedy_accuracy(evaluator, params)
    assert {"pass@1", "mean@2"} <= set(report) and "pass@2" not in report
    assert all(0 <= report[k] <= 1 for k in ("pass@1", "mean@2"))


def test_eval_and_export_refuse_bad_input_in_one_line(run, tmp_path, capsys):
    """A directory without checkpoints or a malformed --step is a one-line error with exit code 2."""
    _, result = run
    code, _, err = _cli(capsys, "eval", tmp_path, "--step", "latest")
    assert code == 2 and "has no checkpoints/ directory" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, "export", result.output_dir, tmp_path / "hf", "--step", "last")
    assert code == 2 and "--step 'last'" in err and not (tmp_path / "hf").exists()


def test_export_gives_transformers_the_checkpoint_logits(run, tmp_path, capsys):
    """`rljax export` writes a HF directory whose logits through transformers equal rljax's forward
    on the checkpoint's params (1e-4 max abs, as the model parity tests)."""
    _, result = run
    code, out, _ = _cli(capsys, "export", result.output_dir, tmp_path / "hf", "--step", "1")
    assert code == 0 and "exported step 1" in out
    model_cfg, params = load_params(result.output_dir / "checkpoints", 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (2, 11))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.float().numpy()
    ours, _ = forward(model_cfg, params, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)


def test_inspect_prints_the_config_and_parameter_count(run, tmp_path, capsys):
    """`rljax inspect` prints every config field of an exported checkpoint and its parameter count;
    `--export` writes it back out with the same tensors."""
    _, result = run
    assert _cli(capsys, "export", result.output_dir, tmp_path / "hf")[0] == 0
    model_cfg, params = load_params(result.output_dir / "checkpoints", "best")
    code, out, _ = _cli(capsys, "inspect", tmp_path / "hf", "--export", tmp_path / "again")
    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines() if not line.startswith("exported"))
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "model_type"):
        assert fields[name] == str(getattr(model_cfg, name)), name
    assert fields["parameters"] == f"{sum(x.size for x in jax.tree.leaves(params)):,}"
    _, reexported = load_hf(tmp_path / "again")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reexported)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_python_dash_m_rljax_lists_the_commands():
    """`python -m rljax --help` runs the same command line and lists every subcommand."""
    proc = subprocess.run([sys.executable, "-m", "rljax", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "eval", "export", "inspect", "sample"):
        assert command in proc.stdout
