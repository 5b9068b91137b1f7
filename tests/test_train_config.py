"""Recipes load, validate and override; bad input is one clear line."""

import subprocess
import sys
from pathlib import Path

import pytest

from rljax.errors import ConfigError
from rljax.train.config import CONFIG_DIR, load_config

RECIPES = sorted(p.name for p in CONFIG_DIR.glob("*.toml"))


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_loads_and_validates(name):
    """Each shipped recipe builds a valid, typed TrainConfig."""
    cfg = load_config(CONFIG_DIR / name)
    assert cfg.rl.iterations > 0 and cfg.sampling.num_samples > 0


def test_overrides_are_typed_and_reach_nested_sections():
    """key=value overrides parse TOML literals into the declared types."""
    cfg = load_config(None, ["rl.iterations=7", "algorithm.algorithm=dapo", "sampling.temperature=0.7",
                             "data.task_kwargs={min_terms=2, max_terms=3}", "reward.answer_methods=['answer_tag']"])
    assert cfg.rl.iterations == 7 and cfg.algorithm.aggregation == "token-mean"
    assert cfg.sampling.temperature == 0.7 and cfg.data.task_kwargs == {"min_terms": 2, "max_terms": 3}
    assert cfg.reward.answer_methods == ("answer_tag",)
    assert cfg.optim.total_steps == 7  # the schedule follows the run length unless set


@pytest.mark.parametrize("override,message", [
    ("rl.iteration=5", "unknown config key 'rl.iteration'; valid keys here: dynamic_sampling, iterations"),
    ("algorithm.algorithm=foo", "unknown algorithm 'foo'; choose one of cispo, dapo"),
    ("sampling.num_samples=many", "sampling.num_samples='many' must be an integer"),
    ("data.source=csv", "data.source='csv' is not valid; choose one of 'reasoning_gym', 'jsonl'"),
    ("rl.iterations", "must look like key=value"),
    ("mesh.sampler=fsdp", "mesh.sampler='fsdp' is not valid; choose one of 'shared', 'tensor'"),
    ("mesh.sampler_tensor=2", "mesh.sampler_tensor only applies to a separate sampler layout"),
    ("mesh.sampler_tensor=-1", "mesh.sampler_tensor=-1 must be >= 0"),
])
def test_bad_config_is_one_clear_line(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("'", "'")):
        load_config(None, [override])


def test_cli_reports_bad_config_without_traceback(tmp_path):
    """`rljax train bad.key=1` prints one error line and exits 2."""
    proc = subprocess.run([sys.executable, "-m", "rljax.cli", "train", "rl.bogus=1"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "unknown config key 'rl.bogus'" in proc.stderr


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Path(tmp_path / "nope.toml"))
