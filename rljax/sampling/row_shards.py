"""The continuous scheduler with one slot pool per device: each device of the row axes admits and
decodes the rows of its own prompts.

The continuous loop (`rljax.sampling.continuous`, `rljax.sampling.paged`) is a `while_loop` over
a slot pool whose slots are not rows: admission scatters any pending row into any free slot.
XLA cannot partition that state by rows, so on a mesh the whole loop (the pool, its KV cache and
every decode step) was replicated, each device decoding every row. Here the loop runs inside
`jax.shard_map` over the row axes that `rljax.models.context_parallel.spread_axes` gives the
static sampler (the batch axes and `context`, the longest trailing run that divides the prompts),
less `fsdp` and `expert`, which shard the params (below): with D = the product of their sizes, device d holds prompts [d B / D, (d + 1) B / D), so rows
[d R, (d + 1) R) with R = B n / D (rows are prompt-major), and runs the unchanged scheduler over
them with a pool of its own:

    layout       planned for B / D prompts: `sampling.slots` (and `max_total_tokens`,
                 `kv_cache_bytes`) are per pool, at most the pool's R rows; the pool's prompts
                 are all prefilled up front (`prefill_batch` is ignored: its `lax.cond` would
                 branch per pool around collectives)
    real rows    all R (the traced sampler's prompts are all real)
    row keys     fold_in(key, d R + r) for local row r (`row_offset`), the key row d R + r has on
                 one device, so a row's tokens do not depend on D (`rljax.sampling.decode.draw`);
                 a `logits_processor` sees the global row index as well
    params       in_spec P() over the pool axes, over which they are replicated; their fsdp
                 (and tensor, expert) sharding stays XLA's: the map is manual over the pool
                 axes only, so the devices of a pool (its fsdp x tensor peers) decode it together
                 as the one pool was decoded before, a layer's weights gathered at a time
    loops        run in step (`rljax.sampling.slots.pool_while`): a loop goes on while any pool
                 has a running or pending row, since the XLA collectives inside (fsdp's weight
                 gathers) span the pools; a pool with nothing left steps idle

The rows come back split over the axes (P(axes)); the counters are per pool and are summed
(row-steps, slot-steps, preemptions, free pages) or maxed (decode steps, peak pages) over the
pools. `SampleResult.slots` is then the slots of all pools, so occupancy stays
live_row_steps / slot_steps.

When it applies. Under a context mesh (the mesh the trainer sets as JAX's, `build_layouts`, and
the one `spread_rows` splits the static rows over, so both schedulers keep a row on the same
device), over data x context; without one, or when no run of axes divides the prompts, the
scheduler runs as before, one pool that every device holds. Why not over fsdp: a pool per fsdp
device needs every layer's weights on it for the whole loop, so the map gathers the params whole
into each device's temporaries (`configs/long_cot.toml`, Qwen2.5-7B on fsdp 4 x context 2: the
sampler's temporaries went from 32.9 to 77.1 GiB, f32 params gathered; `bench/plan_pools.py`).
Why in step: without it the pools' loops ran different trip counts around XLA's fsdp gathers,
collectives over the whole mesh, and the run deadlocked.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rljax.models import ModelConfig
from rljax.models.context_parallel import context_mesh, spread_axes
from rljax.sampling import continuous as C
from rljax.sampling import paged as PG
from rljax.sampling.controls import SampleControls, StaticControls
from rljax.sampling.decode import SampleResult

_MAX_COUNTERS = ("decode_steps", "peak_pages")  # per-pool maxima; the other scalar counters are summed
PARAM_AXES = ("fsdp", "expert")  # row axes that shard the params: left to XLA inside a pool (module docstring)


def pool_axes(prompts: int):
    """(mesh, axes) to split `prompts` over, one slot pool per device group, or (None, None): the
    axes of `spread_axes` less those that shard the params (`PARAM_AXES`; see the module docstring)."""
    mesh = context_mesh()
    axes = tuple(a for a in (None if mesh is None else spread_axes(mesh, prompts)) or () if a not in PARAM_AXES)
    return (mesh, axes) if axes else (None, None)


def _shift_rows(spec: StaticControls, offset) -> StaticControls:
    """`spec` whose logits processor sees global row indices (local row + `offset`)."""
    if spec.logits_processor is None:
        return spec
    proc = spec.logits_processor
    return dataclasses.replace(spec, logits_processor=lambda logits_bv, row_b, step_b: proc(logits_bv, row_b + offset,
                                                                                             step_b))


def sample_pools(cfg: ModelConfig, params, prompt_bp, mask_bp, key, controls: SampleControls) -> SampleResult:
    """The continuous scheduler (`controls.kv_layout` picks slots or pages) over B left-padded
    prompts, every row real: one pool per device of `pool_axes`, or one pool when there are none.
    The result has B * n rows and the new-token bucket's columns (`rljax.sampling.continuous.trim`
    cuts it), as `sample_continuous` returns."""
    spec = controls.static()
    b, prompt_len = prompt_bp.shape
    n = controls.num_samples
    mesh, axes = pool_axes(b)
    devices = 1 if axes is None else math.prod(mesh.shape[a] for a in axes)
    layout = C.plan_layout(controls, b // devices, prompt_len, cfg)
    if axes is not None:  # the pools' loops in step (`pool_while`); a pool's prompts all prefilled up front
        layout = layout.replace(pool_axes=axes, prefill_batch=0)
    run = PG.sample_paged if layout.kv_layout == "paged" else C.sample_continuous
    max_new, scalars = jnp.int32(controls.max_new_tokens), controls.scalars()
    if axes is None:
        return run(cfg, params, prompt_bp, mask_bp, key, max_new, scalars, b * n, spec=spec, layout=layout)
    rows = b // devices * n

    def pool(params, prompt_bp, mask_bp, key, max_new, scalars):
        offset = jax.lax.axis_index(axes) * rows
        res = run(cfg, params, prompt_bp, mask_bp, key, max_new, scalars, rows, spec=_shift_rows(spec, offset),
                  layout=layout, row_offset=offset)
        return jax.tree.map(lambda x: jnp.reshape(jnp.asarray(x), (1,)) if jnp.ndim(x) == 0 else x, res)

    split = P(axes)
    out = jax.shard_map(pool, mesh=mesh, in_specs=(P(), split, split, P(), P(), P()), out_specs=split,
                        axis_names=set(axes), check_vma=False)(params, prompt_bp, mask_bp, key, max_new, scalars)
    counters = {f.name: (jnp.max if f.name in _MAX_COUNTERS else jnp.sum)(getattr(out, f.name))
                for f in dataclasses.fields(out) if f.name in ("decode_steps", "live_row_steps", "slot_steps",
                                                                "preemptions", "peak_pages", "free_pages")}
    return out.replace(slots=layout.slots * devices, **counters)
