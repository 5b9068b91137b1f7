"""Context parallelism (`rljax.models.context_parallel`): on 8 simulated devices, a `context`
mesh axis (zig-zag rows, all-gathered keys, a causal block loop) gives the one-device log-probs,
entropies, loss and gradients, composed with data, fsdp and tensor; and its per-device attention
work is balanced where the naive split's is not.

The reference is the plain one-device forward (`token_logprobs` with no mesh in context, the
einsum attention over [T, T] scores), written independently of the block loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.models as M
from rljax import sharding
from rljax.models import context_parallel as cp
from rljax.models import transformer
from rljax.models.attention import attention
from rljax.models.layers import rope_table
from rljax.models.scoring import token_logprobs

MESHES = {"context4_data2": dict(data=2, fsdp=1, context=4),
          "context2_fsdp2_tensor2": dict(data=1, fsdp=2, context=2, tensor=2)}
B, T = 4, 37  # T is no multiple of 2C: the rows are padded to one


def _case(name: str):
    """(cfg, tokens, mask, segment ids or None): left-padded rows, a row shorter than one shard
    (4 real tokens: one device's share is 10 slots at C = 4), a right-padded row; packed rows
    with three segments; Gemma 2's sliding windows (4 tokens) and both soft-caps."""
    rng = np.random.default_rng(0)
    if name == "gemma2":
        cfg = M.ModelConfig(model_type="gemma2", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, activation="gelu_tanh", norm_plus_one=True,
                            scale_embeddings=True, sandwich_norm=True, attn_logit_softcap=5.0,
                            final_logit_softcap=3.0, sliding_window=4, sliding_window_pattern=2)
    else:
        cfg = M.preset("qwen2-test")
    tokens = rng.integers(1, cfg.vocab_size, (B, T))
    mask = np.ones((B, T), bool)
    mask[1, :9] = False
    mask[2, :33] = False
    mask[3, 30:] = False
    seg = None
    if name == "packed":
        mask = np.ones((B, T), bool)
        mask[:, 33:] = False
        seg = np.zeros((B, T), np.int32)
        for b in range(B):  # three segments per row, boundaries differing by row
            seg[b, 11 + b:] = 1
            seg[b, 24 + b:] = 2
    return cfg, tokens, mask, seg


def _loss(cfg, params, tokens, mask, seg):
    """A policy-gradient surrogate over token log-probs and entropies: -mean(A exp(logp - sg logp))
    - 0.01 mean(H) over the scored tokens, with per-token advantages."""
    pos = None
    if seg is not None:  # positions restart in each segment, as rljax.update.packing builds them
        starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1, axis=1) != 0, np.arange(T), 0), axis=1)
        pos = jnp.asarray(np.arange(T)[None] - starts)
    logp, ent = token_logprobs(cfg, params, tokens, mask, pos, with_entropy=True,
                               segment_ids_bt=None if seg is None else jnp.asarray(seg))
    scored = mask & np.roll(mask, 1, axis=1)
    scored[:, 0] = False
    if seg is not None:
        scored &= np.diff(seg, prepend=-1, axis=1) == 0  # a segment's first token has no prefix in it
    adv = jnp.asarray(np.sin(np.arange(B * T)).reshape(B, T))
    w = jnp.asarray(scored, jnp.float32)
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
    loss = -(w * adv * ratio).sum() / w.sum() - 0.01 * (w * ent).sum() / w.sum()
    return loss, (logp, ent)


@pytest.mark.parametrize("mesh_name,case", [("context4_data2", "padded"), ("context2_fsdp2_tensor2", "packed"),
                                             ("context4_data2", "gemma2")])
def test_context_parallel_equals_one_device(mesh_name, case, monkeypatch):
    """Log-probs, entropies, loss and every gradient equal one device within 1e-5 (f32), with the
    params FSDP/tensor-sharded and the compiled program really all-gathering over `context`.
    A block schedule that skips a needed key chunk, a zig-zag offset off by a chunk, a dropped
    segment or window mask, or soft-capping after the mask fails it. The packed case also walks
    each block in key tiles (KEY_TILE = 8), as long rows do."""
    if case == "packed":
        monkeypatch.setattr(cp, "KEY_TILE", 8)
    cfg, tokens, mask, seg = _case(case)
    params = M.init_params(cfg, jax.random.key(1), std=0.2)  # large enough that attention matters
    fn = jax.value_and_grad(lambda p: _loss(cfg, p, tokens, mask, seg), has_aux=True)
    (want_loss, (want_logp, want_ent)), want_grads = jax.jit(fn)(params)
    mesh = sharding.make_mesh(sharding.MeshConfig(**MESHES[mesh_name]))
    p_sh = sharding.param_shardings(params, mesh, min_fsdp_size=1)
    built = []  # the forward really takes the context-parallel attention (not XLA's own partitioning)
    monkeypatch.setattr(transformer, "context_attention", lambda *a: built.append(a) or cp.context_attention(*a))
    with jax.set_mesh(mesh):
        assert cp.context_mesh() is not None
        compiled = jax.jit(fn, in_shardings=(p_sh,)).lower(params).compile()
    assert built and "all-gather" in compiled.as_text()
    (loss, (logp, ent)), grads = compiled(jax.device_put(params, p_sh))
    real = mask
    np.testing.assert_allclose(np.asarray(logp)[real], np.asarray(want_logp)[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent)[real], np.asarray(want_ent)[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(loss), float(want_loss), atol=1e-5, rtol=0)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_context_mesh_only_with_a_context_axis():
    """The model takes the context-parallel path only inside a mesh with a context axis > 1, and
    that mesh's axes are data, fsdp, context, tensor."""
    assert cp.context_mesh() is None
    with jax.set_mesh(sharding.make_mesh(sharding.MeshConfig(fsdp=-1))):
        assert cp.context_mesh() is None
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=-1, context=4))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
    with jax.set_mesh(mesh):
        assert cp.context_mesh() is not None


@pytest.mark.parametrize("degree", [4])
def test_zigzag_balances_attention_flops_and_the_naive_split_does_not(degree):
    """Each device's compiled attention program (its static causal block schedule, `cost_analysis`
    FLOPs) costs the same within one c x c block under zig-zag; the naive contiguous split's last
    device costs about twice the mean, more than a block off. The zig-zag program's output equals
    the reference attention at that device's query slots (so the balance is not bought by skipping
    a needed block)."""
    cfg = M.preset("qwen2-test")
    c = 8
    t = 2 * degree * c
    k = jax.random.split(jax.random.key(0), 3)
    q_full = jax.random.normal(k[0], (1, t, cfg.num_heads, cfg.head_dim))
    k_full = jax.random.normal(k[1], (1, t, cfg.num_kv_heads, cfg.head_dim))
    v_full = jax.random.normal(k[2], (1, t, cfg.num_kv_heads, cfg.head_dim))
    pos = jnp.arange(t)[None]
    want = attention(q_full, k_full, v_full, pos, pos, 0, cfg)

    def flops(layout, d):
        order = cp.zigzag_order(t, degree, layout)
        mine = jnp.asarray(order[d * 2 * c:(d + 1) * 2 * c])
        kz, vz, kpos = (jnp.take(x, jnp.asarray(order), axis=1) for x in (k_full, v_full, pos))
        run = lambda q, qp: cp.block_attention(q, kz, vz, qp, kpos, 0, cfg, cp.schedule(degree, d, layout), degree,
                                               layout=layout)
        q_loc, qpos_loc = jnp.take(q_full, mine, axis=1), jnp.take(pos, mine, axis=1)
        compiled = jax.jit(run).lower(q_loc, qpos_loc).compile()
        got = compiled(q_loc, qpos_loc)
        np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.take(want, mine, axis=1)), atol=1e-5, rtol=0)
        return compiled.cost_analysis()["flops"]

    block = 2 * 2 * c * c * cfg.num_heads * cfg.head_dim  # QK^T and PV of one c x c block
    zig = [flops("zigzag", d) for d in range(degree)]
    naive = [flops("naive", d) for d in range(degree)]
    assert max(zig) - min(zig) <= block, zig
    assert max(naive) - min(naive) > block, naive
    assert all(len(cp.schedule(degree, d)) == 2 * degree + 1 for d in range(degree))


def test_per_row_rope_tables_keep_their_positions_under_a_context_mesh():
    """A forward with per-row rope tables (a VLM's M-RoPE, `vl_forward`) under a context mesh runs
    the unsplit forward with its own tables and equals the one-device result. Fails if the context
    path took it and dropped the tables (positions fell back to the text RoPE: the rows' tables
    here place token p at 2p and 3p, so the hidden states differ by O(1))."""
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(1), std=0.2)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 12)))
    cos_ph, sin_ph = rope_table(cfg, 96)
    tables = tuple(jnp.stack([t[0:64:2][:32], t[0:96:3][:32]]) for t in (cos_ph, sin_ph))  # positions 2p and 3p
    fn = jax.jit(lambda p: transformer.hidden_states(cfg, p, tokens, rope_cos_sin=tables)[0])
    want = fn(params)
    plain = jax.jit(lambda p: transformer.hidden_states(cfg, p, tokens)[0])(params)
    assert float(jnp.max(jnp.abs(want - plain))) > 0.1  # the tables matter
    mesh = sharding.make_mesh(sharding.MeshConfig(**MESHES["context4_data2"]))
    with jax.set_mesh(mesh):
        assert cp.context_mesh() is not None
        got = jax.jit(lambda p: transformer.hidden_states(cfg, p, tokens, rope_cos_sin=tables)[0])(params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
