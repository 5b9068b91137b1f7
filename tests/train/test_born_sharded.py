"""State born sharded: params, reference, value model and optimiser state are created in the trainer
layout (8 simulated devices), never whole on one device, with the values of the unsharded path."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hf_factory import make_checkpoint
from rljax import sharding
from rljax.models import ModelConfig, init_params, load_hf, save_hf
from rljax.models import hf_io
from rljax.objectives.config import AlgorithmConfig
from rljax.optim import OptimConfig
from rljax.checkpoint.train_state import restore_run
from rljax.drivers import DRIVERS
from rljax.train import loop
from rljax.train import run as run_mod
from rljax.train import start as start_mod
from rljax.train.config import load_config
from rljax.update import init_train_state
from test_loop import TINY

# V x D embedding is 2 MiB of the model's 2.3 MiB: a whole copy of it anywhere is visible.
_CFG = ModelConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, qkv_bias=True)
# PPO with a KL term: the state has a value model and a reference as well as Adam moments.
_PPO = AlgorithmConfig(algorithm="ppo", lam=0.95, kl_coef=0.1)


@pytest.fixture(scope="module")
def layout():
    """data=2 (replicas, so shards repeat) x fsdp=2 x tensor=2 over the 8 devices."""
    assert jax.device_count() == 8  # tests/conftest.py simulates 8 CPU devices
    return sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2)))


def _param_shardings(layout, cfg):
    return layout.params(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))


def _assert_born(tree, want_shardings):
    """Every leaf has the wanted sharding and every device holds exactly its shard, nothing more."""
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(want_shardings),
                            strict=True):
        where = jax.tree_util.keystr(path)
        assert x.sharding.is_equivalent_to(s, x.ndim), where
        assert len(x.addressable_shards) == 8, where
        for shard in x.addressable_shards:
            assert shard.data.shape == s.shard_shape(x.shape), where
            assert shard.data.nbytes == np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize, where


def _assert_equal(a_tree, b_tree):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(a_tree), jax.tree.leaves(b_tree), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


class _Transfers:
    """Records every array handed to jax.device_put / jnp.asarray and every host buffer a
    make_array_from_callback callback returns, with the shard shape it was asked for."""

    def __init__(self, monkeypatch):
        self.puts: list[tuple[str, tuple]] = []
        self.callbacks: list[tuple[tuple, tuple]] = []
        device_put, asarray, from_callback = jax.device_put, jnp.asarray, jax.make_array_from_callback

        def put(x, *args, **kw):
            self.puts += [("device_put", np.shape(leaf)) for leaf in jax.tree.leaves(x)]
            return device_put(x, *args, **kw)

        def as_array(x, *args, **kw):
            self.puts.append(("asarray", np.shape(x)))
            return asarray(x, *args, **kw)

        def make(shape, sharding_, callback, *args, **kw):
            def recorded(index):
                out = callback(index)
                self.callbacks.append((np.shape(out), sharding_.shard_shape(shape)))
                return out
            return from_callback(shape, sharding_, recorded, *args, **kw)

        monkeypatch.setattr(jax, "device_put", put)
        monkeypatch.setattr(jnp, "asarray", as_array)
        monkeypatch.setattr(jax, "make_array_from_callback", make)


# ----------------------------------------------------------------------------- init_params


def test_init_params_born_sharded_equals_unsharded_init_and_holds_only_shards():
    """init_params(shardings=...) on an fsdp=4 x tensor=2 mesh: every device holds exactly its
    shard, values are bitwise the unsharded init's, the compiled program's per-device output is the
    device's shard total, and output + temporaries stay well under one whole embedding (measured:
    1.1 of its 2 MiB; the unsharded program uses 9.1 MiB). Catches: the shardings ignored (leaves
    whole on one device), an init whose values depend on the layout (e.g. per-shard keys), drawing
    whole tensors and slicing them (with `jax_threefry_partitionable` off the temporaries alone reach
    2.2 MiB), or an unsharded init resharded afterwards (output 2.4 MiB per device)."""
    layout = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(fsdp=4, tensor=2)))
    shardings = _param_shardings(layout, _CFG)
    key = jax.random.key(3)
    # std traced, as in a direct call (a constant std is folded into the draw, changing the last bit)
    program = jax.jit(lambda k, std: init_params(_CFG, k, std, shardings=shardings)).lower(key, 0.02).compile()
    params = program(key, 0.02)
    _assert_born(params, shardings)
    _assert_equal(params, init_params(_CFG, key))

    stats = program.memory_analysis()
    shard_bytes = sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                      for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True))
    assert abs(stats.output_size_in_bytes - shard_bytes) <= 0.01 * shard_bytes
    assert stats.output_size_in_bytes + stats.temp_size_in_bytes < 0.6 * params["embed"].nbytes


# ----------------------------------------------------------------------------- load_hf


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny untied Llama from transformers, re-exported split over several safetensors files."""
    path = tmp_path_factory.mktemp("hf")
    make_checkpoint("llama", path / "one")
    cfg, params = load_hf(path / "one")
    save_hf(cfg, params, path / "split", max_shard_bytes=20_000)
    assert (path / "split" / "model.safetensors.index.json").exists()
    return path


@pytest.mark.parametrize("name", ["one", "split"])
def test_load_hf_streams_each_tensor_into_its_shards(layout, hf_dir, monkeypatch, name):
    """load_hf(shardings=...) equals the unsharded load bitwise, every device holds exactly its
    shard, and nothing crosses to a device but shard-sized host buffers. Catches: the old path
    (whole host arrays, `jnp.asarray`, then `jax.device_put` into the layout: recorded puts), a
    callback that returns the whole tensor or the wrong slice (its shape or the values differ), a
    stacked leaf filled with the wrong layer, and a tensor looked up in the wrong file of a split
    checkpoint."""
    cfg, want = load_hf(hf_dir / name)
    shardings = _param_shardings(layout, cfg)
    transfers = _Transfers(monkeypatch)
    cfg2, params = load_hf(hf_dir / name, shardings=shardings)
    assert cfg2 == cfg
    assert transfers.puts == []
    assert len(transfers.callbacks) >= len(jax.tree.leaves(params))
    assert all(got == want_shape for got, want_shape in transfers.callbacks)
    _assert_born(params, shardings)
    _assert_equal(params, want)


def test_load_hf_allocates_host_buffers_leaf_by_leaf(layout, hf_dir, monkeypatch):
    """Host buffers are allocated leaf by leaf, right before the leaf is placed, one per distinct
    shard (replicas over `data` share one): the host never holds more than one leaf's shards plus
    the tensor being read. Catches: the old preallocated host copy of every leaf (all allocations
    before the first leaf is placed, in whole shapes), or one buffer per device where replicas
    could share one (8 buffers of a leaf instead of 4 on this mesh)."""
    cfg, _ = load_hf(hf_dir / "one")
    shardings = _param_shardings(layout, cfg)
    events: list[tuple] = []
    empty, from_callback = np.empty, jax.make_array_from_callback

    def recording_empty(shape, dtype=float, *args, **kw):
        out = empty(shape, dtype, *args, **kw)
        if sys._getframe(1).f_globals["__name__"] == hf_io.__name__:  # numpy is patched for all callers
            events.append(("alloc", tuple(out.shape)))
        return out

    def recording_make(shape, sharding_, *args, **kw):
        events.append(("place", tuple(shape), sharding_))
        return from_callback(shape, sharding_, *args, **kw)

    monkeypatch.setattr(hf_io.np, "empty", recording_empty)
    monkeypatch.setattr(jax, "make_array_from_callback", recording_make)
    load_hf(hf_dir / "one", shardings=shardings)
    pending: list[tuple] = []
    placed = 0
    for event in events:
        if event[0] == "alloc":
            pending.append(event[1])
            continue
        _, shape, s = event
        distinct = {tuple(i.indices(n)[:2] for i, n in zip(index, shape))
                    for index in s.devices_indices_map(shape).values()}
        assert pending == [s.shard_shape(shape)] * len(distinct), shape
        pending, placed = [], placed + 1
    assert pending == [] and placed == len(jax.tree.leaves(shardings))


# ----------------------------------------------------------------------------- init_train_state


def test_train_state_born_sharded_equals_unsharded_state(layout, monkeypatch):
    """init_train_state(layout=...) for PPO with a KL term, on params born by `init_params`:
    reference copy, value model and Adam moments come out in `layout.tree` of the state, each
    device holding only its shards, with the unsharded state's values; the params pass through
    untouched (the same arrays, no copy).
    Catches: building the state next to params and placing it afterwards (moments on one device:
    wrong sharding, or a recorded `jax.device_put`), a reference that is the params themselves
    rather than a copy, and a value head or moments that differ from the eager construction."""
    cfg = _CFG
    key = jax.random.key(1)
    params = init_params(cfg, key, shardings=_param_shardings(layout, cfg))
    transfers = _Transfers(monkeypatch)
    state = init_train_state(cfg, params, _PPO, OptimConfig(), layout=layout)
    assert transfers.puts == []
    assert state.params is params
    assert state.ref_params is not None and state.value_params is not None
    pointers = lambda x: {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}  # noqa: E731
    assert not pointers(state.ref_params["embed"]) & pointers(params["embed"])
    _assert_born(state, layout.tree(state))
    _assert_equal(state, init_train_state(cfg, init_params(cfg, key), _PPO, OptimConfig()))


def test_train_state_moves_params_not_in_the_layout(layout):
    """Params on one device are moved device to device into the layout before the state is built.
    Catches: passing them through as they are (the state's params would sit on device 0 while
    the moments are sharded, which the update program would reject or reshard every step)."""
    cfg = _CFG
    params = init_params(cfg, jax.random.key(1))
    state = init_train_state(cfg, params, _PPO, OptimConfig(), layout=layout)
    _assert_born(state, layout.tree(state))
    _assert_equal(state.params, params)


# ----------------------------------------------------------------------------- the training loop


_RUN = TINY + ["data.size=40", "data.eval_size=8", "eval.size=8", "warm_start.steps=0", "rl.iterations=1",
               "algorithm.algorithm=ppo", "algorithm.lam=0.95", "algorithm.kl_coef=0.1"]


def test_rljax_train_state_is_born_sharded_and_restores_in_place(tmp_path, monkeypatch):
    """What `rljax train` does before its first iteration on the default 8-device FSDP mesh
    (`build_run`, `initial_state`; the held-out eval is stubbed, it is not what is tested): the
    policy, reference, value model and Adam moments are born in the trainer layout and nothing
    whole is handed to `jax.device_put`; the reference and the value backbone equal the policy and
    the moments are zero. A checkpoint of it restores (`--resume`) into the layout from an
    abstract template. Catches: `build_policy` ignoring the layout, the removed `_place` path
    (state built on device 0, then `device_put`), and a restore template that allocates a fresh
    state (it must be ShapeDtypeStructs)."""
    cfg = load_config(None, _RUN + [f"output_dir='{tmp_path}'"])
    monkeypatch.setattr(start_mod, "greedy_accuracy", lambda evaluator, params: 0.0)
    transfers = _Transfers(monkeypatch)
    run = run_mod.build_run(cfg, resume=False, log=lambda *_: None)
    template = run_mod.abstract_train_state(run)
    driver = DRIVERS[cfg.driver].build(run, template)
    state, start, _ = start_mod.initial_state(run, driver, template, resume=False)
    assert start == 0 and dict(run.trainer_layout.mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    _assert_born(state, run.trainer_layout.tree(state))
    whole = [shape for _, shape in transfers.puts if np.prod(shape) >= state.params["embed"].size // 8]
    assert whole == []
    _assert_equal(state.ref_params, state.params)
    _assert_equal({k: v for k, v in state.value_params.items() if not k.startswith("value_")}, state.params)
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    (adam,) = [x for x in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(x)]
    _assert_equal((adam.mu, adam.nu), jax.tree.map(np.zeros_like, (adam.mu, adam.nu)))

    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(template))
    loop.save(run, state, 1, driver, 0.0)
    run.ckpt.wait()
    restored, step, _ = restore_run(run.ckpt, template, {}, model_config=run.model_cfg)
    run.ckpt.close()
    assert step == 1
    _assert_born(restored, run.trainer_layout.tree(state))
    _assert_equal(restored, state)


def test_a_run_after_an_expert_mesh_run_keeps_nothing_of_that_mesh(tmp_path):
    """An expert (or context) run sets its mesh as JAX's own (`build_layouts`), and a later run in
    the same process (a notebook: `rljax plan` on a MoE, then a dense run; the test suite) must
    not make anything under it: the loop, init and warm-start keys made before the layouts carried
    the stale fsdp=4 x expert=2 mesh into the dense fsdp=8 iteration, which JAX refused ("mesh
    should be the same across the entire program"). Catches: keys made before `build_layouts`."""
    from rljax.sharding.placement import build_layouts

    build_layouts(load_config(None, ["mesh.fsdp=-1", "mesh.expert=2"]).mesh)
    assert "expert" in jax.sharding.get_abstract_mesh().axis_names  # what the earlier run leaves
    cfg = load_config(None, _RUN + [f"output_dir='{tmp_path}'"])
    run = run_mod.build_run(cfg, resume=False, log=lambda *_: None)
    for name, key in run.keys.items():
        mesh = getattr(key.sharding, "mesh", None)
        assert mesh is None or "expert" not in mesh.axis_names, (name, key.sharding)
    assert jax.sharding.get_abstract_mesh().empty
