"""The traceable sampler the RL iteration compiles (`rljax.sampling.traced.sample`), compiled on
one device or with its prompts arriving over `data` on a mesh: shared by the sampler's
multi-device tests."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rljax.sampling.traced as TR
from rljax import sharding


def compiled_sample(cfg, params, tokens, mask, controls, mesh=None):
    """(memory analysis, result) of `TR.sample` on `tokens`/`mask`, params sharded as the run
    shards them (fsdp down to size 1) and the prompts over `data` when `mesh` is given."""
    fn = lambda p, t, m, k: TR.sample(cfg, p, t, m, k, controls)  # noqa: E731
    key = jax.random.key(0)
    if mesh is None:
        compiled = jax.jit(fn).lower(params, tokens, mask, key).compile()
        return compiled.memory_analysis(), compiled(params, tokens, mask, key)
    p_sh = sharding.param_shardings(params, mesh, min_fsdp_size=1)
    rows = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=(p_sh, rows, rows, None)).lower(params, tokens, mask, key).compile()
    out = compiled(jax.device_put(params, p_sh), jax.device_put(tokens, rows), jax.device_put(mask, rows), key)
    return compiled.memory_analysis(), out
