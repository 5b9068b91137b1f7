"""The sampler under a `context` mesh axis (`rljax.models.context_parallel.spread_rows`): each
device of a context group decodes rows of its own, rather than the C devices decoding the same
rows and each holding their whole KV cache; the tokens and log-probs are the ones the replicated
sampler draws. 8 simulated devices, context 4 x data 2, the traceable sampler the RL iteration
compiles (`rljax.sampling.traced.sample`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from mesh_sampler import compiled_sample

import rljax.models as M
import rljax.sampling.traced as TR
from rljax import sharding
from rljax.models.context_parallel import spread_axes
from rljax.sampling import SampleControls
from rljax.sampling.slots import kv_bytes_per_token

B, T, NEW, N = 8, 16, 256, 2  # 16 rows of 16 + 256 cache slots


def _compiled(cfg, params, mesh):
    """(memory analysis, result) of the traced sampler on B prompts arriving over `data`."""
    controls = SampleControls(max_new_tokens=NEW, num_samples=N, temperature=1.0, decode_phases=1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (B, T)), jnp.int32)
    mask = jnp.ones((B, T), bool).at[1, :5].set(False)
    return compiled_sample(cfg, params, tokens, mask, controls, mesh)


def test_context_peers_decode_their_own_rows(monkeypatch):
    """Spread, the 16 rows sit 2 to a device over (data, context) and the compiled sampler's
    temporaries shrink by at least the KV cache of the 6 rows a device no longer holds (measured:
    894,656 bytes against the cache's 835,584); the tokens equal the replicated sampler's exactly
    and the log-probs within 1e-5 (f32 sums over other row counts). Fails if the sampler keeps the
    prompts' rows over `data` only (the saving is then 0), or if spreading changed a row's draw."""
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(1), std=0.2)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=1, context=4))
    spread_mem, spread = _compiled(cfg, params, mesh)
    monkeypatch.setattr(TR, "spread_rows", lambda rows: rows)
    plain_mem, plain = _compiled(cfg, params, mesh)
    assert spread.tokens.sharding.spec == P(("data", "context")) and plain.tokens.sharding.spec == P("data")
    cache_row = kv_bytes_per_token(cfg, "model") * (T + NEW)
    saved = plain_mem.temp_size_in_bytes - spread_mem.temp_size_in_bytes
    assert saved >= (B * N // 2 - B * N // 8) * cache_row
    np.testing.assert_array_equal(np.asarray(spread.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(spread.logprobs), np.asarray(plain.logprobs), atol=1e-5, rtol=0)


def test_spread_axes_take_the_longest_run_with_context_that_divides():
    """Rows over (data, context) when 8 divides them, over context alone when only 4 does, and
    left as they are (None) when neither does; a mesh without context is never spread."""
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=1, context=4))
    assert spread_axes(mesh, 16) == ("data", "context")
    assert spread_axes(mesh, 4) == ("context",)
    assert spread_axes(mesh, 6) is None
    assert spread_axes(sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4)), 16) is None
