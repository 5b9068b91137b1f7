"""The continuous scheduler with one slot pool per device (`rljax.sampling.row_shards`): on 8
simulated devices (context 4 x data 2) each device admits and decodes its own prompts' rows, and
the tokens are the one-device scheduler's. The traceable sampler the RL iteration compiles
(`rljax.sampling.traced.sample`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from mesh_sampler import compiled_sample

import rljax.models as M
import rljax.sampling.row_shards as RS
import rljax.sampling.traced as TR
from rljax import sharding
from rljax.sampling import SampleControls
from rljax.sampling.slots import kv_bytes_per_token

B, T, NEW, N = 8, 16, 64, 2  # 16 rows of 16 + 64 cache slots: 2 rows a device


def _inputs(cfg):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (B, T)), jnp.int32)
    mask = jnp.ones((B, T), bool).at[1, :5].set(False).at[6, :9].set(False)
    return tokens, mask


def _controls(new=NEW, **kw):
    return SampleControls(max_new_tokens=new, num_samples=N, temperature=1.0, scheduler="continuous",
                          batch_invariant=True, eos_ids=(3,), **kw)


def _run(cfg, params, controls, mesh=None):
    """(memory analysis, result) of the traced sampler, prompts arriving over `data` on `mesh`."""
    tokens, mask = _inputs(cfg)
    return compiled_sample(cfg, params, tokens, mask, controls, mesh)


def _same_rows(got, want):
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    np.testing.assert_array_equal(np.asarray(got.finish_reason), np.asarray(want.finish_reason))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5, rtol=0)


def test_each_device_decodes_its_own_pool(monkeypatch):
    """Context 4 x data 2: the 16 rows come back split 2 to a device over (data, context), and the
    compiled sampler's temporaries are smaller than the replicated pool's by at least the KV cache
    of the 14 slots a device no longer holds (the pool holds 2 slots, not 16); tokens, lengths
    and finish reasons equal the one-device scheduler's exactly, log-probs within 1e-5, and the
    counters add up to the one-device run's row-steps. Fails if the pool stays replicated
    (`pool_axes` -> (None, None): the sharding is P() and the saving 0), if a device draws with
    its local row index (`row_offset` dropped: other tokens), or if a device decodes rows it
    does not own (a wrong `row_offset` or prompt split: other tokens or rows left empty)."""
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(1), std=0.2)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=1, context=4))
    controls = _controls()
    _, one = _run(cfg, params, controls)
    pools_mem, pools = _run(cfg, params, controls, mesh)
    monkeypatch.setattr(RS, "pool_axes", lambda prompts: (None, None))
    plain_mem, plain = _run(cfg, params, controls, mesh)
    assert pools.tokens.sharding.spec == P(("data", "context")) and plain.tokens.sharding.is_fully_replicated
    assert pools.slots == 16 and plain.slots == 16  # 2 slots x 8 pools; one pool of 16
    _same_rows(pools, one)
    _same_rows(plain, one)
    assert int(pools.live_row_steps) == int(one.live_row_steps) == int(np.sum(np.asarray(one.lengths) - 1))
    cache_slot = kv_bytes_per_token(cfg, "model") * (T + NEW)
    saved = plain_mem.temp_size_in_bytes - pools_mem.temp_size_in_bytes
    print(f"temp bytes: one pool {plain_mem.temp_size_in_bytes}, a pool per device {pools_mem.temp_size_in_bytes}, "
          f"saved {saved}; 14 slots' cache {14 * cache_slot}")
    assert saved >= (B * N - B * N // 8) * cache_slot


def test_paged_pools_over_an_fsdp_mesh_see_global_rows():
    """The paged layout on data 2 x fsdp 2 x context 2: 4 pools over (data, context), each decoded
    by its 2 fsdp peers with the params left sharded to XLA, through preemptions (6 pages a pool
    for 4 rows of 3 pages); a `logits_processor` that bans token 7 row + step sees the global row
    index. The tokens equal the one-device run's and every pool frees all its pages. Fails if
    the pools' loops do not run in step (`pool_while` without the psum: the run deadlocks on the
    fsdp gathers, XLA aborts it), if the processor got the local row, or if the paged scheduler
    did not take `row_offset`. (`pool_while`'s `guard`, which stops a pool that has pages enough
    from preempting beside a short one, changes preemption counts, not tokens: not caught here.)"""
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(1), std=0.2)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, context=2))

    def ban_row_token(logits_bv, row_b, step_b):
        return logits_bv.at[jnp.arange(logits_bv.shape[0]), (row_b * 7 + step_b) % logits_bv.shape[1]].set(-1e9)

    controls = _controls(32, kv_layout="paged", page_size=16, max_total_tokens=96, logits_processor=ban_row_token)
    _, one = _run(cfg, params, controls)
    _, pools = _run(cfg, params, controls, mesh)
    assert pools.tokens.sharding.spec == P(("data", "context"))
    _same_rows(pools, one)
    assert int(pools.free_pages) == 4 * int(one.free_pages) == 24 and int(pools.preemptions) > 0


def test_pools_over_the_spread_axes_less_fsdp():
    """Pools over the spread axes less fsdp: (data, context) on context 4 x data 2 and on data 2 x
    fsdp 2 x context 2, context alone on fsdp 2 x context 4 and tensor 2 x context 4; none without
    a context axis or when no run of axes divides the prompts. Fails if pools were made over fsdp
    (a pool per fsdp device gathers the params whole: `configs/long_cot.toml`'s sampler then
    plans 77.1 GiB, not 32.9)."""
    cases = [(dict(data=2, fsdp=1, context=4), 8, ("data", "context")), (dict(data=2, fsdp=1, context=4), 4,
             ("context",)), (dict(data=2, fsdp=1, context=4), 6, None), (dict(data=1, fsdp=2, context=4), 8,
             ("context",)), (dict(data=2, fsdp=2, context=2), 8, ("data", "context")),
             (dict(data=1, fsdp=1, tensor=2, context=4), 8, ("context",)), (dict(data=8, fsdp=1), 8, None)]
    for shape, prompts, want in cases:
        with jax.set_mesh(sharding.make_mesh(sharding.MeshConfig(**shape))):
            assert RS.pool_axes(prompts)[1] == want, (shape, prompts)
