"""`rljax train` on a vision-language recipe (`rljax.train.vl_loop`): configs/vl_default.toml
shrunk to a tiny random Qwen2.5-VL-shaped model runs 2 iterations end to end (warm start with
images, the image sampler, the verifier, the update with the tower trained, greedy held-out eval
with images, the final HF export) with finite metrics; and the settings it does not take are one
line each."""

from __future__ import annotations

import math

import pytest

from rljax.errors import ConfigError
from rljax.train.config import load_config
from rljax.train.loop import train

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=16", "model.vision.depth=1", "model.vision.hidden_size=16",
        "model.vision.intermediate_size=32", "model.vision.fullatt_block_indexes=[]", "data.task_kwargs={image_size=56, short=true}",
        "data.size=8", "data.eval_size=2", "eval.size=2", "eval.every=1", "warm_start.steps=1",
        "warm_start.batch_size=2", "rl.iterations=2", "rl.prompts_per_iteration=2", "sampling.num_samples=2",
        "sampling.max_new_tokens=2"]


def test_vl_default_trains_two_iterations(tmp_path):
    """Two iterations of the shrunk vl_default: every logged metric finite, the held-out accuracy
    measured at the start and after each iteration, the export written. Catches a loop that
    drops the images between the pipeline and the iteration (the placeholder check raises), a
    NaN from the spliced update, and a broken eval or export."""
    cfg = load_config("vl_default", [f"output_dir={tmp_path}/run", *TINY])
    result = train(cfg)
    assert [h["step"] for h in result.history] == [0, 1, 2]
    for row in result.history[1:]:
        assert row["rollout/tokens"] > 0
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    assert 0.0 <= result.start_accuracy <= 1.0 and 0.0 <= result.final_accuracy <= 1.0
    assert (result.output_dir / "final" / "config.json").exists()
    assert "visual" in result.state.params


@pytest.mark.parametrize("override, match", [
    (["model.vision.depth=0"], "no vision tower"),
    (["sampling.scheduler=continuous"], "scheduler='static'"),
    (["rl.dynamic_sampling=true"], "rl.dynamic_sampling"),
    (["warm_start.target_accuracy=0.3"], "target_accuracy"),
])
def test_unsupported_settings_are_one_line(tmp_path, override, match):
    """A visual task on a text model, a non-static scheduler, dynamic sampling, a warm start that
    stops on accuracy (the VL warm start does not check it): one line each."""
    cfg = load_config("vl_default", [f"output_dir={tmp_path}/run", *TINY, *override])
    with pytest.raises(ConfigError, match=match):
        train(cfg)
