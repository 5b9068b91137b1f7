"""The continuous scheduler with one slot pool per device: each device of the row axes admits and
decodes the rows of its own prompts.

The continuous loop (`rljax.sampling.continuous`, `rljax.sampling.paged`) is a `while_loop` over
a slot pool whose slots are not rows: admission scatters any pending row into any free slot.
XLA cannot partition that state by rows, so on a mesh the whole loop (the pool, its KV cache and
every decode step) was replicated, each device decoding every row. Here the loop runs inside
`jax.shard_map` over the row axes that `rljax.models.context_parallel.spread_axes` gives the
static sampler (the batch axes and `context`, the longest trailing run that divides the prompts):
with D = the product of their sizes, device d holds prompts [d B / D, (d + 1) B / D), so rows
[d R, (d + 1) R) with R = B n / D (rows are prompt-major), and runs the unchanged scheduler over
them with a pool of its own:

    layout       planned for B / D prompts: `sampling.slots` (and `max_total_tokens`,
                 `kv_cache_bytes`) are per device, at most the device's R rows
    real rows    all R (the traced sampler's prompts are all real)
    row keys     fold_in(key, d R + r) for local row r (`row_offset`), the key row d R + r has on
                 one device, so a row's tokens do not depend on D (`rljax.sampling.decode.draw`);
                 a `logits_processor` sees the global row index as well
    params       replicated into the map (in_spec P()): each device gathers the weights, as it
                 needs every layer for its rows' decode steps

The rows come back split over the axes (P(axes)); the counters are per pool and are summed
(row-steps, slot-steps, preemptions, free pages) or maxed (decode steps, peak pages) over the
pools. `SampleResult.slots` is then the slots of all pools, so occupancy stays
live_row_steps / slot_steps.

Without a context mesh, or when no run of axes divides the prompts, the scheduler runs as
before (one pool, in whatever layout XLA gives it). Why only under `context`: it is the mesh
the trainer sets as JAX's (`build_layouts`) and the one `spread_rows` splits the static rows
over; the same rule keeps both schedulers' rows on the same devices.
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


def pool_axes(prompts: int):
    """(mesh, axes) to split `prompts` over, one slot pool per device, or (None, None)."""
    mesh = context_mesh()
    axes = None if mesh is None else spread_axes(mesh, prompts)
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
