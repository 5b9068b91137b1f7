"""`rljax plan` with the continuous scheduler's slot pools per device (as the code runs) or, with
`--one-pool` first, one pool replicated on every device (before `rljax.sampling.row_shards`).
Usage: python bench/plan_pools.py [--one-pool] <rljax plan args> (issue 50; BENCHMARKS.md)."""
import sys

from rljax.plan.command import prepare

one_pool = sys.argv[1:2] == ["--one-pool"]
args = sys.argv[2:] if one_pool else sys.argv[1:]
prepare(args)
import rljax.sampling.row_shards as RS  # noqa: E402

if one_pool:
    RS.pool_axes = lambda prompts: (None, None)
from rljax.cli import main  # noqa: E402

sys.exit(main(["plan", *args]))
