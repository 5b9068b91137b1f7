"""Does an FSDP forward keep a batch's rows on their devices? (issue 50's C = 1 plan)

On 8 simulated CPU devices, mesh fsdp = 8, 8 rows of T tokens (one per device), Qwen2.5-7B's layer
shapes with `--layers` layers (vocabulary 512), remat: the compiled `token_logprobs` forward and
its gradient, as the model runs them (`base`), and with the embedding output pinned to rows over
(data, fsdp) by `with_sharding_constraint` (`pinned`). Prints each program's per-device
temporaries (`memory_analysis`) and its largest all-gathers. An all-gather of f32[8 T, D] is
every row's hidden states gathered onto every device: the embedding table is sharded over fsdp
on D (P(None, 'fsdp')), XLA propagates that D sharding through the layers and the rows follow
replicated. BENCHMARKS.md (issue 50) has the numbers.

    python bench/probe_fsdp_rows.py --tokens 2048 --layers 2
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import rljax.models as M  # noqa: E402
from rljax import sharding  # noqa: E402
from rljax.models import transformer  # noqa: E402
from rljax.plan.shapes import model_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    cfg = dataclasses.replace(model_config("Qwen2.5-7B", param_dtype="float32", compute_dtype="bfloat16"),
                              num_layers=args.layers, vocab_size=512)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=8))
    abstract = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
                          sharding.param_shardings(abstract, mesh))
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    tokens = jax.ShapeDtypeStruct((8, args.tokens), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((8, args.tokens), jnp.bool_, sharding=rows)
    embed = transformer._embed
    for variant in ("base", "pinned"):
        if variant == "pinned":
            transformer._embed = lambda *a: jax.lax.with_sharding_constraint(
                embed(*a), NamedSharding(mesh, P(("data", "fsdp"), None, None)))
        loss = lambda p, t, m: M.token_logprobs(cfg, p, t, m, remat=True)[0].sum()
        for name, fn in (("forward", loss), ("gradient", jax.grad(loss))):
            compiled = jax.jit(fn).lower(params, tokens, mask).compile()
            gathers = collections.Counter(re.findall(r"= (\S+\[[^\]]*\])\S* all-gather\(", compiled.as_text()))
            print(f"{variant:6s} {name:8s} T={args.tokens} layers={args.layers}: temporaries "
                  f"{compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f} GiB per device; all-gathers "
                  f"{gathers.most_common(3)}", flush=True)
    transformer._embed = embed


if __name__ == "__main__":
    main()
