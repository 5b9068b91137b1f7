"""Recipes load, validate and override; bad input is one clear line."""

import dataclasses
import functools
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from rljax.config_io import Bound, check_bound, field_bound
from rljax.errors import ConfigError
from rljax.objectives.config import PRESETS, AlgorithmConfig
from rljax.data.config import SourceSection
from rljax.train.config import CONFIG_DIR, TrainConfig, load_config

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
    ("algorithm.num_microbatches=2", "algorithm.num_microbatches moved to the [update] section; write "
                                     "update.num_microbatches"),
    ("algorithm.overlong_max_length=8", "algorithm.overlong_max_length moved to the [shaping] section"),
    ("shaping.overlong_max_length=0", "shaping.overlong_max_length=0 must be >= 1"),
    ("update.num_minibatches=3", "must be divisible by update.num_minibatches"),
    ("algorithm.gamma=0.9", "gamma=0.9 has no effect on advantage='grpo'"),
    ("rl.reference_reset_every=5", "rl.reference_reset_every=5 needs a KL reference: set algorithm.kl_coef > 0"),
    # A model in a bucket is not read in place: the line gives the copy command (not "gs:/b/m has no config.json").
    ("model.checkpoint=gs://b/qwen", "model.checkpoint='gs://b/qwen': a model is read from a local directory; "
                                     "copy it first (gcloud storage cp -r gs://b/qwen .)"),
])
def test_bad_config_is_one_clear_line(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_cli_reports_bad_config_without_traceback(tmp_path):
    """`rljax train bad.key=1` prints one error line and exits 2."""
    proc = subprocess.run([sys.executable, "-m", "rljax.cli", "train", "rl.bogus=1"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "unknown config key 'rl.bogus'" in proc.stderr


def test_overrides_may_stand_on_both_sides_of_an_option():
    """`rljax train a=1 --resume b=2` keeps both overrides (launch scripts append --resume after
    the user's words), and a stray option is still refused. Catches: argparse ending the
    overrides at the first option ('unrecognized arguments: b=2'), or swallowing a bad flag."""
    from rljax.cli import build_parser, main

    parser = build_parser()
    args, extra = parser.parse_known_args(["train", "rl.iterations=2", "--resume", "seed=3"])
    assert extra == ["seed=3"]  # what argparse alone leaves behind
    seen = {}
    import rljax.train.command as train_command
    original = train_command._train
    try:
        train_command._train = lambda a: seen.update(overrides=a.overrides, resume=a.resume) or 0
        assert main(["train", "rl.iterations=2", "--resume", "seed=3"]) == 0
        assert seen == {"overrides": ["rl.iterations=2", "seed=3"], "resume": True}
        seen.clear()
        with pytest.raises(SystemExit):
            main(["train", "rl.iterations=2", "--bogus", "seed=3"])
        assert seen == {}
    finally:
        train_command._train = original


def test_split_sections_reach_the_train_state_and_recipes_load_by_name():
    """[update] and [shaping] are their own sections; a bare recipe name picks the packaged file
    (a wheel install has no checkout `configs/`)."""
    cfg = load_config("ppo", ["update.num_microbatches=2", "shaping.overlong_max_length=6",
                              "shaping.overlong_buffer=2"])
    assert cfg.algorithm.algorithm == "ppo" and cfg.update.num_epochs == 2 and cfg.update.num_microbatches == 2
    assert cfg.shaping.overlong_max_length == 6 and cfg.algorithm.whiten_advantages
    assert load_config("configs/ppo.toml") == load_config("ppo") == load_config(CONFIG_DIR / "ppo.toml")
    assert CONFIG_DIR.parent.name == "rljax"  # inside the package: shipped as package data


def test_missing_config_file_is_clear(tmp_path):
    """A recipe that does not exist is one line naming every packaged recipe. Catches: "see
    configs/ for recipes" (which names none, and a wheel install has no configs/)."""
    with pytest.raises(ConfigError, match="does not exist") as raised:
        load_config(Path(tmp_path / "nope.toml"))
    message = str(raised.value)
    assert "\n" not in message and all(name.removesuffix(".toml") in message for name in RECIPES)


def test_a_wheel_install_has_the_recipes(tmp_path):
    """A non-editable install (the wheel the launch scripts ship) loads the default job and the
    recipes by name: they are package data. Fails if the recipes lived only in the checkout."""
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(root),
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=300,
                   cwd=tmp_path)
    wheel = next((tmp_path / "wheel").glob("rljax-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    code = ("import rljax.train.config as c; from rljax.train.config import load_config; "
            "assert 'site' in c.__file__, c.__file__; "
            "print(load_config().rl.iterations, load_config('ppo').algorithm.algorithm)")
    env = {"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(load_config().rl.iterations), "ppo"]


# ----------------------------------------------------------------------------- numeric ranges


def _numeric(tp) -> bool:
    """Whether a field's type holds numbers (int, float; optional, a union or a tuple of them)."""
    if tp in (int, float):
        return True
    return any(_numeric(arg) for arg in typing.get_args(tp) if arg is not bool)


def _declared_settings(cls=TrainConfig, prefix=""):
    """(dotted key, field, type) of every numeric setting under `cls`, walked from the dataclasses'
    own type hints: a new numeric field anywhere in the run's config shows up here."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            yield from _declared_settings(tp, f"{prefix}{f.name}.")
        elif inner:  # a list of sections: data.sources
            yield from _declared_settings(inner[0], f"{prefix}{f.name}[0].")
        elif _numeric(tp):
            yield prefix + f.name, f, tp


SETTINGS = list(_declared_settings())


def _outside(bound: Bound) -> list[float]:
    """A value just past each finite end of `bound`, as an integer where the end is one."""
    lo = bound.ge if bound.ge is not None else bound.gt
    hi = bound.le if bound.le is not None else bound.lt
    values = []
    if lo is not None:
        values.append(lo - (bound.ge is not None) if float(lo).is_integer() else lo / 2)
    if hi is not None:
        values.append(hi + (bound.le is not None) if float(hi).is_integer() else hi * 2)
    return [v for v in values if not bound.contains(v)]


def _override(key: str, tp, value) -> str:
    """`key=value` as the command line takes it: a tuple setting gets a list (a list of lists for
    stop sequences), a setting of data.sources an inline table."""
    text = str(int(value)) if float(value).is_integer() else repr(value)
    nesting = str(tp).count("tuple[")
    text = "[" * nesting + text + "]" * nesting
    if key.startswith("data.sources[0]."):
        return f"data.sources=[{{{key.split('.')[-1]} = {text}}}]"
    return f"{key}={text}"


def test_every_numeric_setting_declares_its_range():
    """Each numeric key of the run's config carries a `bounded(...)` range, and the defaults (and
    every algorithm preset's values) lie inside it. The count pins the set of keys: a new numeric
    setting without a range fails the first assertion; one with a range changes the count, so
    this test and the generated one below are updated together.

    Catches: a numeric field added as `x: int = 3` (no range), and a range that refuses its own
    default (`learning_rate: float = bounded(1e-6, gt=1e-3)`)."""
    unranged = [key for key, f, _ in SETTINGS if field_bound(f) is None]
    assert not unranged, f"numeric settings without a declared range: {unranged}"
    assert len(SETTINGS) == 157  # + [model.vision]: 7, [shaping] curriculum: 4 (issue 49); sampling.kv_cache_bytes
    # and sampling.prefill_chunk (issue 50)
    defaults = TrainConfig()
    for key, f, _ in SETTINGS:
        if key.startswith("data.sources"):
            value = getattr(SourceSection(), f.name)
        else:
            value = functools.reduce(getattr, key.split("."), defaults)
        check_bound(value, field_bound(f), key)
    for name in PRESETS:
        preset = AlgorithmConfig(algorithm=name)
        for f in dataclasses.fields(AlgorithmConfig):
            if field_bound(f) is not None:
                check_bound(getattr(preset, f.name), field_bound(f), f"algorithm.{f.name} ({name})")


CASES = [(key, tp, value, field_bound(f)) for key, f, tp in SETTINGS for value in _outside(field_bound(f))]


@pytest.mark.parametrize("key,tp,value,bound", CASES, ids=[f"{c[0]}={c[2]}" for c in CASES])
def test_out_of_range_setting_is_refused_in_one_line_before_anything_runs(key, tp, value, bound, monkeypatch,
                                                                          capsys):
    """`rljax train KEY=VALUE` with VALUE just outside KEY's declared range exits 2 with one line
    naming the key, the value and the range, before the run allocates an array or trains.

    Catches: a range declared but not checked at load (`build` skipping `check_bound`), a check
    whose message drops the key (`batch size -1 must be >= 1`), and a negative `rl.iterations`
    reaching the warm start (the patched `train` raises if called)."""
    import jax

    from rljax.cli import main

    def trained(*args, **kwargs):
        raise AssertionError(f"{key}={value} reached training")

    monkeypatch.setattr("rljax.train.loop.train", trained)
    arrays = len(jax.live_arrays())
    code = main(["train", _override(key, tp, value)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    match = re.fullmatch(r"rljax train: error: (\S+)=(\S+) must be (.+)", err)
    assert match, err
    assert match.group(1) == key or match.group(1).startswith(key + "["), err  # a tuple names its item
    assert float(match.group(2)) == value and match.group(3) == bound.describe(), err
    assert len(jax.live_arrays()) == arrays
