"""The Ulysses row of `bench/context_attention_choice.py`: sequence -> heads by all-to-all.

DeepSpeed-Ulysses (Jacobs et al., 2023): inside `shard_map` over `context`, q, k, v [B, 2c, N, H]
(each device its zig-zag chunk pair) are exchanged with `lax.all_to_all` into [B, T, N / C, H]:
every device then holds the whole row for N / C query and K / C KV heads (both must divide by C),
attends over it (the causal (query chunk, key chunk) blocks of the 2C chunks on its N / C
heads: the same work a device as the other paths' 2C + 1 blocks, each block a checkpointed
online-softmax step from the ring bench), and a second all-to-all returns [B, 2c, N, H]. Positions are all-gathered.
Same inputs, numerics check (against rljax's all-gather path within 1e-5) and measurements as
the ring bench; C = 4 only here (8 query / 4 KV heads), since C = 8 does not divide 4 KV heads.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 nice -n 19 python bench/context_attention_ulysses.py \
        [--lengths 8192,32768] [--wall-max 8192] [--out bench/results/context_attention_ulysses.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import context_attention_choice as R  # sets XLA_FLAGS before jax loads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rljax.models as M  # noqa: E402
from rljax.models.context_parallel import CONTEXT_AXIS, chunk_owner  # noqa: E402


def ulysses_attention(degree: int, scale: float):
    """attend(q [B, 2c, N, H], k, v [B, 2c, K, H], q_pos, k_pos [B, 2c]) inside shard_map."""
    natural = [m for pair in chunk_owner(degree) for m in pair]  # natural chunk of each gathered slot chunk
    block = jax.checkpoint(R._fwd_block, static_argnums=(6,))

    def attend(q, k, v, qp, kp):
        to_heads = lambda x: jax.lax.all_to_all(x, CONTEXT_AXIS, 2, 1, tiled=True)
        gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)
        qh, kh_, vh = to_heads(q), to_heads(k), to_heads(v)  # [B, T, N / C | K / C, H]
        b, t, n, h = qh.shape
        kh = kh_.shape[2]
        c = t // (2 * degree)
        qc = qh.reshape(b, 2 * degree, c, kh, n // kh, h)
        kc, vc = kh_.reshape(b, 2 * degree, c, kh, h), vh.reshape(b, 2 * degree, c, kh, h)
        pos = gather(jnp.stack([qp, kp]))  # [2, B, T]
        qpc, kpc = pos[0].reshape(b, 2 * degree, c), pos[1].reshape(b, 2 * degree, c)
        outs = []
        for jq in range(2 * degree):
            st = (jnp.full((b, kh, n // kh, c), R._NEG, jnp.float32), jnp.zeros((b, kh, n // kh, c), jnp.float32),
                  jnp.zeros((b, kh, n // kh, c, h), jnp.float32))
            for jk in range(2 * degree):
                if natural[jk] <= natural[jq]:  # causal blocks only: 2C + 1 per device on average
                    st = block(st, qc[:, jq], kc[:, jk], vc[:, jk], qpc[:, jq], kpc[:, jk], scale)
            outs.append((st[2] / st[1][..., None]).transpose(0, 3, 1, 2, 4))  # [B, c, K/C, G, H]
        out = jnp.stack(outs, 1).reshape(b, t, n, h)
        return jax.lax.all_to_all(out, CONTEXT_AXIS, 1, 2, tiled=True)  # back to [B, 2c, N, H]
    return attend


_OTHER_PATHS = R.make_attend


def make_attend(kind, mesh, cfg):
    if kind != "ulysses":
        return _OTHER_PATHS(kind, mesh, cfg)
    x4, x2 = P(None, CONTEXT_AXIS, None, None), P(None, CONTEXT_AXIS)
    return jax.shard_map(ulysses_attention(mesh.shape[CONTEXT_AXIS], cfg.query_scale), mesh=mesh,
                         in_specs=(x4, x4, x4, x2, x2), out_specs=x4, check_vma=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--wall-max", type=int, default=8192)
    ap.add_argument("--out", default="bench/results/context_attention_ulysses.json")
    args = ap.parse_args()
    cfg = dataclasses.replace(M.preset("qwen2-tiny"), num_heads=R.HEADS, num_kv_heads=R.KV_HEADS,
                              head_dim=R.HEAD_DIM, attn_scale=None)
    R.make_attend = make_attend  # the ring bench's measure / numerics, with the Ulysses kind added
    degree, t, pad = 4, 512, 37
    mesh = Mesh(np.array(jax.devices()[:degree]), (CONTEXT_AXIS,))
    inp = R.inputs(t, degree, pad)
    valid = (inp[3] >= 0)[0]
    res = {}
    for kind in ("allgather", "ulysses"):
        attend = make_attend(kind, mesh, cfg)
        res[kind] = (jax.jit(attend)(*inp[:5])[0][valid],
                     *jax.jit(jax.grad(R.loss_fn(attend), argnums=(0, 1, 2)))(*inp))
    errs = {n: float(jnp.max(jnp.abs(a - b))) for n, a, b in zip(("out", "dq", "dk", "dv"), res["allgather"], res["ulysses"])}
    assert max(errs.values()) <= 1e-5, f"ulysses != all-gather beyond 1e-5: {errs}"
    print("numerics ok:", errs, flush=True)
    rows = []
    for t in (int(x) for x in args.lengths.split(",")):
        rows.append(R.measure(cfg, "ulysses", t, degree, wall=t <= args.wall_max))
        print(json.dumps(rows[-1]), flush=True)
    print(md := R.table(rows))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"jax": jax.__version__, "numerics": {"degree": degree, "t": 512, "pad": pad, "max_abs_err": errs},
                   "rows": rows, "table_md": md}, f, indent=1)


if __name__ == "__main__":
    main()
