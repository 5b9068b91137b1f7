"""`rljax train` on a vision-language recipe runs the text run's loop, sync driver and iteration
(`rljax.train.loop.train`; images are prompt data, `rljax.data.prompt_images`): configs/
vl_default.toml shrunk to a tiny random Qwen2.5-VL-shaped model runs end to end (warm start with
images, the image sampler, the verifier, the update with the tower trained, greedy held-out eval
with images), a checkpoint resumes exactly, and the settings it does not take are one line each."""

from __future__ import annotations

import json
import math
import shutil

import jax
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.train.config import load_config
from rljax.train.loop import train

from test_curriculum_run import check_curriculum_history

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=16", "model.vision.depth=1", "model.vision.hidden_size=16",
        "model.vision.intermediate_size=32", "model.vision.fullatt_block_indexes=[]",
        "data.task_kwargs={image_size=56, short=true}", "data.size=8", "data.eval_size=2", "eval.size=2",
        "eval.every=1", "warm_start.steps=1", "warm_start.batch_size=2", "rl.iterations=3",
        "rl.prompts_per_iteration=2", "sampling.num_samples=2", "sampling.max_new_tokens=2",
        "optim.schedule=constant", "optim.warmup_steps=0", "checkpoint.every=1", "checkpoint.keep_last=10",
        "mesh.devices=1"]


# VL-Cogito's curriculum (rljax.objectives.difficulty) on the image run: easy stage at iteration 1,
# hard (with the dynamic length reward) from 2; its options are generic and shared with text runs.
CURRICULUM = ["shaping.difficulty_stages=['easy', 'hard']", "shaping.difficulty_boundaries=[1]",
              "shaping.length_reward_coef=0.5"]
RUN = TINY + CURRICULUM


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory):
    """Three iterations of the shrunk vl_default with the curriculum on, a checkpoint after each."""
    out = tmp_path_factory.mktemp("vl") / "run"
    return load_config("vl_default", [f"output_dir={out}", *RUN]), train(load_config("vl_default",
                                                                                     [f"output_dir={out}", *RUN]))


def test_vl_default_runs_through_the_one_loop(vl_run):
    """Every logged metric finite, the held-out accuracy measured at the start and after each
    iteration, the tower in the state, a checkpoint per iteration. Catches a driver that drops
    the images between the pipeline and the iteration (the placeholder count check raises), a NaN
    from the spliced update, a broken eval with images."""
    _, result = vl_run
    assert [h["step"] for h in result.history] == [0, 1, 2, 3]
    for row in result.history[1:]:
        assert row["rollout/tokens"] > 0
        assert row["update/logp_diff_max"] < 1e-4, row["update/logp_diff_max"]  # the trainer sees the sampler's images
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    assert 0.0 <= result.start_accuracy <= 1.0 and 0.0 <= result.final_accuracy <= 1.0
    assert "visual" in result.state.params
    assert sorted(int(p.name) for p in (result.output_dir / "checkpoints").glob("[0-9]*")) == [1, 2, 3]


def test_the_curriculum_reaches_a_vl_run(vl_run):
    """The curriculum's options reach the image run's update: stage 0 (easy, no length reward) at
    iteration 1, stage 1 (hard, with it) after (`check_curriculum_history`)."""
    check_curriculum_history(vl_run[1].history)


def test_a_killed_vl_run_resumes_exactly(vl_run, tmp_path):
    """The run's directory as a kill after iteration 1 leaves it (checkpoints 2 and 3 gone),
    resumed: iterations 2 and 3 give the uninterrupted run's metrics and bitwise its params.
    Catches a resume that loses the tower's params or optimiser state, replays other prompts (the
    pipeline state) or other keys, or restores without the images."""
    cfg, full = vl_run
    cut = tmp_path / "cut"
    shutil.copytree(full.output_dir, cut)
    for step in (2, 3):
        shutil.rmtree(cut / "checkpoints" / str(step))
    resumed = train(load_config("vl_default", [f"output_dir={cut}", *RUN]), resume=True)
    p_full, p_cut = jax.device_get((full.state.params, resumed.state.params))
    assert "visual" in p_cut
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p_full), jax.tree.leaves(p_cut)))
    drop = lambda row: {k: v for k, v in row.items() if not k.startswith("time/")}  # noqa: E731
    assert [drop(r) for r in resumed.history[2:]] == [drop(r) for r in full.history[2:]]
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


def test_rljax_eval_reports_pass_at_k_of_a_vl_checkpoint(vl_run, capsys):
    """`rljax eval` on the VL run's last checkpoint, as on a text run's: the greedy accuracy the
    loop measured there (same params, held-out pictures and verifier), and pass@k / mean@k from
    sampled completions with the images. Catches an eval that cannot restore the tower (the
    template lacks `visual`), drops the images (the prompts then hold no placeholders: another
    greedy accuracy, or an error), or reports no pass@k."""
    from rljax.cli import main

    _, result = vl_run
    capsys.readouterr()
    assert main(["eval", str(result.output_dir), "--step", "3", "--samples", "4", "--seeds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 3 and out["problems"] == 2
    assert out["greedy_accuracy"] == result.history[-1]["eval/accuracy"]
    assert 0.0 <= out["pass@1"] <= out["pass@4"] <= 1.0 and math.isfinite(out["mean@4"])


def test_rljax_export_of_a_vl_run_reloads_in_transformers(vl_run, tmp_path, capsys):
    """`rljax export` of the VL run's checkpoint writes a Qwen2.5-VL directory that transformers'
    Qwen2_5_VLForConditionalGeneration loads into the trained policy: its logits on an image
    prompt (left-padded, two rows) equal our forward with the run's own config and params within
    1e-4 (f32). Catches an export that drops or misnames the tower or merger (a load error or
    random weights), writes the M-RoPE sections or image token ids wrong, or exports the warm
    start's params instead of the checkpoint's."""
    import torch
    import transformers

    from rljax.cli import main
    from rljax.models.vl_io import load_vl
    from rljax.models.vlm import prepare_inputs, vl_forward
    from rljax.models.setup import build_tokenizer
    from rljax.train.vision_setup import build_vision

    cfg, result = vl_run
    assert main(["export", str(result.output_dir), str(tmp_path / "hf"), "--step", "3"]) == 0
    vl = build_vision(cfg, build_tokenizer(cfg.model), jax.random.key(0), (None, None)).cfg
    assert load_vl(tmp_path / "hf")[0] == vl
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    grid = np.array([[1, 4, 4], [1, 4, 4]])  # a 56 px picture: 4 x 4 patches, 2 x 2 merged tokens
    image = [vl.vision_start_token_id] + [vl.image_token_id] * 4 + [vl.vision_end_token_id]
    rows = [[3, 5] + image + [7, 9, 11], image + [4, 6, 8, 10, 12, 14, 2]]
    width = max(map(len, rows))
    tokens = np.array([[0] * (width - len(r)) + r for r in rows], np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int64)
    pixels = np.random.default_rng(0).standard_normal((32, 3 * 2 * 14 * 14)).astype(np.float32)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                 pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid),
                 mm_token_type_ids=torch.tensor((tokens == vl.image_token_id).astype(np.int64))).logits.numpy()
    inputs = prepare_inputs(vl, tokens, mask.astype(bool), pixels, grid, num_positions=width)
    ours = np.asarray(vl_forward(vl, result.state.params, jax.numpy.asarray(tokens, jax.numpy.int32),
                                 jax.numpy.asarray(mask, bool), inputs))
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    capsys.readouterr()
    assert main(["export", str(result.output_dir), str(tmp_path / "peft"), "--adapter"]) == 2  # a text-only form
    assert "drop --adapter" in capsys.readouterr().err


@pytest.mark.parametrize("override, match", [
    (["model.vision.depth=0"], "no vision tower"),
    (["rl.mode=async", "mesh.sampler_devices=1"], "image prompts"),
    (["warm_start.target_accuracy=0.3"], "target_accuracy"),
])
def test_unsupported_settings_are_one_line(tmp_path, override, match):
    """A visual task on a text model, an overlapped driver (the drivers' table: only sync takes
    images), a warm start that stops on accuracy: one line each."""
    with pytest.raises(ConfigError, match=match):
        train(load_config("vl_default", [f"output_dir={tmp_path}/run", *TINY, *override]))


def test_dynamic_sampling_is_a_sync_vl_run(tmp_path):
    """`rl.dynamic_sampling` on an image run passes the VL checks and the drivers' table (the sync
    driver, which takes images) and over-samples the pipeline's batches, images included
    (`tests/stages/test_image_rollout.py::test_dynamic_sampling_keeps_each_prompts_images`: the
    kept rows carry their own images). Catches the refusal coming back."""
    from rljax.drivers.registry import check_features, driver_name
    from rljax.train.vision_setup import check_vision_run

    cfg = load_config("vl_default", [f"output_dir={tmp_path}/run", *TINY, "rl.dynamic_sampling=true"])
    check_vision_run(cfg, (None, None))
    check_features(cfg)
    assert driver_name(cfg) == "sync" and cfg.rl.num_prompts == 2 * cfg.rl.prompts_per_iteration
