"""Partial (interruptible) rollouts inside `rl.mode = "async"` (issue 20): a weight update that
arrives mid-generation is taken up by the rows still decoding, each token's behaviour log-prob is
the score of the version that drew it, a row's staleness counts from its oldest token, and the
settings that cannot work fail in one line.

The driver runs on two of the 8 simulated CPU devices (tests/conftest.py): trainer on device 0,
sampler on device 1. One async run (module fixture) serves the first tests."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.sharding.placement import build_layouts
from rljax.errors import ConfigError
from rljax.models import init_params, token_logprobs
from rljax.drivers import overlap
from rljax.sharding.mesh import MeshConfig
from rljax.train.config import load_config
from rljax.stages.iteration import make_stages
from rljax.drivers.queue import row_versions
from rljax.update import init_train_state
from test_overlap import (ALGO, CFG, CONTROLS, LOOP_KEY, OPTIM, ROWS, P, T, drive, prompts_at,
                          reward_callback)

# the model, controls, reward and prompt stream of tests/drivers/test_overlap.py
STEPS = 3


class _SwapMidRow(overlap.AsyncDriver):
    """Batch j >= 1 waits, before its second one-step segment (tokens 0 and 1 drawn), until the
    trainer has published version j. Batch j starts with version j - 1 (the admission rule with
    eta = 1 lets it start as soon as batch j - 1 is queued, long before that batch's update ends),
    so its unfinished rows draw their first tokens with one version and the rest with a newer one."""

    def poll_weights(self, j, poll):
        if j >= 1 and poll == 2:
            return self.wait_for_version(j)
        return super().poll_weights(j, poll)


@dataclasses.dataclass
class _Run:
    driver: overlap.AsyncDriver
    history: list  # metrics per step
    batches: list  # the RolloutBatch each update trained, in order
    published: list  # the sampler params of version v at index v


@pytest.fixture(scope="module")
def programs():
    trainer, sampler = build_layouts(MeshConfig(devices=2, sampler_devices=1))
    params = init_params(CFG, jax.random.key(0))

    def fresh_state():  # every leaf placed, as `rljax train` builds it; a new one per run (updates donate it)
        state = init_train_state(CFG, jax.tree.map(jnp.copy, params), ALGO, OPTIM, layout=trainer)
        return jax.device_put(state, trainer.tree(state))

    progs = overlap.OverlapPrograms.from_stages(make_stages(CONTROLS, reward_callback, fresh_state(), num_prompts=P,
                                                            trainer=trainer, sampler=sampler))
    return progs, fresh_state


@pytest.fixture(scope="module")
def run(programs) -> _Run:
    """Three async steps with partial rollouts (one-step segments, eta = 1, rl.stale_rows="wait")
    and a swap forced into batches 1 and 2."""
    progs, fresh_state = programs
    state, batches, published = fresh_state(), [], []

    def update(state, batch, key):
        batches.append(batch)
        return progs.update(state, batch, key)

    def to_sampler(state):
        params, seconds = progs.to_sampler(state)
        published.append(jax.device_get(params))
        return params, seconds

    recording = dataclasses.replace(progs, update=update, to_sampler=to_sampler)
    counter = itertools.count()
    driver = _SwapMidRow(recording, lambda: prompts_at(next(counter)), LOOP_KEY, rows=ROWS, max_staleness=1,
                         queue_batches=1, segment_steps=1)
    history = drive(driver, state, STEPS)
    return _Run(driver, history, [jax.device_get(b) for b in batches], published)


_score = jax.jit(lambda params, tokens_bt, mask_bt: token_logprobs(CFG, params, tokens_bt, mask_bt)[0])


def test_swapped_rows_carry_each_tokens_drawing_policy_logprob(run):
    """Batches 1 and 2 were swapped mid-generation: their rows' tokens come from two versions
    (`async/swaps` 0, 1, 1; `async/mixed_version_rows` > 0 and equal to the rows whose recorded
    versions differ), and every completion token's behaviour log-prob (`sampler_logp_bt`, what the
    loss reads) equals `token_logprobs` of the final sequence under the params of the version
    recorded for that token (1e-5), while the two versions' scores differ there (> 1e-4).
    Catches: a swap that is never taken up (one version per row), versions recorded on the wrong
    tokens, a cache left from the old params (new tokens scored by the old policy), and a batch
    whose log-probs were recomputed under one version instead of kept per token."""
    assert [h["async/swaps"] for h in run.history] == [0.0, 1.0, 1.0]
    taken = list(run.driver.taken)
    assert [t.index for t in taken] == [0, 1, 2]
    for t, batch, h in zip(taken, run.batches, run.history):
        version_bc = t.version_bc
        drawn = version_bc >= 0
        mixed = (np.where(drawn, version_bc, -1).max(1) != np.where(drawn, version_bc, 1 << 30).min(1))
        assert h["async/mixed_version_rows"] == mixed.sum()
        logp = np.asarray(batch.sampler_logp_bt)[:, T:]
        np.testing.assert_array_equal(drawn, np.asarray(batch.attn_mask_bt)[:, T:])
        versions = sorted(set(version_bc[drawn].tolist()))
        assert versions == ([0] if t.index == 0 else [t.index - 1, t.index])
        scores = {v: np.asarray(_score(run.published[v], batch.tokens_bt, batch.attn_mask_bt))[:, T:]
                  for v in versions}
        for v in versions:
            at = version_bc == v
            np.testing.assert_allclose(logp[at], scores[v][at], atol=1e-5, rtol=0)
        if t.index:
            assert mixed.sum() > 0
            newer = version_bc == t.index
            assert np.abs(scores[t.index - 1] - scores[t.index])[newer].max() > 1e-4  # the versions tell apart


def test_staleness_counts_from_the_oldest_token(run):
    """A mixed row's staleness is the trainer's version minus its OLDEST token's version: batches
    1 and 2 (tokens from versions j - 1 and j, trained at iteration j) report staleness 1, not 0,
    row by row and in `async/staleness_max`.
    Catches: a row version taken from the newest token (or from the version the batch ended with),
    which would let tokens older than eta into the loss unseen."""
    for t in run.driver.taken:
        np.testing.assert_array_equal(t.staleness_b, t.trainer_version - row_versions(t.version_bc, -1))
    assert [h["async/staleness_max"] for h in run.history] == [0.0, 1.0, 1.0]


def test_without_a_swap_it_is_the_whole_batch_program(run, programs):
    """Batch 0 (never swapped) equals the whole-batch sampling program's batch for the same key and
    params, bitwise: tokens, masks, behaviour log-probs and rewards.
    Catches: a partial rollout drawn with another key split than the sampling program's, and a
    scoring half (`rollout_from_samples`) that builds the batch differently from `rollout`."""
    progs, _ = programs
    key = progs.keys(LOOP_KEY).sample(0)
    params = jax.device_put(run.published[0], progs.sampler_params_shardings)
    whole = jax.device_get(progs.sample(params, *prompts_at(0), key)[0])
    for name in ("tokens_bt", "attn_mask_bt", "loss_mask_bt", "sampler_logp_bt", "rewards_b"):
        np.testing.assert_array_equal(np.asarray(getattr(run.batches[0], name)), np.asarray(getattr(whole, name)),
                                      name)


class _StuckMidRow(overlap.AsyncDriver):
    """Batch j >= 1 waits mid-generation for a version the trainer never publishes (`waiting` is
    set as it starts to wait)."""

    waiting = threading.Event()

    def poll_weights(self, j, poll):
        if j >= 1:
            self.waiting.set()
            return self.wait_for_version(99)
        return super().poll_weights(j, poll)


def test_a_trainer_failure_stops_a_producer_waiting_mid_rollout(programs, run):
    """The first update raises while the producer is inside batch 1's partial rollout, waiting
    for new params between segments: the error reaches the caller and the producer thread is gone
    within 5 s of it.
    Catches: a mid-rollout wait for weights that ignores the stop request (the producer would
    hang, holding the sampler's devices, until its join times out)."""
    del run  # its segments are compiled: the 5 s measure the stop, not a compile
    progs, fresh_state = programs
    state = fresh_state()

    def failing_update(state, batch, key):
        assert _StuckMidRow.waiting.wait(10)  # fail once the producer is inside batch 1, waiting
        raise ValueError("trainer exploded")

    before = {t for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    counter = itertools.count()
    driver = _StuckMidRow(dataclasses.replace(progs, update=failing_update), lambda: prompts_at(next(counter)),
                          LOOP_KEY, rows=ROWS, max_staleness=1, queue_batches=1, segment_steps=1)
    with pytest.raises(ValueError, match="trainer exploded"):
        try:
            driver.step(state, 0)
        finally:
            failed = time.perf_counter()
            driver.close()
    assert time.perf_counter() - failed < 5
    assert {t for t in threading.enumerate() if not isinstance(t, threading._DummyThread)} <= before


ASYNC = ["mesh.devices=2", "mesh.sampler_devices=1"]


@pytest.mark.parametrize("overrides, names", [
    (ASYNC + ["rl.mode=one_step_off", "rl.partial_rollouts=true"], "rl.partial_rollouts"),
    (["rl.partial_rollouts=true"], "rl.mode=async"),
    (ASYNC + ["rl.mode=async", "rl.partial_rollouts=true", "sampling.scheduler='continuous'"], "sampling.scheduler"),
    (["rl.segment_steps=0"], "rl.segment_steps"),
])
def test_partial_rollout_configs_fail_in_one_line(overrides, names):
    """Partial rollouts outside rl.mode=async, with the continuous scheduler, or with segments of
    no decode step are one ConfigError line naming the setting to change.
    Catches: partial rollouts silently ignored in sync/one_step_off, a continuous-scheduler run
    reaching `sample_with_updates` (static only) after the warm start, and a zero-step segment
    that would poll forever."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert names in str(e.value) and "\n" not in str(e.value)
