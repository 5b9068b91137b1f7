"""VL-Cogito's curriculum options (`[shaping] difficulty_*`, `length_reward_*`;
rljax.objectives.difficulty) flow from a recipe's overrides through `rljax train`'s one loop into
the update's rewards and advantages, and show in the logged metrics: a text run here, the image
run in test_vl_loop (its shrunk vl_default runs with them)."""

from __future__ import annotations

import math

from rljax.train.config import load_config
from rljax.train.loop import train

from test_loop import TINY

CURRICULUM = ["shaping.difficulty_stages=['easy', 'hard']", "shaping.difficulty_boundaries=[1]",
              "shaping.length_reward_coef=0.5"]
SHORT = TINY + ["warm_start.steps=5", "rl.iterations=2", "rl.prompts_per_iteration=4", "sampling.num_samples=4",
                "model.hidden_size=32", "model.num_layers=1", "model.head_dim=16", "data.size=64", "data.eval_size=4",
                "eval.every=100", "eval.size=4", "mesh.devices=1", "checkpoint.every=100"]


def check_curriculum_history(history):
    """Iteration 1 in the easy stage (index 0) without DyLR, iteration 2 in the hard stage (1)
    with it (a length term is <= 0 and logged), each prompt weight in [0, 1]."""
    first, second = history[1], history[2]
    assert first["train/difficulty_stage"] == 0 and second["train/difficulty_stage"] == 1
    assert first["train/length_reward_mean"] == 0.0
    assert second["train/length_reward_mean"] <= 0.0 and second["train/length_target_mean"] > 0
    for row in (first, second):
        assert 0.0 <= row["train/difficulty_weight_mean"] <= 1.0
        assert 0.0 <= row["train/prompt_accuracy_mean"] <= 1.0
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))


def test_curriculum_options_reach_a_text_run(tmp_path):
    """Catches options that the config loads but the train state never receives (the metrics are
    absent), or DyLR outside the hard stage."""
    result = train(load_config(None, SHORT + CURRICULUM + [f"output_dir='{tmp_path}'"]), log=lambda *_: None)
    check_curriculum_history(result.history)

