"""`update.remat = "auto"` (`rljax.plan.remat`): on simulated device-memory sizes it picks the
fastest remat mode the plan fits, refuses in one line below full remat, keeps explicit settings,
chooses "none" where no memory is known (a CPU), and a second start compiles nothing.

The three plans (one per mode, of a 2-layer model on one device) are computed once per module and
cached in a temporary file, as a run's choice is."""

from __future__ import annotations

import pytest

from rljax.errors import ConfigError
from rljax.models.setup import build_tokenizer
from rljax.plan import remat as plan_remat
from rljax.plan.accelerators import format_gib
from rljax.plan.memory import plan_memory
from rljax.plan.remat import choose_remat, plan_peaks
from rljax.train.config import load_config

TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=32", "rl.prompts_per_iteration=4", "sampling.num_samples=4",
        "sampling.max_new_tokens=32", "data.max_prompt_tokens=16", "mesh.devices=1"]


def tiny(*overrides: str):
    return load_config("default", [*TINY, *overrides])


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """(auto config, tokenizer, the plan's peak per mode), the plans cached in a temporary file."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RLJAX_PLAN_CACHE", str(tmp_path_factory.mktemp("plans") / "remat_plans.json"))
    plan_remat._MEMO.clear()
    planned_here = {}

    def recording_plan(cfg, *args, **kwargs):  # the plans the choice compiles, by their update.remat
        plan = plan_memory(cfg, *args, **kwargs)
        planned_here[cfg.update.remat] = plan.peak_bytes
        return plan

    mp.setattr("rljax.plan.memory.plan_memory", recording_plan)
    cfg = tiny("update.remat=auto")
    tokenizer = build_tokenizer(cfg.model)
    peaks = plan_peaks(cfg, tokenizer=tokenizer)
    mp.setattr("rljax.plan.memory.plan_memory", plan_memory)
    assert planned_here == peaks  # each mode's peak is `plan_memory`'s for that setting
    yield cfg, tokenizer, peaks
    mp.undo()
    plan_remat._MEMO.clear()


def test_peaks_are_the_plans_and_ordered(planned):
    """Each mode's peak is the whole plan's (`plan_memory` with update.remat set to the mode: the
    fixture records them), and none > selective > full.
    Catches: an estimate other than the plan's (a re-planned update alone), selective no cheaper
    than none, or no dearer than full (a policy that saves nothing)."""
    cfg, tokenizer, peaks = planned
    assert set(peaks) == {"none", "selective", "full"}
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks


@pytest.mark.parametrize("limit_at, expected", [("none", "none"), ("below none", "selective"),
                                                ("below selective", "full")])
def test_auto_picks_the_fastest_mode_the_plan_fits(planned, limit_at, expected):
    """A device exactly at no remat's peak runs without remat; one byte below, selective; one byte
    below selective, full; the run log's line names the choice, the device and the peaks.
    Catches: a strict comparison (`<` drops a plan that fits exactly), the wrong order of
    preference, a choice that is not in the returned config."""
    cfg, tokenizer, peaks = planned
    limit = {"none": peaks["none"], "below none": peaks["none"] - 1,
             "below selective": peaks["selective"] - 1}[limit_at]
    choice = choose_remat(cfg, tokenizer=tokenizer, limit=(limit, "the test device"))
    assert choice.mode == expected and choice.cfg.update.remat == expected
    line = choice.line()
    assert line.startswith(f"update.remat=auto -> {expected}: ") and "the test device" in line
    assert f"{expected} {format_gib(peaks[expected])}" in line and "\n" not in line


def test_auto_refuses_below_full_remat_in_one_line(planned):
    """Below full remat's peak nothing fits: one line with every mode's peak and the settings to
    change. Catches: running full remat anyway, a message without the fix."""
    cfg, tokenizer, peaks = planned
    with pytest.raises(ConfigError) as err:
        choose_remat(cfg, tokenizer=tokenizer, limit=(peaks["full"] - 1, "the test device"))
    line = str(err.value)
    assert "\n" not in line and line.startswith("update.remat=auto: no remat mode fits the test device")
    assert f"full {format_gib(peaks['full'])}" in line
    assert "update.num_microbatches (now 1)" in line and "mesh.fsdp" in line


def test_second_start_compiles_nothing(planned, monkeypatch):
    """A fresh process (the in-process memo cleared) reads the plans from the cache file and
    compiles nothing. Catches: a cache that is never written or keyed per process."""
    cfg, tokenizer, peaks = planned
    plan_remat._MEMO.clear()
    monkeypatch.setattr("rljax.plan.memory.plan_memory", lambda *a, **k: pytest.fail("compiled a plan"))
    choice = choose_remat(cfg, tokenizer=tokenizer, limit=(peaks["selective"], "the test device"))
    assert choice.mode == "selective" and choice.cached and "(cached plan)" in choice.line()


def test_explicit_setting_wins_and_cpu_picks_no_remat(planned, monkeypatch):
    """An explicit update.remat is kept whatever the memory; "auto" with no device memory known
    (a CPU, no [plan] size) is "none", what the default job runs today, with nothing compiled.
    Catches: auto overriding an explicit choice, planning on CPU."""
    cfg, tokenizer, peaks = planned
    monkeypatch.setattr("rljax.plan.memory.plan_memory", lambda *a, **k: pytest.fail("compiled a plan"))
    for setting, mode in (("true", "full"), ("false", "none"), ("selective", "selective")):
        explicit = tiny(f"update.remat={setting}")
        choice = choose_remat(explicit, tokenizer=tokenizer, limit=(1, "the test device"))
        assert choice.mode == mode and choice.cfg is explicit and not choice.auto
    cpu = choose_remat(cfg, tokenizer=tokenizer)  # the default [plan]: no size; a CPU device reports none
    assert cpu.mode == "none" and cpu.cfg.update.remat == "none" and "no device memory is known" in cpu.line()
    assert load_config("default", []).update.remat is False  # the default job is unchanged
