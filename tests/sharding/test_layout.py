"""Sharding: mesh from config, partition rules, sharded == unsharded, memory, weight sync."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import standin_train_step as w
from rljax import sharding
from rljax.errors import ConfigError
from rljax.models import forward, init_cache, init_params, preset


def _close(a_tree, b_tree, atol=1e-5):
    for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- mesh


def test_mesh_fills_the_rest_from_the_device_count():
    """-1 takes the devices left over; every axis is Auto; the product must match the devices."""
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert dict(sharding.make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert dict(sharding.make_mesh(devices=jax.devices()[:2]).shape)["fsdp"] == 2


@pytest.mark.parametrize("cfg, match", [
    (dict(data=3, fsdp=-1), "not divisible by 3"),
    (dict(data=2, fsdp=2, tensor=1), "needs 4 devices but 8"),
    (dict(data=-1, fsdp=-1), "at most one axis"),
    (dict(fsdp=0), "positive or -1"),
])
def test_mesh_errors_are_one_line(cfg, match):
    """A mesh that cannot cover the devices raises one ConfigError line naming the fix."""
    with pytest.raises(ConfigError, match=match) as err:
        sharding.make_mesh(sharding.MeshConfig(**cfg))
    assert "\n" not in str(err.value)


def test_expert_axis_only_when_asked_and_batches_split_over_it():
    """mesh.expert > 1 adds an `expert` axis between fsdp and tensor (others keep their three
    axes); -1 fills in around it; batches split over data x fsdp x expert; a rule's expert_dim
    splits E over it, then tensor and FSDP take their dims as before."""
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1, expert=2, tensor=2))
    assert tuple(mesh.shape.items()) == (("data", 1), ("fsdp", 2), ("expert", 2), ("tensor", 2))
    assert "expert" not in sharding.make_mesh(sharding.MeshConfig(expert=1)).shape
    with pytest.raises(ConfigError, match="needs 4 devices but 8"):
        sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, expert=2, tensor=1))
    assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp", "expert"))
    assert sharding.rules.rows_sharding(mesh, 8).spec == P(("data", "fsdp", "expert"))
    assert sharding.rules.rows_sharding(mesh, 2).spec == P(("data", "fsdp"))
    rule = sharding.Rule(r"experts$", rank=3, tensor_dim=-1, expert_dim=-3)
    assert sharding.spec_for("layers/experts", (3, 4, 64, 32), mesh, (rule,)) == P(None, "expert", "fsdp", "tensor")
    with pytest.raises(ConfigError, match="mesh.expert=2 runs with the sampler in the trainer's layout"):
        sharding.MeshConfig(expert=2, sampler="tensor")


# ----------------------------------------------------------------------------- rules


def test_rules_split_heads_and_mlp_and_fsdp_the_largest_free_dim():
    """FSDP=4 x TP=2: q/k/v split on heads, o on N, gate/up/down on F, vocab on V; FSDP takes the
    largest remaining divisible dim and never the stacked layer axis; small tensors replicate."""
    cfg = preset("qwen2-test")  # V128 D64 F128 N4 K2 H16
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=4, tensor=2))
    specs = sharding.tree_specs(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), mesh)
    lay = specs["layers"]
    assert specs["embed"] == P("tensor", "fsdp")
    assert lay["q"] == P(None, "fsdp", "tensor", None) and lay["k"] == P(None, "fsdp", "tensor", None)
    assert lay["o"] == P(None, "tensor", None, "fsdp")
    assert lay["gate"] == P(None, "fsdp", "tensor") and lay["down"] == P(None, "tensor", "fsdp")
    assert lay["q_bias"] == P(None, "tensor", None)  # 128 elements: split with its heads, no FSDP
    assert lay["attn_norm"] == P(None, None) and specs["final_norm"] == P(None)
    # Unstacked layers (the decode loop's layout) get the same split without the layer axis.
    unstacked = sharding.tree_specs({"layers": ({"q": jnp.zeros((64, 4, 16))},)}, mesh)
    assert unstacked["layers"][0]["q"] == P("fsdp", "tensor", None)


@pytest.mark.parametrize("family", [
    dict(model_type="llama", qkv_bias=False, tie_embeddings=False),
    dict(model_type="qwen3", qkv_bias=False, qk_norm=True),
    dict(model_type="gemma2", qkv_bias=False, norm_plus_one=True, scale_embeddings=True, sandwich_norm=True,
         activation="gelu_tanh", sliding_window=4, sliding_window_pattern=2, num_kv_heads=1),
])
def test_every_family_gets_valid_specs(family):
    """Every param of every family gets a spec whose sharded dims divide the mesh axes, and the
    params of every family can be placed on DP=2 x FSDP=2 x TP=2 (K=1 falls back to replication)."""
    cfg = preset("qwen2-test").replace(**family)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    mesh = sharding.make_mesh(sharding.MeshConfig(2, 2, 2))
    placed = sharding.shard_params(params, mesh)
    for path, x in jax.tree_util.tree_leaves_with_path(placed):
        spec = x.sharding.spec
        for dim, axis in zip(x.shape, spec):
            assert axis is None or dim % sharding.axis_size(mesh, axis) == 0, (path, spec)
    assert placed["layers"]["up"].sharding.spec == P(None, "fsdp", "tensor")
    _close(placed, params, atol=0)


def test_opt_state_shardings_mirror_params():
    """Adam's mu and nu take exactly the params' shardings; the step count is replicated."""
    params = init_params(preset("qwen2-test"), jax.random.key(0))
    layout = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(fsdp=4, tensor=2)))
    tx = optax.adam(1e-3)
    opt_sh = layout.opt_state(tx, params)
    p_sh = layout.params(params)
    assert opt_sh[0].mu == p_sh and opt_sh[0].nu == p_sh
    assert opt_sh[0].count == layout.replicated


def test_batch_and_cache_shardings():
    """Batches shard their leading dim over data x fsdp; the KV cache over batch and kv heads."""
    mesh = sharding.make_mesh(sharding.MeshConfig(2, 2, 2))
    assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"))
    sh = sharding.batch_shardings({"tokens": jnp.zeros((8, 5)), "odd": jnp.zeros((3,)), "s": jnp.zeros(())}, mesh)
    assert sh["tokens"].spec == P(("data", "fsdp")) and sh["odd"].spec == P(None) and sh["s"].spec == P()
    cache_sh = sharding.cache_shardings(init_cache(preset("qwen2-test"), 4, 16), mesh)
    assert cache_sh["layers"][0]["k"].spec == P(("data", "fsdp"), "tensor", None, None)
    assert cache_sh["pos"].spec == P(("data", "fsdp")) and cache_sh["index"].spec == P()


# ----------------------------------------------------------------------------- sharded == unsharded


@pytest.fixture(scope="module")
def reference_run():
    """Three steps of the stand-in train step on one device: (params, opt_state, losses)."""
    import functools
    step = jax.jit(functools.partial(w.train_step, w.model_config(), w.optimizer()))
    params, opt_state = w.initial_state()
    losses = []
    for i in range(3):
        params, opt_state, loss = step(params, opt_state, *w.batch(i))
        losses.append(float(loss))
    return params, opt_state, losses


def test_sharded_train_step_equals_one_device(reference_run):
    """The stand-in train step (the one the two-process test runs) under DP=2 x FSDP=2 x TP=2 gives
    the one-device params, optimiser state and losses after three steps (<= 1e-5), and its outputs
    keep the trainer layout. (The real update step is checked on all three layouts below.)"""
    layout, step = w.sharded_step("dp2_fsdp2_tp2")
    params, opt_state = w.initial_state(layout)
    losses = []
    for i in range(3):
        params, opt_state, loss = step(params, opt_state, *w.batch(i))
        losses.append(float(loss))
    ref_params, ref_opt, ref_losses = reference_run
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
    _close(params, ref_params)
    _close(opt_state, ref_opt)
    assert params["layers"]["gate"].sharding == layout.params(ref_params)["layers"]["gate"]


def test_fsdp8_memory_per_device_is_at_most_a_sixth():
    """Under FSDP=8 each device holds <= 1/6 of the unsharded bytes of params + Adam state,
    counted from the arrays' addressable shards (a config whose dims divide by 8)."""
    cfg = preset("qwen2-test", num_heads=8, num_kv_heads=8, head_dim=8)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    tx = optax.adamw(1e-3)
    layout = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(fsdp=8)))
    state = (sharding.shard_params(params, layout.mesh),
             jax.device_put(tx.init(params), layout.opt_state(tx, params)))
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    per_device = sharding.device_bytes(state)
    assert len(per_device) == 8
    assert max(per_device.values()) <= total / 6, (max(per_device.values()), total)


# ----------------------------------------------------------------------------- sampler layout, sync


def test_sync_weights_stays_on_device_and_matches():
    """Trainer (FSDP=4 x TP=2) -> sampler (DP=4 x TP=2, no FSDP) resharding moves no bytes through
    the host, lands in the sampler's shardings and keeps the values bitwise; `donate` frees the
    trainer's copy.

    Catches: a sync through `jax.device_put`, which assembles each FSDP-sharded weight on the
    host before sending it back (the "disallow_explicit" guard raises on that host-to-device
    copy; plain "disallow" lets explicit transfers through), `jax.device_get` + `device_put`, a
    sync that returns the trainer's layout unchanged, and one that keeps donated buffers alive."""
    params = init_params(preset("qwen2-test"), jax.random.key(0))
    expected = jax.device_get(params)  # donating below may free buffers `params` shares
    trainer = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(fsdp=4, tensor=2)))
    sampler = sharding.sampler_layout(sharding.make_mesh(sharding.MeshConfig(data=4, fsdp=1, tensor=2)))
    train_params = sharding.shard_params(params, trainer.mesh)
    target = sampler.params(params)
    assert jax.tree.map(lambda x: x.sharding, train_params) != target  # a real reshard
    with jax.transfer_guard("disallow_explicit"):
        synced, _ = sharding.sync_weights(train_params, target)
    assert synced["layers"]["q"].sharding.spec == P(None, None, "tensor", None)
    assert jax.tree.map(lambda x: x.sharding, synced) == target
    _close(synced, expected, atol=0)
    assert not any(x.is_deleted() for x in jax.tree.leaves(train_params))

    with jax.transfer_guard("disallow_explicit"):
        donated, _ = sharding.sync_weights(train_params, target, donate=True)
    assert all(x.is_deleted() for x in jax.tree.leaves(train_params))
    _close(donated, expected, atol=0)


def test_sharded_cached_decode_equals_one_device():
    """A prefill + 2 greedy decode steps through the KV cache, compiled for the sampler layout
    (DP=2 x TP=2 x FSDP=2 without param FSDP, cache on batch and heads), match one device."""
    cfg = preset("qwen2-test")
    params = init_params(cfg, jax.random.key(1))
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 6)), jnp.int32)

    def decode(params, cache, tokens):
        logits, cache = forward(cfg, params, tokens, cache=cache)
        out = []
        for _ in range(2):
            nxt = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
            out.append(nxt)
            logits, cache = forward(cfg, params, nxt, cache=cache)
        return jnp.concatenate(out, axis=1), logits, cache

    cache = init_cache(cfg, 4, 16)
    ref = jax.jit(decode)(params, cache, prompt)
    layout = sharding.sampler_layout(sharding.make_mesh(sharding.MeshConfig(2, 2, 2)))
    c_sh, p_sh = layout.cache(cache), layout.params(params)
    fn = sharding.make_sharded(decode, layout.mesh, (p_sh, c_sh, layout.batch(prompt)),
                               (layout.batch(prompt), layout.batch(ref[1]), c_sh))
    got = fn(sharding.shard_params(params, layout.mesh, fsdp=False), jax.device_put(cache, c_sh), prompt)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
    _close(got[1:], ref[1:])
    assert got[2]["layers"][0]["k"].sharding.spec == P(("data", "fsdp"), "tensor", None, None)


# ----------------------------------------------------------------------------- multi-host config


def test_distributed_config_from_env_and_errors():
    """Env vars give an explicit config; partial or out-of-range settings raise one clear line;
    with nothing set, initialize is a no-op and this process is the main one."""
    cfg = sharding.DistributedConfig.from_env({"RLJAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
                                               "RLJAX_NUM_PROCESSES": "4", "RLJAX_PROCESS_ID": "3"})
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.enabled) == ("10.0.0.1:1234", 4, 3, True)
    assert sharding.DistributedConfig.from_env({"RLJAX_DISTRIBUTED": "auto"}).auto
    # A launcher's explicit coordinator wins over auto-detection (the fake TPU pod in
    # test_launch_tpu relies on it). Catches: auto taking precedence and ignoring the address.
    both = sharding.DistributedConfig.from_env({"RLJAX_DISTRIBUTED": "auto", "RLJAX_COORDINATOR_ADDRESS": "h:1",
                                                "RLJAX_NUM_PROCESSES": "2", "RLJAX_PROCESS_ID": "1"})
    assert (both.auto, both.coordinator_address, both.process_id) == (False, "h:1", 1)
    with pytest.raises(ConfigError, match="together"):
        sharding.DistributedConfig(coordinator_address="h:1")
    with pytest.raises(ConfigError, match=r"in \[0, 2\)"):
        sharding.DistributedConfig("h:1", 2, 2)
    with pytest.raises(ConfigError, match="must be an integer"):
        sharding.DistributedConfig.from_env({"RLJAX_COORDINATOR_ADDRESS": "h:1", "RLJAX_NUM_PROCESSES": "two",
                                             "RLJAX_PROCESS_ID": "0"})
    # The joining deadline (default 300 s) comes from RLJAX_INIT_TIMEOUT and does not turn auto off.
    # Catches: the variable ignored, or counted as an explicit setting that overrides auto.
    assert cfg.initialization_timeout == 300
    timed = sharding.DistributedConfig.from_env({"RLJAX_DISTRIBUTED": "auto", "RLJAX_INIT_TIMEOUT": "30"})
    assert (timed.auto, timed.initialization_timeout) == (True, 30)
    with pytest.raises(ConfigError, match="RLJAX_INIT_TIMEOUT='5m' must be a whole number of seconds"):
        sharding.DistributedConfig.from_env({"RLJAX_DISTRIBUTED": "auto", "RLJAX_INIT_TIMEOUT": "5m"})
    with pytest.raises(ConfigError, match="positive"):
        sharding.DistributedConfig.from_env({"RLJAX_DISTRIBUTED": "auto", "RLJAX_INIT_TIMEOUT": "0"})
    assert sharding.initialize(sharding.DistributedConfig()) is False
    assert sharding.main_process_only(lambda: "wrote")() == "wrote"


def test_global_batch_and_process_rows_single_process():
    """With one process, this process loads every row and the global batch is the local one,
    sharded over data x fsdp."""
    mesh = sharding.make_mesh(sharding.MeshConfig(2, 2, 2))
    assert sharding.process_rows(mesh, 8) == slice(0, 8)
    tokens = np.arange(16).reshape(8, 2)
    g = sharding.global_batch({"tokens": tokens}, mesh)["tokens"]
    assert g.sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(g), tokens)


# ----------------------------------------------------------------------------- the real update step and sampler


def _rl_batch(seed=0, b=8, t=12, prompt=5):
    """A GRPO batch: ragged left-padded prompts and completions, slightly off-policy log-probs."""
    from rljax.objectives import prompt_major_group_ids
    from rljax.update import RolloutBatch
    cfg = preset("qwen2-test")
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, (b, t))
    attn, loss = np.ones((b, t), bool), np.zeros((b, t), bool)
    for i in range(b):
        attn[i, :rng.integers(0, 3)] = False
        n = rng.integers(1, t - prompt + 1)
        loss[i, prompt:prompt + n] = True
        attn[i, prompt + n:] = False
    old_logp = rng.normal(-4.0, 0.5, (b, t)).astype(np.float32)
    return RolloutBatch(tokens_bt=np.where(attn, toks, 0).astype(np.int32), attn_mask_bt=attn, loss_mask_bt=loss,
                        sampler_logp_bt=old_logp, rewards_b=rng.integers(0, 2, b).astype(np.float32),
                        group_ids_b=np.asarray(prompt_major_group_ids(b, 4)), completion_len=t - prompt)


@pytest.fixture(scope="module")
def update_reference():
    """One GRPO update (k3 KL to a distinct reference) on one device."""
    from rljax.objectives import AlgorithmConfig
    from rljax.optim import OptimConfig
    from rljax.update import init_train_state, update_step
    cfg = preset("qwen2-test")
    algo = AlgorithmConfig(algorithm="grpo", kl_coef=0.1)
    # Adam's first step is lr * g / (|g| + eps): with the default eps = 1e-8 a gradient entry of
    # about 1e-8 turns its float rounding (which differs between layouts) into an lr-sized change,
    # so eps = 1e-4 keeps the comparison about sharding, not about that amplification.
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), algo,
                             OptimConfig(learning_rate=1e-3, eps=1e-4))
    state = state.replace(ref_params=init_params(cfg, jax.random.key(7)))
    host_state = jax.tree.map(np.asarray, state)
    new_state, metrics = update_step(state, _rl_batch(), jax.random.key(3))
    return host_state, new_state, metrics


@pytest.mark.parametrize("layout_name", list(w.LAYOUTS))
def test_sharded_update_step_equals_one_device(layout_name, update_reference):
    """rljax.update.update_step compiled with the trainer layout's in/out shardings (train state by
    path rules, batch over data x fsdp) gives the one-device state and metrics (<= 1e-5)."""
    from rljax.update import update_step
    host_state, ref_state, ref_metrics = update_reference
    layout = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(*w.LAYOUTS[layout_name])))
    state_sh, batch = layout.tree(host_state), _rl_batch()
    batch_sh = layout.batch(batch)
    step = sharding.make_sharded(update_step, layout.mesh, (state_sh, batch_sh, layout.replicated),
                                 (state_sh, layout.replicated))
    new_state, metrics = step(jax.device_put(host_state, state_sh), jax.device_put(batch, batch_sh),
                              jax.random.key(3))
    _close((new_state.params, new_state.opt_state), (ref_state.params, ref_state.opt_state))
    for name in ref_metrics:
        np.testing.assert_allclose(float(metrics[name]), float(ref_metrics[name]), atol=1e-5, rtol=1e-5,
                                   err_msg=name)
    assert new_state.params["layers"]["q"].sharding == state_sh.params["layers"]["q"]
    from rljax.sharding.rules import path_str
    moments = [x for p, x in jax.tree_util.tree_leaves_with_path(new_state.opt_state)
               if path_str(p).endswith("mu/0/layers/q")]
    assert len(moments) == 1 and moments[0].sharding == state_sh.params["layers"]["q"]


@pytest.mark.isolated  # tests/conftest.py: XLA:CPU crashes on these programs in long-lived workers
@pytest.mark.parametrize("layout_name", w.LAYOUTS)
def test_sampler_on_sharded_params_equals_one_device(layout_name):
    """rljax.sampling.generate on params in the sampler layout (tensor-parallel heads, no FSDP) draws
    the same tokens with the same log-probs (<= 1e-5) as on one device (temperature 1, 2 samples).
    Where the mesh's batch axes (data x fsdp: 4 devices) divide the 4 prompts, the rows are split
    over them; fsdp8's 8 devices do not divide them, so its rows stay replicated."""
    from rljax.sampling import SampleControls, generate
    cfg = preset("qwen2-test")
    params = init_params(cfg, jax.random.key(2))
    prompts = np.random.default_rng(1).integers(1, cfg.vocab_size, (4, 5)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    mask[0, :2] = False
    kwargs = dict(key=jax.random.key(5), controls=SampleControls(max_new_tokens=6, num_samples=2))
    ref = generate(cfg, params, prompts, mask, **kwargs)
    layout = sharding.sampler_layout(sharding.make_mesh(sharding.MeshConfig(*w.LAYOUTS[layout_name])))
    got = generate(cfg, sharding.shard_params(params, layout.mesh, fsdp=False), prompts, mask, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
    _close((got.logprobs, got.sampling_logprobs), (ref.logprobs, ref.sampling_logprobs))
    rows_per_device = {shard.data.shape[0] for shard in got.tokens.addressable_shards}
    assert rows_per_device == ({8} if layout_name == "fsdp8" else {2})


@pytest.mark.isolated  # tests/conftest.py
def test_generate_splits_rows_over_a_data_mesh():
    """Params replicated over an 8-device data mesh: each device samples its own prompt's rows
    (prompt i's 3 samples on device i), with the tokens and log-probs of one device. `stream`
    splits the same way and yields the same tokens."""
    from jax.sharding import NamedSharding

    from rljax.sampling import SampleControls, generate, rows_sharding, stream
    cfg = preset("qwen2-test")
    params = init_params(cfg, jax.random.key(3))
    prompts = np.random.default_rng(2).integers(1, cfg.vocab_size, (8, 6)).astype(np.int32)
    kwargs = dict(key=jax.random.key(7),
                  controls=SampleControls(max_new_tokens=20, num_samples=3, temperature=0.8, top_k=20))
    ref = generate(cfg, params, prompts, **kwargs)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=8, fsdp=1, tensor=1))
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    assert rows_sharding(replicated, 8).spec == P(("data", "fsdp")) and rows_sharding(params, 8) is None
    assert rows_sharding(replicated, 6) is None  # 8 devices do not divide 6 prompts
    got = generate(cfg, replicated, prompts, **kwargs)
    assert [s.data.shape[0] for s in got.tokens.addressable_shards] == [3] * 8
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    _close((got.logprobs, got.sampling_logprobs), (ref.logprobs, ref.sampling_logprobs))
    streamed = np.concatenate([tokens for tokens, _ in stream(cfg, replicated, prompts, chunk=7, **kwargs)],
                              axis=1)
    np.testing.assert_array_equal(streamed, np.asarray(ref.tokens))
