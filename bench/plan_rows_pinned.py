"""`rljax plan` with the embedding output pinned to rows over (data, fsdp) where the rows divide:
what the C = 1 (no context axis) plan would hold if XLA kept an FSDP batch's rows on their devices.
Usage: python bench/plan_rows_pinned.py <rljax plan args> (issue 50; BENCHMARKS.md). The sampler's
forward is pinned too, which inflates its temporaries: read only the update rows."""
import sys

from rljax.plan.command import prepare

prepare(sys.argv[1:])
import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from rljax.models import transformer  # noqa: E402
from rljax.sharding import placement  # noqa: E402

_mesh = {}
_build = placement.build_layouts


def build_layouts(section):
    trainer, sampler = _build(section)
    _mesh["m"] = None if trainer is None else trainer.mesh
    return trainer, sampler


placement.build_layouts = build_layouts
import rljax.plan.memory as memory  # noqa: E402

memory.build_layouts = build_layouts
_embed = transformer._embed


def pinned(cfg, params, tokens_bt):
    h = _embed(cfg, params, tokens_bt)
    mesh = _mesh.get("m")
    if mesh is None:
        return h
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    if n > 1 and h.shape[0] % n == 0:
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P(("data", "fsdp"), None, None)))
    return h


transformer._embed = pinned
from rljax.cli import main  # noqa: E402

sys.exit(main(["plan", *sys.argv[1:]]))
