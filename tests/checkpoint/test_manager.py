"""Checkpoints: bitwise round-trip, retention (last N + best), mismatch errors, interrupted saves, export."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.checkpoint import Checkpointer, export_hf, load_params
from rljax.errors import CheckpointError
from rljax.models import init_params, load_hf, preset


@pytest.fixture(scope="module")
def model():
    cfg = preset("qwen2-test")
    opt = optax.adamw(1e-3, weight_decay=0.1)

    @jax.jit  # one compile instead of many eager dispatches
    def make():
        params = init_params(cfg, jax.random.key(0))
        opt_state = opt.init(params)
        grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
        updates, opt_state = opt.update(grads, opt_state, params)  # non-trivial mu/nu/count
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = make()
    return cfg, params, opt_state


def _bits_equal(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def test_round_trip_is_bitwise(tmp_path, model):
    """restore returns exactly what save wrote: params, adamw state (same NamedTuple tree), step,
    typed PRNG key, data-iterator state, config and model config."""
    cfg, params, opt_state = model
    key = jax.random.fold_in(jax.random.key(7), 3)
    data_state = {"next_index": 12}
    config = {"lr": 1e-4, "model": "qwen2-test", "groups": [1, 2]}
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(5, params=params, opt_state=opt_state, rng=key, data_state=data_state, config=config,
                  model_config=cfg)
        ckpt.wait()
        abstract_opt = jax.eval_shape(lambda: opt_state)
        r = ckpt.restore(params=params, opt_state=abstract_opt, model_config=cfg)
    assert r.step == 5 and r.data_state == data_state and r.config == config and r.model_config == cfg
    _bits_equal(r.params, params)
    _bits_equal(r.opt_state, opt_state)
    assert type(r.opt_state[0]) is type(opt_state[0])
    assert jax.dtypes.issubdtype(r.rng.dtype, jax.dtypes.prng_key)
    assert str(jax.random.key_impl(r.rng)) == str(jax.random.key_impl(key))
    np.testing.assert_array_equal(jax.random.key_data(r.rng), jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.uniform(r.rng, (3,)), jax.random.uniform(key, (3,)))


def test_keeps_last_n_plus_best(tmp_path, model):
    """With keep_last=2 and best_metric, the directory ends with the two newest steps plus the best
    one, and the best survives reopening the directory (metrics are persisted)."""
    cfg, params, _ = model
    accs = {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.3, 5: 0.1}
    with Checkpointer(tmp_path / "ck", keep_last=2, best_metric="acc") as ckpt:
        for step, acc in accs.items():
            ckpt.save(step, params=params, metrics={"acc": acc})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 4, 5] and ckpt.best_step() == 2
    with Checkpointer(tmp_path / "ck", keep_last=2, best_metric="acc") as ckpt:
        ckpt.save(6, params=params, metrics={"acc": 0.5})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 5, 6] and ckpt.best_step() == 2
        assert ckpt.restore("best", params=params).metrics == {"acc": 0.9}


@pytest.mark.parametrize("mode,best", [("max", 2), ("min", 3)])
def test_a_reader_not_told_the_metric_ranks_by_the_runs_own(tmp_path, model, mode, best):
    """A read-only Checkpointer opened without `best_metric` (what `rljax eval` and `export` open)
    takes "best" to mean the writer's metric and mode, read from the steps' meta, and reports the
    value; `open_run` on the run directory picks and describes the same step. A run that tracked
    no metric falls back to its latest step and says so.

    Catches: orbax's fallback (no best_fn: "best" is the latest step, 4 here), ignoring the
    writer's mode (min-ranked loss picked as max), and a pick printed without its value."""
    from rljax.checkpoint import open_run

    _, params, _ = model
    run = tmp_path / "run"
    with Checkpointer(run / "checkpoints", keep_last=4, best_metric="loss_or_acc", best_mode=mode) as ckpt:
        for step, value in {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.6}.items():
            ckpt.save(step, params=params, metrics={"loss_or_acc": value}, config={"step": step})
    with Checkpointer(run / "checkpoints", read_only=True) as reader:
        assert reader.latest_step() == 4 and reader.tracked_metric() == ("loss_or_acc", mode)
        assert reader.best_step() == best and reader.restore("best", params=None).step == best
        assert reader.metric(best) == {2: 0.9, 3: 0.1}[best]
    picked = open_run(run, "best")
    assert (picked.step, picked.config) == (best, {"step": best})
    assert picked.describe() == f"step {best} (best loss_or_acc = {picked.value:.4f})"

    untracked = tmp_path / "untracked"
    with Checkpointer(untracked / "checkpoints", keep_last=4) as ckpt:
        for step in (1, 2):
            ckpt.save(step, params=params)
    picked = open_run(untracked, "best")
    assert picked.step == 2 and picked.describe() == "step 2 (latest; the run tracked no metric to rank by)"


def test_mismatched_model_is_one_line_error(tmp_path, model):
    """Restoring into another model, shape or config names the mismatch in one line."""
    cfg, params, opt_state = model
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(1, params=params, opt_state=opt_state, model_config=cfg)
        ckpt.wait()
        bigger = dataclasses.replace(cfg, hidden_size=cfg.hidden_size * 2)
        other_params = jax.eval_shape(lambda: init_params(bigger, jax.random.key(0)))
        with pytest.raises(CheckpointError) as err:
            ckpt.restore(params=other_params)
        msg = str(err.value)
        assert "\n" not in msg and "does not fit" in msg and "[" in msg
        with pytest.raises(CheckpointError, match="hidden_size") as err:
            ckpt.restore(params=params, model_config=bigger)
        assert "\n" not in str(err.value)
        fewer = {k: v for k, v in params.items() if k != "final_norm"}
        with pytest.raises(CheckpointError, match="final_norm"):
            ckpt.restore(params=fewer)
        with pytest.raises(CheckpointError, match="available"):
            ckpt.restore(3, params=params)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        Checkpointer(tmp_path / "empty").restore(params=params)


_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, time
    import jax.numpy as jnp
    from rljax.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1])
    ckpt.save(1, params={"w": jnp.ones(4)}, data_state={"next_index": 1})
    ckpt.wait()
    ckpt.save(2, params={"w": jnp.ones((2048, 2048))}, data_state={"next_index": 2})
    # Killed while step 2 is still being written: once its tmp dir exists (under load the async
    # writer may not have started yet when save() returns).
    deadline = time.time() + 60
    while not any("tmp" in n for n in os.listdir(sys.argv[1])) and time.time() < deadline:
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_killed_save_is_not_latest(tmp_path):
    """A process SIGKILLed during an asynchronous save leaves only a tmp dir; the next Checkpointer
    ignores it (latest is the last committed step), removes it, and saves step 2 again."""
    d = str(tmp_path / "ck")
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, d], capture_output=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == -signal.SIGKILL
    assert any("tmp" in name for name in os.listdir(d)), os.listdir(d)
    with Checkpointer(d) as ckpt:
        assert ckpt.latest_step() == 1
        r = ckpt.restore(params={"w": jnp.zeros(4)})
        assert r.step == 1 and r.data_state == {"next_index": 1}
        ckpt.save(2, params={"w": jnp.ones(4)})  # orbax removes leftover tmp dirs before saving
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
        assert not any("tmp" in name for name in os.listdir(d)), os.listdir(d)


def test_load_params_and_export(tmp_path, model):
    """load_params(dir) rebuilds the ModelConfig and params from the checkpoint alone, and
    export_hf writes a HF directory that load_hf reads back bitwise."""
    cfg, params, opt_state = model
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(3, params=params, opt_state=opt_state, model_config=cfg)
    cfg2, params2 = load_params(tmp_path / "ck")
    assert cfg2 == cfg
    _bits_equal(params2, params)
    export_hf(tmp_path / "ck", tmp_path / "hf")
    cfg3, params3 = load_hf(tmp_path / "hf")
    _bits_equal(params3, params)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_params(tmp_path / "nope")


def test_restore_lands_on_template_sharding(tmp_path):
    """Arrays saved sharded over 8 devices restore bitwise onto the (different) sharding the
    template asks for."""
    mesh = jax.make_mesh((8,), ("x",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    cols = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
    w = jax.device_put(np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 7, rows)
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(1, params={"w": w})
        ckpt.wait()
        r = ckpt.restore(params={"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=cols)})
    assert r.params["w"].sharding == cols
    assert np.asarray(r.params["w"]).tobytes() == np.asarray(w).tobytes()
