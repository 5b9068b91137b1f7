"""`update.remat = "auto"` (`rljax.plan.remat`): on simulated device-memory sizes it picks the
fastest remat mode the plan fits, refuses in one line below full remat, keeps explicit settings,
chooses "none" where no memory is known (a CPU), and a second start compiles nothing. With
`update.num_microbatches = "auto"` too, it picks the fewest micro-batches with the fastest mode,
estimating before it compiles.

The three plans (one per mode, of a 2-layer model on one device) are computed once per module and
cached in a temporary file, as a run's choice is; the micro-batch tests reuse them or plan on a
simulated planner (no compile)."""

from __future__ import annotations

import types

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


def test_auto_microbatches_reuse_the_cached_plan(planned, monkeypatch):
    """num_microbatches="auto" where one micro-batch without remat fits: 1 and "none", from the
    module's cached plans (compiling nothing), and the log line names both choices.
    Catches: a cache keyed on the micro-batch setting (re-planning what is known), a choice that
    does not start at one micro-batch."""
    cfg, tokenizer, peaks = planned
    monkeypatch.setattr("rljax.plan.memory.plan_memory", lambda *a, **k: pytest.fail("compiled a plan"))
    choice = choose_remat(tiny("update.remat=auto", "update.num_microbatches=auto"), tokenizer=tokenizer,
                          limit=(peaks["none"], "the test device"))
    assert (choice.mode, choice.microbatches) == ("none", 1)
    assert (choice.cfg.update.remat, choice.cfg.update.num_microbatches) == ("none", 1)
    assert choice.line().startswith("update.remat=auto -> none, update.num_microbatches=auto -> 1: the fastest")
    assert f"none/1 {format_gib(peaks['none'])}" in choice.line()


# A simulated plan of the tiny recipe (16 rows): peak = 1000 + act[mode] * 16 / m bytes, 10 more
# for m >= 4 (so the a + b/m estimate from m = 1, 2 is 10 short there and its plan must confirm it).
ACT = {"none": 160, "selective": 80, "full": 20}
ROW_TOKENS = 16 * (16 + 32)  # the mini-batch's rows x their width (prompt bucket + new tokens)


def simulated_peak(mode: str, micro: int) -> int:
    return 1000 + ACT[mode] * 16 // micro + (10 if micro >= 4 else 0)


@pytest.fixture
def simulated(tmp_path, monkeypatch):
    """The plan replaced by `simulated_peak`; yields the list of (mode, micro-batches) planned."""
    monkeypatch.setenv("RLJAX_PLAN_CACHE", str(tmp_path / "remat_plans.json"))
    plan_remat._MEMO.clear()
    compiled = []

    def plan(cfg, *args, **kwargs):
        u = cfg.update  # a packed candidate is its token budget: ROW_TOKENS / budget micro-batches
        micro = ROW_TOKENS // u.max_tokens_per_microbatch if u.packing else u.num_microbatches
        compiled.append((u.remat, micro))
        return types.SimpleNamespace(peak_bytes=simulated_peak(u.remat, micro), sampler_peak_bytes=500, sampler=None)

    monkeypatch.setattr("rljax.plan.memory.plan_memory", plan)
    yield compiled
    plan_remat._MEMO.clear()


@pytest.mark.parametrize("limit, expected, compiled_expected", [
    (3560, ("none", 1), [("none", 1)]),
    (2000, ("none", 4), [("none", 1), ("none", 2), ("none", 4)]),
    (1645, ("none", 8), [("none", 1), ("none", 2), ("none", 4), ("none", 8)]),  # the estimate admitted 4, its plan did not
    (1200, ("none", 16), [("none", 1), ("none", 2), ("none", 16)]),
    (1100, ("selective", 16), [("none", 1), ("none", 2), ("selective", 1), ("selective", 2), ("selective", 16)]),
    (1060, ("full", 8), [("none", 1), ("none", 2), ("selective", 1), ("selective", 2), ("full", 1), ("full", 2),
                         ("full", 8)]),
])
def test_auto_microbatches_follow_the_plan(simulated, limit, expected, compiled_expected):
    """As the device shrinks: 1 micro-batch without remat, then more micro-batches, then selective,
    then full remat, each with the fewest micro-batches that fit; only the candidates the a + b/m
    estimate admits are planned (here at most 7 of 15), and one whose plan does not fit is passed.
    Catches: micro-batches before remat in the wrong order (full/1 fits at 1645 and 1200), a
    strict comparison, compiling every candidate, trusting an estimate without its plan (none/4
    at 1645), an estimate that rules out what fits."""
    cfg = tiny("update.remat=auto", "update.num_microbatches=auto")
    choice = choose_remat(cfg, tokenizer=build_tokenizer(cfg.model), limit=(limit, "the test device"))
    assert (choice.mode, choice.microbatches) == expected
    assert (choice.cfg.update.remat, choice.cfg.update.num_microbatches) == expected
    assert simulated == compiled_expected
    line = choice.line()
    assert line.startswith(f"update.remat=auto -> {expected[0]}, update.num_microbatches=auto -> {expected[1]}: ")
    assert f"{expected[0]}/{expected[1]} {format_gib(simulated_peak(*expected))}" in line and "\n" not in line


def test_auto_microbatches_refuse_below_every_schedule(simulated):
    """Below full remat at one row per micro-batch nothing fits: one line naming the settings to
    change. Catches: running the last candidate anyway, telling the user to raise a count that
    auto already raised."""
    cfg = tiny("update.remat=auto", "update.num_microbatches=auto")
    with pytest.raises(ConfigError) as err:
        choose_remat(cfg, tokenizer=build_tokenizer(cfg.model), limit=(1025, "the test device"))
    line = str(err.value)
    assert "\n" not in line and line.startswith("update.remat=auto, update.num_microbatches=auto: no schedule fits")
    assert "sampling.max_new_tokens" in line and "mesh.fsdp" in line and "raise update.num_microbatches" not in line


def test_explicit_microbatches_win(simulated):
    """An explicit num_microbatches is kept while auto picks the mode (full at 4 here, where
    auto micro-batches would pick none/16), and an explicit remat is kept while auto picks the
    micro-batches; on a CPU (no memory known) auto micro-batches are 1. Catches: auto
    overriding a set count or mode."""
    tokenizer = build_tokenizer(tiny().model)
    choice = choose_remat(tiny("update.remat=auto", "update.num_microbatches=4"), tokenizer=tokenizer,
                          limit=(1200, "the test device"))
    assert (choice.mode, choice.microbatches, choice.auto_micro) == ("full", 4, False)
    assert choice.cfg.update.num_microbatches == 4 and all(m == 4 for _, m in simulated)
    choice = choose_remat(tiny("update.remat=selective", "update.num_microbatches=auto"), tokenizer=tokenizer,
                          limit=(1100, "the test device"))
    assert (choice.mode, choice.microbatches, choice.auto) == ("selective", 16, False)
    assert choice.line().startswith("update.remat=selective, update.num_microbatches=auto -> 16: ")
    cpu = choose_remat(tiny("update.remat=auto", "update.num_microbatches=auto"), tokenizer=tokenizer)
    assert (cpu.mode, cpu.microbatches) == ("none", 1) and "no device memory is known" in cpu.line()
    with pytest.raises(ConfigError, match="packing"):
        tiny("update.packing=true", "update.num_microbatches=auto")


@pytest.mark.parametrize("limit, expected", [(3560, ("none", 1)), (1200, ("none", 16)), (1060, ("full", 8))])
def test_auto_token_budget_is_the_packed_schedule(simulated, limit, expected):
    """With `update.packing`, `update.max_tokens_per_microbatch = "auto"` makes the same choice in
    tokens: m micro-batches of the 16-row mini-batch are a budget of 16 / m rows x 48 columns,
    the candidates planned are the padded ones' (same order, same estimates), `num_microbatches`
    stays 1, and the log line names the budget. Catches: a budget that ignores the row width or
    divides the wrong way (the simulated plan would read another m), an "auto" budget kept in
    the config the update is built from, auto overriding an explicit budget."""
    cfg = tiny("update.remat=auto", "update.packing=true", "update.max_tokens_per_microbatch=auto")
    choice = choose_remat(cfg, tokenizer=build_tokenizer(cfg.model), limit=(limit, "the test device"))
    mode, micro = expected
    assert (choice.mode, choice.microbatches) == expected
    assert choice.cfg.update.max_tokens_per_microbatch == 16 // micro * 48 and choice.cfg.update.num_microbatches == 1
    assert choice.cfg.update.packed_shape(16, 48) == (16 // micro, 48)
    padded = choose_remat(tiny("update.remat=auto", "update.num_microbatches=auto"),
                          tokenizer=build_tokenizer(cfg.model), limit=(limit, "the test device"))
    assert simulated[:len(simulated) // 2] == simulated[len(simulated) // 2:]  # the same candidates as padded
    assert (padded.mode, padded.microbatches) == expected
    line = choice.line()
    assert line.startswith(f"update.remat=auto -> {mode}, update.max_tokens_per_microbatch=auto -> "
                           f"{16 // micro * 48} ({micro} micro-batches): ") and "\n" not in line
    explicit = choose_remat(tiny("update.remat=auto", "update.packing=true", "update.max_tokens_per_microbatch=96"),
                            tokenizer=build_tokenizer(cfg.model), limit=(limit, "the test device"))
    assert explicit.cfg.update.max_tokens_per_microbatch == 96 and not explicit.auto_micro
    cpu = choose_remat(cfg, tokenizer=build_tokenizer(cfg.model))  # no device memory known: one micro-batch
    assert cpu.cfg.update.max_tokens_per_microbatch == 16 * 48 and "no device memory is known" in cpu.line()


def test_auto_token_budget_refusals(simulated):
    """One line each: nothing fits (naming what to change, not the budget auto already lowered),
    "auto" without packing, and an unresolved "auto" reaching the update. Catches: a packed
    refusal telling the user to lower a budget auto chose, an "auto" budget silently read as 0."""
    cfg = tiny("update.remat=auto", "update.packing=true", "update.max_tokens_per_microbatch=auto")
    with pytest.raises(ConfigError) as err:
        choose_remat(cfg, tokenizer=build_tokenizer(cfg.model), limit=(1025, "the test device"))
    line = str(err.value)
    assert line.startswith("update.remat=auto, update.max_tokens_per_microbatch=auto: no schedule fits")
    assert "lower update.max_tokens_per_microbatch" not in line and "\n" not in line
    with pytest.raises(ConfigError, match="update.packing=true"):
        tiny("update.max_tokens_per_microbatch=auto")
    with pytest.raises(ConfigError, match="choose_remat"):
        cfg.update.packed_shape(16, 48)
