"""`rljax train`, `eval`, `export`, `sample` and `inspect` on a tiny run trained by the command line,
called in-process through `rljax.cli.main` (and `python -m rljax` once), each checked against an
independent path: transformers for the export and its tokenizer, the run's own evaluation and
`greedy_accuracy` for eval, the functional sampler for `rljax sample`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rljax.rewards.config import build_reward
from rljax.models.setup import build_tokenizer
from rljax.checkpoint import Checkpointer, load_params, open_run
from rljax.cli import main
from rljax.data.templates import render_prompt
from rljax.evaluation.runner import EvalSetup, greedy_accuracy
from rljax.models import forward, init_params, load_hf
from rljax.sampling import SampleControls, generate
from rljax.tokenizers import load as load_tokenizer
from rljax.train import setup
from rljax.train.config import load_config
from rljax.train.run import sample_controls

ROOT = Path(__file__).resolve().parents[2]

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
    """The run, trained by `rljax train` itself; its last held-out accuracy read from metrics.jsonl."""
    out = tmp_path_factory.mktemp("run")
    overrides = RUN + [f"output_dir='{out}'"]
    assert main(["train", *overrides]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = [r["eval/accuracy"] for r in records if "eval/accuracy" in r][-1]
    return load_config(None, overrides), types.SimpleNamespace(output_dir=out, final_accuracy=final)


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

    tokenizer = build_tokenizer(cfg.model)
    _, held_out, _ = setup.build_splits(cfg.data)
    model_cfg, params = load_params(result.output_dir / "checkpoints", 1)
    evaluator = EvalSetup.build(model_cfg, held_out[:cfg.eval.size], tokenizer, setup.prompt_format(cfg.data),
                                build_reward(cfg.reward), sample_controls(cfg, tokenizer),
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


# ----------------------------------------------------------------------------- issue 39: the round trip


@pytest.fixture(scope="module")
def best_not_latest(run, tmp_path_factory):
    """A run directory whose best checkpoint is not its latest: step 1 holds the trained params with
    the run's held-out accuracy, step 2 freshly initialised params (accuracy 0), both saved as
    `rljax train` saves them (the run's config, `checkpoint.best_metric` tracked)."""
    cfg, result = run
    model_cfg, trained = load_params(result.output_dir / "checkpoints", "latest")
    config = open_run(result.output_dir, "latest").config
    out = tmp_path_factory.mktemp("best_run")
    with Checkpointer(out / "checkpoints", keep_last=2, best_metric=cfg.checkpoint.best_metric) as ckpt:
        ckpt.save(1, params=trained, config=config, model_config=model_cfg,
                  metrics={"eval/accuracy": result.final_accuracy})
        ckpt.save(2, params=init_params(model_cfg, jax.random.key(7)), config=config, model_config=model_cfg,
                  metrics={"eval/accuracy": 0.0})
    return out, trained, result.final_accuracy


def test_eval_and_export_pick_the_runs_best_checkpoint_not_the_latest(best_not_latest, tmp_path, capsys):
    """With the default `--step best`, eval reports step 1 (the best by the run's eval/accuracy) with
    the accuracy the run recorded for it, printing the pick and its value; export writes step 1's
    weights; `rljax sample --checkpoint RUN` samples step 1.

    Catches: the reader opening the run's Checkpointer without its `best_metric` (orbax then calls
    the latest step "best": step 2, a fresh model scoring 0), and a pick that is not printed."""
    run_dir, trained, accuracy = best_not_latest
    code, out, err = _cli(capsys, "eval", run_dir, "--samples", "1", "--seeds", "1")
    assert code == 0, err
    report = json.loads(out)
    assert report["step"] == 1 and report["picked"] == "best"
    assert report["greedy_accuracy"] == report["checkpoint/eval/accuracy"] == accuracy > 0
    assert f"evaluating step 1 (best eval/accuracy = {accuracy:.4f}) of {run_dir}" in err

    code, out, _ = _cli(capsys, "export", run_dir, tmp_path / "hf")
    assert code == 0 and f"exported step 1 (best eval/accuracy = {accuracy:.4f})" in out
    _, exported = load_hf(tmp_path / "hf")
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(exported)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    code, _, err = _cli(capsys, "sample", "--checkpoint", run_dir, "--prompt", "1+2=", "--greedy",
                        "--max-new-tokens", "3", "--no-stream")
    assert code == 0 and f"sampling from step 1 (best eval/accuracy = {accuracy:.4f})" in err


def _held_out_prompt(cfg) -> str:
    _, held_out, _ = setup.build_splits(cfg.data)
    return render_prompt(held_out[0], setup.prompt_format(cfg.data))


def test_round_trip_export_then_sample_from_the_export_and_from_the_run(run, tmp_path, capsys):
    """train -> export -> sample: the exported directory carries the run's tokenizer, which
    rljax and transformers both read back to the run's ids for a held-out prompt, and `rljax sample`
    on the export and on the run directory both print the greedy completion that the functional
    sampler draws from the checkpoint's params with the run's tokenizer (and it is not empty).

    Catches: an export without tokenizer files (sample then fails to load one), a saved character
    tokenizer whose ids differ under transformers (a plain vocabulary: transformers 5 loads a qwen2
    directory with its byte-level Qwen2 class, which then drops the spaces of "7 + 4 ="), a run
    directory refused by `sample`, and sampling either path with other weights than the run's."""
    cfg, result = run
    code, out, _ = _cli(capsys, "export", result.output_dir, tmp_path / "hf")
    assert code == 0 and "with its tokenizer" in out
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}

    prompt = _held_out_prompt(cfg)
    run_tok = build_tokenizer(cfg.model)
    ids = run_tok.encode(prompt, add_bos=cfg.data.add_bos)
    assert load_tokenizer(tmp_path / "hf").encode(prompt, add_bos=cfg.data.add_bos) == ids
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok(prompt).input_ids == ids  # its post-processor adds bos as the run did
    assert hf_tok.decode(ids, skip_special_tokens=True) == run_tok.decode(ids) == prompt

    model_cfg, params = load_params(result.output_dir / "checkpoints", "best")
    controls = SampleControls(max_new_tokens=cfg.sampling.max_new_tokens, greedy=True).with_tokenizer(
        run_tok, extra_eos_ids=model_cfg.eos_ids)
    drawn = generate(model_cfg, params, np.asarray([ids], np.int32), key=jax.random.key(0), controls=controls)
    expected = run_tok.decode(np.asarray(drawn.tokens[0])[np.asarray(drawn.mask[0])])
    assert expected.strip()

    for source in (tmp_path / "hf", result.output_dir):
        code, out, err = _cli(capsys, "sample", "--checkpoint", source, "--prompt", prompt, "--greedy",
                              "--max-new-tokens", cfg.sampling.max_new_tokens, "--no-stream")
        assert code == 0, err
        assert out == expected + "\n", source


def test_a_run_directory_where_a_hugging_face_one_is_needed_names_rljax_export(run, capsys):
    """`rljax inspect RUN` (it needs a HF directory) says in one line that RUN is a run directory
    and gives the `rljax export` command. Catches: the bare "has no config.json" message."""
    _, result = run
    code, _, err = _cli(capsys, "inspect", result.output_dir)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "is an rljax run directory" in err and f"rljax export {result.output_dir} OUT_DIR" in err


def _warnings(stderr: str) -> list[str]:
    """absl and XLA warning lines: Python absl ("WARNING:absl:..."), absl C++ ("W1126 05:13:27.2 ...")."""
    return [line for line in stderr.splitlines()
            if "absl" in line or re.match(r"[WE]\d{4} \d\d:\d\d:\d\d", line) or "rematerialization" in line]


def test_eval_prints_no_absl_or_xla_warnings_unless_verbose(run, tmp_path):
    """`rljax eval` on the tiny run, as a user runs it (a fresh process, stderr captured whole):
    stderr is exactly the line naming the checkpoint picked, with no absl or XLA warning. With
    `--verbose` the same reader (`rljax export`, which opens the run the same way) prints orbax's
    read-only warnings, so the check does see them when they are there.

    Catches: dropping the absl filter (four "WARNING:absl:... read only" lines per call) and a
    filter that also hides the command's own output."""
    _, result = run
    proc = subprocess.run([sys.executable, "-m", "rljax", "eval", str(result.output_dir), "--step", "latest",
                           "--samples", "1", "--seeds", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["step"] == 1
    assert not _warnings(proc.stderr), proc.stderr
    assert proc.stderr.splitlines() == [f"evaluating step 1 (latest eval/accuracy = {result.final_accuracy:.4f}) "
                                        f"of {result.output_dir}"]
    proc = subprocess.run([sys.executable, "-m", "rljax", "export", str(result.output_dir), str(tmp_path / "hf"),
                           "--verbose"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sum("read only" in line for line in _warnings(proc.stderr)) >= 1, proc.stderr


def test_the_stderr_filter_drops_xla_notices_and_passes_everything_else():
    """In a fresh process, `quiet()` drops an XLA "Involuntary full rematerialization" line written
    to fd 2 by C++-style code (os.write, no Python logging), passes other lines and an unfinished
    progress-bar line through in order, and after `undo()` writes go straight to stderr.

    Catches: a filter on Python logging only (XLA writes to the descriptor), a line-buffered pump
    that holds progress text until a newline, and an undo that loses what was written before it."""
    code = ("import os; from rljax.quiet import quiet; undo = quiet(); "
            "os.write(2, b'keep 1\\n'); "
            "os.write(2, b'W1126 05:13:27.234308   10455 spmd_partitioner.cc:656] [SPMD] Involuntary full "
            "rematerialization. The compiler cannot go from sharding {devices=[8]<=[8]}\\n'); "
            "os.write(2, b'50%|#####     |\\r'); os.write(2, b'keep 2\\n'); undo(); os.write(2, b'after\\n')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b"keep 1\n50%|#####     |\rkeep 2\nafter\n"


def test_rljax_train_help_lists_the_packaged_recipes_and_the_default_jobs_time(capsys):
    """`rljax train --help` names every packaged recipe, and `rljax --help` gives the default job's
    time as the README does (5-8 minutes on a 2-core CPU). Catches: a recipe added without the help
    knowing, and an old figure ("~10 min", "about 5 min") left in one of the two."""
    from rljax.train.config import CONFIG_DIR

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for recipe in CONFIG_DIR.glob("*.toml"):
        assert recipe.stem in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "CPU, 5-8 min" in " ".join(capsys.readouterr().out.split())
    assert "5-8 minutes on a 2-core CPU after the install" in (ROOT / "README.md").read_text()


def test_sample_names_the_fix_for_a_directory_without_a_tokenizer(run, tmp_path, capsys):
    """A HF directory with weights but no tokenizer (an export made before exports carried one) is
    one line naming `--tokenizer` and `rljax export`, and `--tokenizer chars:...` then samples the
    same greedy completion as the full export. Catches: the bare "no tokenizer at ..." error, and a
    `--tokenizer` that is parsed but not used."""
    import shutil

    cfg, result = run
    assert _cli(capsys, "export", result.output_dir, tmp_path / "hf")[0] == 0
    (tmp_path / "bare").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tmp_path / "hf" / name, tmp_path / "bare" / name)
    args = ["--prompt", _held_out_prompt(cfg), "--greedy", "--max-new-tokens", "4", "--no-stream"]
    code, _, err = _cli(capsys, "sample", "--checkpoint", tmp_path / "bare", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--tokenizer" in err and "rljax export" in err
    code, expected, _ = _cli(capsys, "sample", "--checkpoint", tmp_path / "hf", *args)
    assert code == 0
    code, out, _ = _cli(capsys, "sample", "--checkpoint", tmp_path / "bare", *args, "--tokenizer", cfg.model.tokenizer)
    assert code == 0 and out == expected
