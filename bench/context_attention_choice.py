"""Context parallelism's attention, chosen by measurement: all-gather KV (rljax) against a ring.

rljax's `context_attention` all-gathers K/V over the `context` axis once per layer and walks each
device's 2C + 1 causal blocks (zig-zag layout) with an online softmax; its backward
reduce-scatters dK/dV. The ring prototype here (Liu et al., 2023, "Ring attention with blockwise
transformers") keeps each device's two zig-zag query chunks and passes its K/V chunk pair (with
positions) to the next device C - 1 times with `lax.ppermute`, the send issued before the block's
compute so a backend with async collectives can overlap them. Each received pair needs 2 of its
4 c x c blocks (Brandon et al., 2023: for a source j < d both query chunks against its first key
chunk, for j > d the second query chunk against both), so the ring does the same 2C + 1 blocks.
It is a `custom_vjp` (FlashAttention-2's backward, Dao, 2023): the forward keeps only O and the
log-sum-exp; the backward sends K/V round the ring again with the dK/dV accumulators, which
travel C hops to come home. Masks: valid keys (position >= 0) and causality by position only (no
windows, segments, soft-capping: the prototype measures the communication pattern).

Measured per device on 8 simulated CPU devices, one attention layer, fwd + bwd: compiled temp
bytes (`memory_analysis`), FLOPs (`cost_analysis`), bytes entering collectives (operand sizes of
all-gather / collective-permute / reduce-scatter / all-to-all in the compiled HLO), and wall
(median of 3; indicative only on a shared CPU, which also cannot overlap transfers).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 nice -n 19 python bench/context_attention_choice.py \
        [--lengths 8192,32768] [--degrees 4,8] [--wall-max 8192] [--out bench/results/context_attention_choice.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rljax.models as M  # noqa: E402
from rljax.models.context_parallel import CONTEXT_AXIS, KEY_TILE, context_attention, zigzag  # noqa: E402

_NEG = -1e30
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 128  # Qwen2.5-7B's head_dim; 28/4 heads scaled to 8/4 for a CPU


def _key_tiles(*xs):
    """[B, s, ...] -> [s / tile, B, tile, ...] for a `lax.scan` over key tiles of `KEY_TILE`."""
    s = xs[0].shape[1]
    tile = min(s, KEY_TILE)
    return tuple(x.reshape(x.shape[0], s // tile, tile, *x.shape[2:]).swapaxes(0, 1) for x in xs)


def _visible(qp_bq, kp_bs):
    return ((kp_bs[:, None, :] >= 0) & (qp_bq[:, :, None] >= kp_bs[:, None, :]))[:, None, None]


def _fwd_block(st, q_bqkgh, k_bskh, v_bskh, qp_bq, kp_bs, scale):
    """Online-softmax update of (max m, sum l, acc) [B, K, G, c(, H)] with one c x c block."""
    def tile(st, xs):
        m, l, acc = st
        k, v, kp = xs
        s = jnp.einsum("bqkgh,bskh->bkgqs", q_bqkgh, k, preferred_element_type=jnp.float32) * scale
        s = jnp.where(_visible(qp_bq, kp), s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        a = jnp.exp(m - m_new)
        return (m_new, l * a + p.sum(-1), acc * a[..., None] + jnp.einsum("bkgqs,bskh->bkgqh", p, v)), None
    return jax.lax.scan(tile, st, _key_tiles(k_bskh, v_bskh, kp_bs))[0]


def _bwd_block(q_bqkgh, k_bskh, v_bskh, qp_bq, kp_bs, do_bkgqh, lse_bkgq, dsum_bkgq, scale):
    """FlashAttention-2's backward of one block from the saved log-sum-exp: (dq, dk, dv)."""
    def tile(dq, xs):
        k, v, kp = xs
        s = jnp.einsum("bqkgh,bskh->bkgqs", q_bqkgh, k, preferred_element_type=jnp.float32) * scale
        p = jnp.where(_visible(qp_bq, kp), jnp.exp(s - lse_bkgq[..., None]), 0.0)
        dv = jnp.einsum("bkgqs,bkgqh->bskh", p, do_bkgqh)
        ds = p * (jnp.einsum("bkgqh,bskh->bkgqs", do_bkgqh, v) - dsum_bkgq[..., None]) * scale
        dk = jnp.einsum("bkgqs,bqkgh->bskh", ds, q_bqkgh)
        return dq + jnp.einsum("bkgqs,bskh->bqkgh", ds, k), (dk, dv)
    dq, (dk, dv) = jax.lax.scan(tile, jnp.zeros(q_bqkgh.shape, jnp.float32), _key_tiles(k_bskh, v_bskh, kp_bs))
    merge = lambda x: x.swapaxes(0, 1).reshape(k_bskh.shape)
    return dq, merge(dk), merge(dv)


def _own_blocks(_):
    return [(0, 0), (1, 0), (1, 1)]  # (local query chunk, held key chunk) at step 0: the diagonal


def _step_blocks(source_before):
    """Blocks against a received pair: source j < d -> both query chunks vs its first chunk;
    j > d -> the second query chunk vs both of its chunks."""
    return [(0, 0), (1, 0)] if source_before else [(1, 0), (1, 1)]


def ring_attention(degree: int, scale: float, recirculate: bool = False):
    """attend(q [B, 2c, N, H], k, v [B, 2c, K, H], q_pos, k_pos [B, 2c]) inside shard_map: the
    ring over `context`; returns f32 [B, 2c, N, H]. In one jitted fwd + bwd program XLA merges the
    backward's K/V sends with the forward's (identical ppermutes), so every received block stays
    alive until the backward; `recirculate` puts the backward's K/V behind an optimization barrier
    to ask for the textbook ring (K/V sent again, two blocks held), but XLA:CPU (jax 0.10.2) still
    merges them: its compiled program equals `ring`'s (26 lowered permutes -> 17 compiled)."""
    perm = [(i, (i + 1) % degree) for i in range(degree)]
    send = lambda x: jax.lax.ppermute(x, CONTEXT_AXIS, perm)

    def split(q, k, v, qp, kp):
        b, t2, n, h = q.shape
        kh = k.shape[2]
        c = t2 // 2
        return (q.reshape(b, 2, c, kh, n // kh, h), k.reshape(b, 2, c, kh, h), v.reshape(b, 2, c, kh, h),
                qp.reshape(b, 2, c), kp.reshape(b, 2, c))

    def forward(q, k, v, qp, kp):
        q2, k2, v2, qp2, kp2 = split(q, k, v, qp, kp)
        b, _, c, kh, g, h = q2.shape
        d = jax.lax.axis_index(CONTEXT_AXIS)
        init = (jnp.full((b, kh, g, c), _NEG, jnp.float32), jnp.zeros((b, kh, g, c), jnp.float32),
                jnp.zeros((b, kh, g, c, h), jnp.float32))
        state = (init, init)
        held = (k2, v2, kp2)
        for s in range(degree):
            nxt = jax.tree.map(send, held) if s < degree - 1 else None  # issued before the compute

            def run(blocks, state, held):
                st = list(state)
                for qi, ki in blocks:
                    st[qi] = _fwd_block(st[qi], q2[:, qi], held[0][:, ki], held[1][:, ki], qp2[:, qi],
                                        held[2][:, ki], scale)
                return tuple(st)
            if s == 0:
                state = run(_own_blocks(None), state, held)
            else:
                state = jax.lax.cond(d >= s, lambda st, hd: run(_step_blocks(True), st, hd),
                                     lambda st, hd: run(_step_blocks(False), st, hd), state, held)
            held = nxt
        out = jnp.stack([acc / l[..., None] for _, l, acc in state], 1)  # [B, 2, K, G, c, H]
        lse = jnp.stack([m + jnp.log(l) for m, l, _ in state], 1)  # [B, 2, K, G, c]
        return out, lse

    @jax.custom_vjp
    def attend(q, k, v, qp, kp):
        out, _ = forward(q, k, v, qp, kp)
        return out.transpose(0, 1, 4, 2, 3, 5).reshape(q.shape)

    def fwd(q, k, v, qp, kp):
        out, lse = forward(q, k, v, qp, kp)
        return out.transpose(0, 1, 4, 2, 3, 5).reshape(q.shape), (q, k, v, qp, kp, out, lse)

    def bwd(res, dout):
        q, k, v, qp, kp, out, lse = res
        if recirculate:
            k, v, kp = jax.lax.optimization_barrier((k, v, kp))
        q2, k2, v2, qp2, kp2 = split(q, k, v, qp, kp)
        b, _, c, kh, g, h = q2.shape
        do = dout.reshape(b, 2, c, kh, g, h).transpose(0, 1, 3, 4, 2, 5)  # [B, 2, K, G, c, H]
        dsum = (do * out).sum(-1)
        d = jax.lax.axis_index(CONTEXT_AXIS)
        dq = (jnp.zeros(q2[:, 0].shape, jnp.float32),) * 2
        held, dkv = (k2, v2, kp2), (jnp.zeros(k2.shape, jnp.float32), jnp.zeros(v2.shape, jnp.float32))
        for s in range(degree):
            nxt = jax.tree.map(send, held) if s < degree - 1 else None

            def run(blocks, dq, dkv, held):
                dq, dk, dv = list(dq), dkv[0], dkv[1]
                for qi, ki in blocks:
                    gq, gk, gv = _bwd_block(q2[:, qi], held[0][:, ki], held[1][:, ki], qp2[:, qi], held[2][:, ki],
                                            do[:, qi], lse[:, qi], dsum[:, qi], scale)
                    dq[qi] = dq[qi] + gq
                    dk, dv = dk.at[:, ki].add(gk), dv.at[:, ki].add(gv)
                return tuple(dq), (dk, dv)
            if s == 0:
                dq, dkv = run(_own_blocks(None), dq, dkv, held)
            else:
                dq, dkv = jax.lax.cond(d >= s, lambda *a: run(_step_blocks(True), *a),
                                       lambda *a: run(_step_blocks(False), *a), dq, dkv, held)
            dkv = jax.tree.map(send, dkv)  # C hops in all: the accumulators come home
            held = nxt
        dq = jnp.stack(dq, 1).reshape(q.shape).astype(q.dtype)
        return dq, dkv[0].reshape(k.shape).astype(k.dtype), dkv[1].reshape(v.shape).astype(v.dtype), None, None

    attend.defvjp(fwd, bwd)
    return attend


def make_attend(kind: str, mesh: Mesh, cfg):
    """(q, k, v, q_pos, k_pos) -> f32 [B, T, N, H], rows in zig-zag order split over `context`."""
    degree = mesh.shape[CONTEXT_AXIS]
    if kind == "allgather":
        ag = context_attention(mesh, cfg)
        return lambda q, k, v, qp, kp: ag(q, k, v, 0, {"packed_bt": None, "q_pos_bt": qp, "k_pos_bt": kp})
    x4, x2 = P(None, CONTEXT_AXIS, None, None), P(None, CONTEXT_AXIS)
    ring = ring_attention(degree, cfg.query_scale, recirculate=kind == "ring_recirc")
    return jax.shard_map(ring, mesh=mesh, in_specs=(x4, x4, x4, x2, x2), out_specs=x4, check_vma=False)


def inputs(t: int, degree: int, pad: int = 0, seed: int = 0):
    """q, k, v (f32) and positions in zig-zag order; the first `pad` slots left padding (position -1)."""
    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (1, t, HEADS, HEAD_DIM), jnp.float32)
    k = jax.random.normal(kk, (1, t, KV_HEADS, HEAD_DIM), jnp.float32)
    v = jax.random.normal(kv, (1, t, KV_HEADS, HEAD_DIM), jnp.float32)
    pos = jnp.where(jnp.arange(t) < pad, -1, jnp.arange(t) - pad)[None].astype(jnp.int32)
    w = jax.random.normal(kw, (1, t, HEADS, HEAD_DIM), jnp.float32) * (pos >= 0)[..., None, None]
    return tuple(zigzag(x, degree) for x in (q, k, v, pos, pos, w))


def loss_fn(attend):
    return lambda q, k, v, qp, kp, w: (attend(q, k, v, qp, kp) * w).sum()


def check_numerics(cfg, degree: int = 4, t: int = 512, pad: int = 37):
    """Ring == all-gather within 1e-5 (f32): outputs at valid queries and gradients w.r.t. q, k, v."""
    mesh = Mesh(np.array(jax.devices()[:degree]), (CONTEXT_AXIS,))
    args = inputs(t, degree, pad)
    valid = (args[3] >= 0)[0]
    res = {}
    for kind in ("allgather", "ring", "ring_recirc"):
        attend = make_attend(kind, mesh, cfg)
        out = jax.jit(attend)(*args[:5])
        grads = jax.jit(jax.grad(loss_fn(attend), argnums=(0, 1, 2)))(*args)
        res[kind] = (out[0][valid], *grads)
    errs = {f"{kind}_{name}": float(jnp.max(jnp.abs(a - b))) for kind in ("ring", "ring_recirc")
            for name, a, b in zip(("out", "dq", "dk", "dv"), res["allgather"], res[kind])}
    scale = {name: float(jnp.max(jnp.abs(a))) for name, a in zip(("out", "dq", "dk", "dv"), res["allgather"])}
    bad = {n: e for n, e in errs.items() if e > 1e-5}
    assert not bad, f"ring != all-gather beyond 1e-5: {bad} (max |ref| {scale})"
    return {"degree": degree, "t": t, "pad": pad, "max_abs_err": errs, "max_abs_ref": scale}


_COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?)\s+(all-gather|collective-permute|reduce-scatter|all-to-all)(-start)?\(")
_SHAPE = re.compile(r"(f32|f16|bf16|s32|u32|pred|s8|f64|s64)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "f64": 8, "s64": 8}


def collective_bytes(hlo: str, degree: int) -> dict[str, int]:
    """Bytes entering each collective kind per device, from the compiled HLO's result shapes: an
    all-gather's operand is its result / C, a reduce-scatter's is its result x C. The programs here
    have no collective inside a loop (the ring is unrolled), so each line runs once."""
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        kind = m.group(2)
        shapes = _SHAPE.findall(m.group(1))
        if m.group(3):  # async start: a tuple (operands, results, ...); take the operands' first half
            shapes = shapes[: max(1, len(shapes) // 2)]
        size = sum(_BYTES[dt] * int(np.prod([int(x) for x in dims.split(",") if x] or [1])) for dt, dims in shapes)
        if not m.group(3):
            size = size // degree if kind == "all-gather" else size * degree if kind == "reduce-scatter" else size
        out[kind] = out.get(kind, 0) + size
    return out


def wire_bytes(collective: dict[str, int], degree: int) -> int:
    """Bytes each device receives over the link (ring algorithms): an all-gather receives C - 1
    shards ((C - 1) x operand), a reduce-scatter and an all-to-all (C - 1) / C of the operand, a
    permute its operand."""
    f = {"all-gather": degree - 1, "reduce-scatter": (degree - 1) / degree, "all-to-all": (degree - 1) / degree}
    return int(sum(v * f.get(k, 1) for k, v in collective.items()))


def unrolled_flops(step, shapes) -> float:
    """`cost_analysis` counts a while loop's body once; rljax's block loop and both paths' key
    tiles are `lax.scan`s, so FLOPs are read from a compile with every scan unrolled (`jax.lax.scan`
    patched for it). A scan's transpose stays a loop: rljax's key tiles (c > KEY_TILE) undercount."""
    orig = jax.lax.scan
    jax.lax.scan = lambda *a, **k: orig(*a, **{**k, "unroll": True})
    try:
        cost = step.lower(*shapes).compile().cost_analysis()
    finally:
        jax.lax.scan = orig
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def measure(cfg, kind: str, t: int, degree: int, wall: bool, reps: int = 3) -> dict:
    mesh = Mesh(np.array(jax.devices()[:degree]), (CONTEXT_AXIS,))
    attend = make_attend(kind, mesh, cfg)
    step = jax.jit(jax.value_and_grad(loss_fn(attend), argnums=(0, 1, 2)))
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (((1, t, HEADS, HEAD_DIM), jnp.float32),
                                                      ((1, t, KV_HEADS, HEAD_DIM), jnp.float32),
                                                      ((1, t, KV_HEADS, HEAD_DIM), jnp.float32),
                                                      ((1, t), jnp.int32), ((1, t), jnp.int32),
                                                      ((1, t, HEADS, HEAD_DIM), jnp.float32))]
    start = time.perf_counter()
    compiled = step.lower(*shapes).compile()
    row = {"kind": kind, "t": t, "degree": degree, "compile_s": round(time.perf_counter() - start, 1)}
    ma = compiled.memory_analysis()
    row.update(temp_bytes=int(ma.temp_size_in_bytes), collective_bytes=collective_bytes(compiled.as_text(), degree))
    row["collective_bytes_total"] = sum(row["collective_bytes"].values())
    row["wire_bytes"] = wire_bytes(row["collective_bytes"], degree)
    row["flops"] = unrolled_flops(jax.jit(jax.value_and_grad(loss_fn(attend), argnums=(0, 1, 2))), shapes)
    if wall:
        args = inputs(t, degree)
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        row["wall_s_median"] = round(statistics.median(times), 3)
    return row


def table(rows) -> str:
    lines = ["| T | C | path | temp MiB/dev | GFLOP/dev | collective operands MiB/dev (by kind) | received MiB/dev | "
             "fwd+bwd wall s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(r["collective_bytes"].items()))
        lines.append(f"| {r['t']} | {r['degree']} | {r['kind']} | {r['temp_bytes'] / 2**20:.0f} | "
                     f"{r['flops'] / 1e9:.1f} | {r['collective_bytes_total'] / 2**20:.0f} ({kinds}) | {r['wire_bytes'] / 2**20:.0f} | "
                     f"{r.get('wall_s_median', '-')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--degrees", default="4,8")
    ap.add_argument("--wall-max", type=int, default=8192, help="time fwd+bwd only up to this T")
    ap.add_argument("--kinds", default="allgather,ring")
    ap.add_argument("--skip-numerics", action="store_true")
    ap.add_argument("--out", default="bench/results/context_attention_choice.json")
    args = ap.parse_args()
    cfg = M.preset("qwen2-tiny")
    import dataclasses
    cfg = dataclasses.replace(cfg, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, attn_scale=None)
    print(f"{jax.device_count()} {jax.default_backend()} devices; heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}")
    numerics = None if args.skip_numerics else check_numerics(cfg)
    print("numerics ok:", json.dumps(numerics), flush=True)
    rows = []
    for t in (int(x) for x in args.lengths.split(",")):
        for degree in (int(x) for x in args.degrees.split(",")):
            for kind in args.kinds.split(","):
                rows.append(measure(cfg, kind, t, degree, wall=t <= args.wall_max))
                print(json.dumps(rows[-1]), flush=True)
    print(md := table(rows))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"jax": jax.__version__, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                   "numerics": numerics, "rows": rows, "table_md": md}, f, indent=1)


if __name__ == "__main__":
    main()
