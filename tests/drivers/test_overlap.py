"""Sampling and training overlapped on disjoint devices (issue 20): one_step_off equals its
sequential definition, async never trains a row older than eta versions and counts the ones it
drops, both sides stop on any failure, checkpoints resume (exactly, for one_step_off), and bad
configs fail in one line.

The drivers run on two of the 8 simulated CPU devices (tests/conftest.py): trainer on device 0,
sampler on device 1."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from rljax.sharding.placement import build_layouts
from rljax.errors import ConfigError
from rljax.models import init_params, preset
from rljax.objectives import AlgorithmConfig
from rljax.optim import OptimConfig
from rljax.rewards.base import Rewards
from rljax.sampling import SampleControls
from rljax.sharding import split_devices
from rljax.drivers import overlap
from rljax.sharding.mesh import MeshConfig
from rljax.train.config import load_config
from rljax.stages.iteration import make_stages
from rljax.train.loop import train
from rljax.drivers.queue import row_versions
from rljax.update import init_train_state

CFG = preset("qwen2-test")
P, T = 4, 6
CONTROLS = SampleControls(max_new_tokens=4, num_samples=2, temperature=1.0, eos_ids=(3,), pad_id=0)
ROWS = P * CONTROLS.num_samples
ALGO, OPTIM = AlgorithmConfig(), OptimConfig(learning_rate=1e-2, warmup_steps=0)
LOOP_KEY = jax.random.key(3)


def reward_callback(tokens_bt, mask_bt, index_b):
    """Reward 1 when the first completion token is a multiple of 3: differs within groups."""
    del index_b
    total = ((tokens_bt[:, 0] % 3) == 0).astype(jnp.float32) * mask_bt[:, 0]
    return Rewards(total, {"r": total}, jnp.zeros(total.shape, bool))


def crashing_callback(tokens_bt, mask_bt, index_b):
    """A verifier whose host side raises (as a broken reward function would, inside io_callback)."""
    def host(tokens):
        raise ValueError("verifier exploded")
    total = io_callback(host, jax.ShapeDtypeStruct(tokens_bt.shape[:1], jnp.float32), tokens_bt)
    return Rewards(total, {}, jnp.zeros(total.shape, bool))


def prompts_at(j: int):
    rng = np.random.default_rng(100 + j)
    tokens = rng.integers(4, CFG.vocab_size, (P, T)).astype(np.int32)
    return tokens, np.ones((P, T), bool), np.arange(P, dtype=np.int32)


def prompt_source():
    counter = itertools.count()
    return lambda: prompts_at(next(counter))


@pytest.fixture(scope="module")
def layouts():
    return build_layouts(MeshConfig(devices=2, sampler_devices=1))


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def _state(params, layout=None):
    """A fresh state; with a layout, every leaf in it (as `rljax train` builds it), so the update
    program's first call has the types of the states it returns and compiles once."""
    state = init_train_state(CFG, jax.tree.map(jnp.copy, params), ALGO, OPTIM, layout=layout)
    return state if layout is None else jax.device_put(state, layout.tree(state))


@pytest.fixture(scope="module")
def programs(layouts, params):
    trainer, sampler = layouts
    stages = make_stages(CONTROLS, reward_callback, _state(params, trainer), num_prompts=P, trainer=trainer,
                         sampler=sampler)
    return overlap.OverlapPrograms.from_stages(stages)


def _python_threads() -> set:
    """Threads Python started. XLA's own worker threads appear as `_DummyThread`s once one runs a
    host callback; they belong to the runtime's pool and live as long as the process."""
    return {t for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}


def _threads_back(before: set, within_s: float = 5.0) -> float:
    """Seconds until no thread beyond `before` is alive (fails after `within_s`)."""
    start = time.perf_counter()
    while _python_threads() - before:
        assert time.perf_counter() - start < within_s, _python_threads() - before
        time.sleep(0.01)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- device groups


def test_sampler_devices_split_the_mesh(layouts):
    """mesh.sampler_devices gives the sampler the last devices and the trainer the rest, disjoint;
    a fraction rounds; counts that leave a side empty fail in one line.
    Catches: overlapping device groups (nothing could overlap), the sampler taking device 0, and
    silent acceptance of a split with an empty side."""
    trainer, sampler = layouts
    assert set(trainer.mesh.devices.flat) == {jax.devices()[0]}
    assert set(sampler.mesh.devices.flat) == {jax.devices()[1]}
    t, s = split_devices(jax.devices(), 0.25)
    assert s == jax.devices()[6:] and t == jax.devices()[:6]
    for bad in (0, 8, 0.01):
        with pytest.raises(ConfigError, match="sampler_devices") as e:
            split_devices(jax.devices(), bad)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, names", [
    (["rl.mode=async"], "mesh.sampler_devices"),
    (["rl.mode=one_step_off", "mesh.sampler_devices=1", "rl.dynamic_sampling=true"], "rl.dynamic_sampling"),
    (["rl.mode=async", "mesh.sampler_devices=1", "rl.replay.capacity=64", "algorithm.recompute_old_logp=true",
      "algorithm.off_policy='tis'"], "rl.replay"),
    (["rl.mode=one_step_off", "mesh.sampler_devices=1", "data.prompt_buckets=[32]"], "data.prompt_buckets"),
    (["mesh.sampler_devices=-1"], "mesh.sampler_devices"),
    (["mesh.sampler_devices=1.5"], "mesh.sampler_devices"),
    (["rl.max_staleness=-1"], "rl.max_staleness"),
])
def test_unsupported_overlap_configs_fail_in_one_line(overrides, names):
    """Each unsupported combination is one ConfigError line naming the setting to change.
    Catches: an overlapped mode without its own sampler devices, or with a host-steered or
    dynamic-sampling batch, starting anyway (and failing later, or hanging)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_row_version_is_the_oldest_token_version():
    """A row's version is its oldest token's (-1: no token); a row without tokens takes the fallback.
    Catches: max instead of min (a partially refreshed row would pass the staleness bound), and
    -1 padding counted as a version."""
    version_bc = np.array([[3, 3, 4, -1], [-1, -1, -1, -1], [5, 5, 5, 5]], np.int32)
    np.testing.assert_array_equal(row_versions(version_bc, fallback=9), [3, 9, 5])


# ----------------------------------------------------------------------------- one_step_off


def _one_step_off_run(programs, params, trainer, iterations: int):
    driver = overlap.OneStepOff(programs, prompt_source(), LOOP_KEY)
    state = _state(params, trainer)
    history = []
    for it in range(iterations):
        state, metrics, _ = driver.step(state, it)
        history.append(jax.device_get(metrics))
    return state, history


def test_one_step_off_equals_its_sequential_definition(programs, params, layouts):
    """Three one_step_off steps on two devices equal a hand-written sequential run on one device:
    batch 0 and batch 1 sampled with theta_0, batch k+1 with theta_k, update k trains batch k from
    theta_k, keys fold_in(loop key, j) split sample/update (params within 1e-5); a second run is
    bitwise equal, and the reported staleness is 0 then 1.
    Catches: sampling batch k+1 with theta_{k+1} (a synchronous run in disguise), reusing one
    batch twice, keys shifted by one, and nondeterminism from the overlap."""
    ref = make_stages(CONTROLS, reward_callback, _state(params), num_prompts=P)
    state = _state(params)
    key = lambda j: jax.random.fold_in(LOOP_KEY, j)  # noqa: E731
    pending = ref.sample_jit(state.sampler_params(), *prompts_at(0), key(0))
    for k in range(3):
        following = ref.sample_jit(state.sampler_params(), *prompts_at(k + 1), key(k + 1))  # theta_k
        state, _ = ref.update_jit(state, pending[0], key(k))  # theta_k -> theta_{k+1} on batch k
        pending = following

    got, history = _one_step_off_run(programs, params, layouts[0], 3)
    again, _ = _one_step_off_run(programs, params, layouts[0], 3)
    for a, b, c in zip(jax.tree.leaves(state.params), jax.tree.leaves(got.params), jax.tree.leaves(again.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
    assert max(np.abs(np.asarray(a) - np.asarray(p)).max()
               for a, p in zip(jax.tree.leaves(state.params), jax.tree.leaves(params))) > 1e-4  # it trained
    assert [h["async/staleness_max"] for h in history] == [0.0, 1.0, 1.0]
    assert all(h["time/weight_sync_s"] > 0 for h in history)


# ----------------------------------------------------------------------------- async


def _slow(update, seconds: float, fail: BaseException | None = None, after: int = 0):
    calls = itertools.count()

    def wrapped(state, batch, key):
        n = next(calls)
        if fail is not None and n >= after:
            raise fail
        time.sleep(seconds)
        return update(state, batch, key)
    return wrapped


def _async_steps(programs, params, trainer, steps: int, **kw):
    """Runs `steps` async steps as the loop does (close in a finally); returns the driver and metrics."""
    update = kw.pop("update", None)
    progs = dataclasses.replace(programs, update=update) if update is not None else programs
    driver = overlap.AsyncDriver(progs, prompt_source(), LOOP_KEY, rows=ROWS, **kw)
    return driver, drive(driver, _state(params, trainer), steps)


def drive(driver, state, steps: int) -> list[dict]:
    """`steps` driver steps as the loop runs them (the driver closed in a finally); their metrics."""
    history = []
    try:
        for it in range(steps):
            state, metrics, _ = driver.step(state, it)
            history.append(jax.device_get(metrics))
    finally:
        driver.close()
    return history


def test_async_staleness_is_bounded_and_stale_rows_are_dropped_and_counted(programs, params, layouts):
    """async (rl.stale_rows="drop") with eta=1, a fast sampler, a queue of 3 and a trainer slowed
    to 0.3 s per update: every trained row is at most 1 version old, some rows are dropped, and
    the reported `async/dropped_rows` equal the rows whose staleness exceeded eta.
    Catches: a trainer that trains stale rows (no filter, or a filter off by one), drops that are
    not counted (or counted twice), and a producer that never refreshes its params."""
    before = _python_threads()
    driver, history = _async_steps(programs, params, layouts[0], 5, max_staleness=1, queue_batches=3,
                                   wait_for_fresh=False, update=_slow(programs.update, 0.3))
    taken = list(driver.taken)
    for t in taken:
        assert (t.staleness_b[t.keep_b] <= 1).all() and (t.keep_b == (t.staleness_b <= 1)).all()
    stale = sum(int((t.staleness_b > 1).sum()) for t in taken)
    assert stale > 0
    assert sum(h["async/dropped_rows"] for h in history) == stale
    assert max(h["async/staleness_max"] for h in history) <= 1
    assert max(t.index for t in taken) >= 5  # batches sampled after an update were trained
    _threads_back(before)


def test_async_admission_keeps_every_batch_fresh(programs, params, layouts):
    """async with rl.stale_rows="wait" (AReaL's admission rule), eta=1, the same slow trainer and
    a queue of 3: nothing is dropped, yet the sampler runs the full eta ahead (staleness 1 from the
    second step on), and batch s is the one iteration s trains.
    Catches: a wait that lets the sampler run too far ahead (drops), or one that waits for the
    newest version (staleness 0: a synchronous run with extra steps)."""
    before = _python_threads()
    driver, history = _async_steps(programs, params, layouts[0], 5, max_staleness=1, queue_batches=3,
                                   update=_slow(programs.update, 0.3))
    assert sum(h["async/dropped_rows"] for h in history) == 0
    assert [h["async/staleness_max"] for h in history] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [t.index for t in driver.taken] == [0, 1, 2, 3, 4]
    _threads_back(before)


class _OneOldBatch(overlap.AsyncDriver):
    """Labels the third and fourth batches' rows 5 versions older than sampled, as interrupted
    rollouts whose first tokens came from old params would be."""

    def row_versions(self, sample, version):
        self._calls = getattr(self, "_calls", 0) + 1
        return super().row_versions(sample, version - 5 * (self._calls in (3, 4)))


def test_async_admission_survives_a_skipped_batch(programs, params, layouts):
    """With rl.stale_rows="wait" and eta=1, two batches that are stale anyway (rows older than eta)
    are skipped and counted, and the run goes on: the admission bound falls by one per skipped batch.
    Catches: an admission bound that counts skipped batches as trained, so that after more than
    eta skips the sampler waits for a version the trainer can only reach with the batch the
    sampler will not start (a deadlock; a watchdog stops it after 30 s)."""
    driver = _OneOldBatch(programs, prompt_source(), LOOP_KEY, rows=ROWS, max_staleness=1, queue_batches=1)
    watchdog = threading.Timer(30, driver.close)
    watchdog.start()
    state, history = _state(params, layouts[0]), []
    try:
        for it in range(4):
            state, metrics, _ = driver.step(state, it)
            history.append(jax.device_get(metrics))
    finally:
        watchdog.cancel()
        driver.close()
    assert [h["async/skipped_batches"] for h in history] == [0, 0, 2, 0]
    assert sum(h["async/dropped_rows"] for h in history) == 2 * ROWS
    assert [t.index for t in driver.taken] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("failure", ["verifier", "trainer", "ctrl-c"])
def test_async_failures_stop_both_sides(programs, params, layouts, failure):
    """A verifier that raises inside the sampling program, a trainer exception, or Ctrl-C
    (KeyboardInterrupt in the trainer) reaches the caller, and the producer thread is gone
    within 5 s.
    Catches: a producer error swallowed while the trainer waits forever on an empty queue, and a
    producer left running (or blocked on a full queue) after the trainer has gone."""
    before = _python_threads()
    kw = dict(max_staleness=1, queue_batches=2)
    if failure == "verifier":
        trainer, sampler = layouts
        stages = make_stages(CONTROLS, crashing_callback, _state(params, trainer), num_prompts=P,
                             trainer=trainer, sampler=sampler)
        progs, expected = overlap.OverlapPrograms.from_stages(stages), Exception
        match = "verifier exploded"
    else:
        progs = programs
        error = ValueError("trainer exploded") if failure == "trainer" else KeyboardInterrupt()
        kw["update"] = _slow(programs.update, 0.0, fail=error, after=1)
        expected, match = type(error), ("trainer exploded" if failure == "trainer" else None)
    with pytest.raises(expected, match=match):
        _async_steps(progs, params, layouts[0], 3, **kw)
    assert _threads_back(before) < 5


# ----------------------------------------------------------------------------- the loop and checkpoints

RUN = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
       "model.num_kv_heads=1", "model.head_dim=16", "data.size=200", "data.eval_size=8", "eval.size=8",
       "warm_start.steps=0", "rl.prompts_per_iteration=4", "sampling.num_samples=2", "sampling.max_new_tokens=4",
       "optim.learning_rate=1e-2", "optim.warmup_steps=0", "metrics.tensorboard=false",
       "metrics.progress_bar=false", "eval.every=100", "mesh.devices=2", "mesh.sampler_devices=1",
       "metrics.samples_every=0"]


def test_one_step_off_resumes_exactly(tmp_path):
    """`rljax train` with rl.mode=one_step_off: 4 iterations equal a resume from the same run's
    checkpoint at iteration 2 (its later checkpoint deleted) run to 4 (params bitwise, metrics
    equal), because the checkpoint holds the pending batch 3 sampled with theta_2.
    Catches: a resume that re-samples batch 3 with theta_3 (or skips it), and a data iterator
    saved one batch behind the driver."""
    args = RUN + ["rl.mode=one_step_off", "rl.iterations=4", "checkpoint.every=2"]
    full = train(load_config(None, args + [f"output_dir='{tmp_path / 'full'}'"]), log=lambda *_: None)
    shutil.copytree(tmp_path / "full", tmp_path / "half")
    shutil.rmtree(tmp_path / "half" / "checkpoints" / "4")
    resumed = train(load_config(None, args + [f"output_dir='{tmp_path / 'half'}'"]), resume=True,
                    log=lambda *_: None)
    for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    untimed = lambda h: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in h]  # noqa: E731
    assert untimed(full.history)[3:] == untimed(resumed.history)[3:]


def test_async_resume_restarts_an_empty_queue(tmp_path, monkeypatch):
    """`rljax train` with rl.mode=async resumes from its checkpoint with an empty queue and says so
    (`async/restarted_queue` 1 on the first resumed step only). The resumed half runs with
    `rl.partial_rollouts=true`: its producer must sample through the interruptible sampler.
    Catches: a resume that crashes on the driver's checkpoint entry (a restore template that does
    not match what was saved), or does not report the dropped in-flight batches; a loop that
    builds the async driver without `rl.segment_steps` (partial rollouts silently off)."""
    args = RUN + ["rl.mode=async", "rl.max_staleness=2", "checkpoint.every=2", f"output_dir='{tmp_path}'"]
    first = train(load_config(None, args + ["rl.iterations=2"]), log=lambda *_: None)
    segments = []
    from_stages = overlap.OverlapPrograms.from_stages

    def counting(stages):
        programs = from_stages(stages)
        partial = programs.sample_partial

        def sample_partial(*args):
            segments.append(args[-1])  # segment_steps
            return partial(*args)
        return dataclasses.replace(programs, sample_partial=sample_partial)

    monkeypatch.setattr(overlap.OverlapPrograms, "from_stages", staticmethod(counting))
    resumed = train(load_config(None, args + ["rl.iterations=4", "rl.partial_rollouts=true", "rl.segment_steps=3"]),
                    resume=True, log=lambda *_: None)
    assert segments and set(segments) == {3}
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "async/restarted_queue" in r]
    assert [r["async/restarted_queue"] for r in rl] == [0, 0, 1, 0]
    assert len(first.history) == 3 and len(resumed.history) == 5


def _overlapped(mode: str, params, layouts, *, algo=ALGO, **state_kw):
    """(driver, state): a fresh trainer state (`init_train_state` keywords) placed in the trainer
    layout, and the one_step_off or async driver over its stages."""
    trainer, sampler = layouts
    state = init_train_state(CFG, jax.tree.map(jnp.copy, params), algo, OPTIM, layout=trainer, **state_kw)
    state = jax.device_put(state, trainer.tree(state))
    progs = overlap.OverlapPrograms.from_stages(make_stages(CONTROLS, reward_callback, state, num_prompts=P,
                                                            trainer=trainer, sampler=sampler))
    if mode == "one_step_off":
        return overlap.OneStepOff(progs, prompt_source(), LOOP_KEY), state
    return overlap.AsyncDriver(progs, prompt_source(), LOOP_KEY, rows=ROWS, max_staleness=1, queue_batches=2), state


@pytest.mark.parametrize("mode, off_policy", [("one_step_off", "tis"), ("async", "decoupled")])
def test_off_policy_corrections_work_in_the_overlapped_modes(layouts, params, mode, off_policy):
    """TIS (one_step_off) and AReaL's decoupled weight (async) run in the overlapped modes, fed the
    sampler's recorded log-probs: from the second step on the trained batch was sampled one
    version back, so the trainer's proximal log-probs differ from the behaviour ones and the mean
    importance weight moves off 1. (MIS shares TIS's log-weights, `_log_weights`; one case each
    keeps the compile count down.)
    Catches: an overlapped mode whose batch reaches the update with the trainer's own log-probs
    in place of the sampler's (every weight exactly 1), or a correction that breaks in it (NaN)."""
    algo = AlgorithmConfig(recompute_old_logp=True, off_policy=off_policy)
    driver, state = _overlapped(mode, params, layouts, algo=algo)
    history = drive(driver, state, 3)
    later = history[1:]
    assert all(np.isfinite(m["loss/policy"]) for m in history)
    assert all(m["async/staleness_mean"] >= 1 for m in later)
    weights = np.array([float(m["train/is_weight_mean"]) for m in later])
    assert np.all(np.abs(weights - 1.0) > 1e-6), weights


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_overlapped_modes_run_the_packed_update(layouts, params, mode):
    """`update.packing` reaches the trainer of both overlapped modes: one_step_off with packed
    updates gives the padded run's metrics (within 1e-5) and parameters, from the same keys; async
    (whose batches depend on thread timing) trains packed micro-batches with finite metrics.
    Both report the padding fraction (these rows are all full length: nothing to remove).
    Catches an overlapped driver built from a packing-unaware update program."""
    from rljax.update import UpdateConfig
    runs = []
    for upd in (UpdateConfig(packing=True, max_tokens_per_microbatch=2 * (T + CONTROLS.max_new_tokens)),
                UpdateConfig())[:2 if mode == "one_step_off" else 1]:
        runs.append(drive(*_overlapped(mode, params, layouts, update_cfg=upd), 2))
    packed = runs[0]
    assert all(np.isfinite(m["loss/policy"]) and m["update/pad_fraction"] <= m["update/pad_fraction_padded"]
               for m in packed)
    if mode == "one_step_off":
        for got, want in zip(packed, runs[1]):
            for k, v in want.items():
                if not k.startswith("time/"):
                    np.testing.assert_allclose(float(got[k]), float(v), atol=1e-5, rtol=1e-5, err_msg=k)
