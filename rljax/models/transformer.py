"""A pure-functional decoder-only transformer for the Llama, Qwen2/3 and Gemma 1/2 families.

Params are a plain dict pytree. Per-layer weights are stacked on a leading layer axis `L` so a
full-sequence forward is one `lax.scan` over layers (fast to compile, easy to shard):

    embed                 [V, D]
    layers/attn_norm      [L, D]          layers/mlp_norm   [L, D]
    layers/q              [L, D, N, H]    layers/q_bias     [L, N, H]   (qkv_bias)
    layers/k, layers/v    [L, D, K, H]    layers/k_bias ... [L, K, H]   (qkv_bias)
    layers/q_norm         [L, H]          layers/k_norm     [L, H]      (qk_norm)
    layers/o              [L, N, H, D]    layers/o_bias     [L, D]      (o_bias)
    layers/attn_post_norm [L, D]          layers/mlp_post_norm [L, D]   (sandwich_norm)
    layers/gate, layers/up [L, D, F]      layers/down       [L, F, D]
    final_norm            [D]
    lm_head               [V, D]          (untied only)

With a KV cache (sampling) the layer loop is unrolled so each layer's cache buffer is updated in
place; `unstack_layers` splits the stacked weights once so the decode loop never slices them.

This module holds the params layout and init, the KV cache and the forward passes; one layer's
pieces (norm, rope, projections, MLP, `block`) are in `rljax.models.layers`.

Shape letters: B batch, T query time, S key slots, D hidden, N query heads, K kv heads,
G = N // K, H head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.attention import (align_rows, cached_attention, decode_attention, fresh_attention,
                                    key_cache_layout, resolve_attention, resolve_decode_attention, roll_rows,
                                    softcap, valid_range)
from rljax.models.config import ModelConfig
from rljax.models.context_parallel import CONTEXT_AXIS, context_attention, context_mesh, padded_length, unzigzag, zigzag
from rljax.models.fp8 import KV_SCALES, fp8_cache_attend, is_fp8_cache
from rljax.models.layers import block, embed_tokens, is_adapted, rms_norm, rope_tables
from rljax.models.mlp_kinds import is_mixed, layer_kinds, segment_layers, segments, split_layers, stack_layer_list
from rljax.models.moe import MoEAux, init_moe_layers, layer_mlp, mlp_of_kind
from rljax.models.remat import remat_layer
from rljax.models.row_pinning import pin_rows

Params = dict[str, Any]
Cache = dict[str, Any]


# ----------------------------------------------------------------------------- init


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02, *, shardings=None) -> Params:
    """Random-init params (normal(0, std) weights, unit norms, zero biases).

    One compiled program for the whole tree, so start-up does not compile a sampler per weight
    shape. The fused program rounds the normal transform differently in the last bit (about 7e-9
    at std 0.02), so values differ from an eager draw at that level; the same key always gives
    the same params.

    `shardings` (a params-shaped tree of NamedShardings, e.g. `Layout.params` of the abstract
    params) makes the params born sharded: the program's `out_shardings`, so each device draws
    only its own shards and no device ever holds a whole weight. Values are bitwise those of the
    unsharded init, because JAX's threefry is partitionable (`jax_threefry_partitionable`): a
    random bit depends on the key and the element's global index, not on the layout."""
    if shardings is None:
        return _init_params_jit(cfg, key, std)
    return jax.jit(_init_params, static_argnums=(0,), out_shardings=shardings)(cfg, key, std)


def _init_params(cfg: ModelConfig, key: jax.Array, std) -> Params:
    L, D, N, K, H, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    dt = cfg.params_jnp_dtype
    keys = iter(jax.random.split(key, 24 if is_mixed(cfg) else 16))  # a mixed stack draws more leaves

    def normal(*shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    norm_init = jnp.zeros if cfg.norm_plus_one else jnp.ones
    layers = {
        "attn_norm": norm_init((L, D), dt), "mlp_norm": norm_init((L, D), dt),
        "q": normal(L, D, N, H), "k": normal(L, D, K, H), "v": normal(L, D, K, H),
        "o": normal(L, N, H, D),
    }
    layers.update(init_moe_layers(cfg, normal) if cfg.moe is not None else
                  {"gate": normal(L, D, F), "up": normal(L, D, F), "down": normal(L, F, D)})
    if cfg.qkv_bias:
        layers.update(q_bias=jnp.zeros((L, N, H), dt), k_bias=jnp.zeros((L, K, H), dt),
                      v_bias=jnp.zeros((L, K, H), dt))
    if cfg.o_bias:
        layers["o_bias"] = jnp.zeros((L, D), dt)
    if cfg.qk_norm:
        layers.update(q_norm=norm_init((L, H), dt), k_norm=norm_init((L, H), dt))
    if cfg.sandwich_norm:
        layers.update(attn_post_norm=norm_init((L, D), dt), mlp_post_norm=norm_init((L, D), dt))
    params = {"embed": normal(V, D), "layers": layers, "final_norm": norm_init((D,), dt)}
    if not cfg.tie_embeddings:
        params["lm_head"] = normal(V, D)
    return params


_init_params_jit = jax.jit(_init_params, static_argnums=(0,))


def unstack_layers(params: Params, cfg: ModelConfig | None = None) -> Params:
    """Splits stacked layer weights into a tuple of per-layer dicts (for the decode loop). A
    stack mixing dense and MoE layers (`rljax.models.mlp_kinds`) needs `cfg` to know whose row
    each MLP weight is."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    if cfg is not None and is_mixed(cfg):
        return {**params, "layers": split_layers(cfg, layers)}
    if len({w.shape[0] for w in jax.tree.leaves(layers)}) > 1:
        raise ValueError("a stack of dense and MoE layers is split by unstack_layers(params, cfg)")
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    per_layer = tuple(jax.tree.map(lambda w, i=i: w[i], layers) for i in range(num_layers))
    return {**params, "layers": per_layer}


# ----------------------------------------------------------------------------- KV cache


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
    """An empty KV cache: per-layer keys k [B, K, H, S] (transposed) and values v [B, K, S, H],
    key positions [B, S] (-1 = empty). Slots are the minor axis of keys and the third of values,
    so decode attention reads both without a transpose (see `cached_attention`). Where decode
    runs the Pallas kernel, keys are [B, K, S, H] like values, the kernel's layout
    (`rljax.models.attention.key_cache_layout`; `cache_slot_axes` names the slot axes)."""
    dtype = dtype or cfg.compute_jnp_dtype
    v_shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len) if key_cache_layout(cfg) == "bkhs" else v_shape
    return {
        "layers": tuple({"k": jnp.zeros(k_shape, dtype), "v": jnp.zeros(v_shape, dtype)}
                        for _ in range(cfg.num_layers)),
        "pos": jnp.full((batch, max_len), -1, jnp.int32),
        "index": jnp.zeros((), jnp.int32),
    }


def cache_slot_axes(cfg: ModelConfig) -> dict[str, int]:
    """Slot axis of each cache buffer (for code that pads, slices or copies caches: the samplers);
    an FP8 cache's scales (`rljax.models.fp8`) share their buffer's."""
    k = 3 if key_cache_layout(cfg) == "bkhs" else 2
    return {"k": k, "v": 2, KV_SCALES["k"]: k, KV_SCALES["v"]: 2}


def to_cache_layout(cfg: ModelConfig, k_btkh, v_btkh):
    """Keys and values [B, T, K, H] in the cache's layout (see `init_cache`)."""
    k = k_btkh.transpose(0, 2, 3, 1) if key_cache_layout(cfg) == "bkhs" else k_btkh.transpose(0, 2, 1, 3)
    return k, v_btkh.transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------- forward


def default_positions(attn_mask_bt):
    """Positions that skip padding: cumsum(mask) - 1, clipped at 0 (left or right padding)."""
    return jnp.maximum(jnp.cumsum(attn_mask_bt.astype(jnp.int32), axis=-1) - 1, 0)


def hidden_states(cfg: ModelConfig, params: Params, tokens_bt, positions_bt=None, attn_mask_bt=None,
                  cache: Cache | None = None, *, remat: bool = False, unroll: bool = False,
                  rope_cos_sin=None, kv_attend=None, segment_ids_bt=None, return_routes: bool = False):
    """Final-normed hidden states [B, T, D] in the compute dtype and the updated cache (None
    without one). With a cache, `return_routes` also returns an MoE model's routes of this chunk,
    int32 [L, B, T, k] (what the sampler records for routing replay; `rljax.models.moe`), L
    being its sparse layers (`rljax.models.mlp_kinds`).

    Mixed precision: the residual stream, norms, activations and every matmul's accumulator and
    result are f32; only matmul operands (and the KV cache) are in the compute dtype. The
    sampler's decode step and the trainer's full-sequence forward reduce in different orders (a
    row-count-dependent reduction in a norm, a softmax over a different number of slots), so
    they differ in the last f32 bits. Rounding every intermediate to bf16, as an all-bf16 stream
    does, turns each such difference into a whole bf16 ulp (2^-8, relative) whenever it straddles
    a rounding boundary, at every op of every layer, and the ulps compound; keeping the stream in
    f32 leaves only the operand roundings, where a last-bit difference flips a bf16 ulp rarely
    (with probability about 2^-16 per element). It is the choice of bf16 autocast (f32 master
    activations) and costs no measurable time on CPU; numbers in BENCHMARKS.md.

    Without a cache the layers run as one `lax.scan` (compiles once for any depth); `unroll=True`
    unrolls it, which removes the scan's stacked per-layer residuals (zero-filled and copied in
    and out of the loop) at the price of compile time growing with depth.
    `remat` (True / "full", "selective", False / "none": `rljax.models.remat`) recomputes each
    layer's activations, or its elementwise work only, in the backward pass. `rope_cos_sin`, a
    `rope_table(cfg, P)` with P above every position in `positions_bt`, replaces computing cos and
    sin (gathered instead; bitwise the same values).
    `kv_attend(layer_cache, window, positions_bt, q, k, v) -> (out_btnh f32, new layer_cache)`, with
    `cache` a tuple of per-layer caches, replaces the cache write and `cached_attention`: the paged
    layout (`rljax.sampling.paged`) stores keys in pages and attends with a paged kernel.
    `segment_ids_bt` (int [B, T], cache-free only) packs several sequences into each row: a token
    attends only within its own segment id, and `positions_bt` should restart at each segment
    (`rljax.update.packing` builds both).
    """
    b, t = tokens_bt.shape
    dt = cfg.compute_jnp_dtype
    if attn_mask_bt is None:
        attn_mask_bt = jnp.ones((b, t), bool)
    attn_mask_bt = attn_mask_bt.astype(bool)
    if positions_bt is None:
        positions_bt = default_positions(attn_mask_bt)
    positions_bt = positions_bt.astype(jnp.int32)
    if cache is None and rope_cos_sin is None and (mesh := context_mesh()) is not None:  # context parallelism
        return _context_sequence(cfg, params, mesh, tokens_bt, positions_bt, attn_mask_bt, segment_ids_bt,
                                 remat=remat, unroll=unroll), None
    if cache is None:
        h, _, _ = _full_sequence(cfg, params, tokens_bt, positions_bt, attn_mask_bt, remat=remat, unroll=unroll,
                                 rope_cos_sin=rope_cos_sin, return_kv=False, segment_ids_bt=segment_ids_bt)
        return h, None
    if segment_ids_bt is not None:
        raise ValueError("segment_ids_bt (packed rows) is for the cache-free forward only")
    h = _embed(cfg, params, tokens_bt)
    new_pos_bt = jnp.where(attn_mask_bt, positions_bt, -1)
    windows = cfg.layer_windows()
    rope_btih = rope_tables(positions_bt, cfg, rope_cos_sin)

    kinds = layer_kinds(cfg)
    if kv_attend is not None:  # the caller stores and reads keys (see the docstring)
        new_layers = []
        for lp, lc, window, kind in zip(unstack_layers(params, cfg)["layers"], cache, windows, kinds):
            attend = lambda q, k, v, lc=lc, window=window: kv_attend(lc, window, positions_bt, q, k, v)
            h, lc_new, _ = block(h, lp, attend, rope_btih, cfg, mlp_of_kind(kind))
            new_layers.append(lc_new)
        return rms_norm(h, params["final_norm"], cfg).astype(dt), tuple(new_layers)

    # Cached path: write this chunk's keys at slots [index, index + T), attend over all slots.
    # `index` is a scalar (every row writes at the same slot) or [B] (each row at its own slot, as
    # the continuous scheduler's rows are at different lengths): then the writes are per-row
    # `dynamic_update_slice`s, a scatter of T slots per row.
    # A one-token step runs the decode kernel where `model.decode_attention` picks it: over each
    # row's valid slots [first key, index + 1), contiguous in every cache the samplers build.
    index = cache["index"]
    write = _cache_writer(index)
    k_pos_bs = write(cache["pos"], new_pos_bt, 1)
    axes, layout = cache_slot_axes(cfg), key_cache_layout(cfg)
    kernel = t == 1 and resolve_decode_attention(cfg) == "pallas"
    if kernel:
        start_b, end_b = valid_range(k_pos_bs, index + 1)
    layer_params = unstack_layers(params, cfg)["layers"]
    new_layers, routes = [], []
    for lp, lc, window, kind in zip(layer_params, cache["layers"], windows, kinds):
        def attend(q, k, v, lc=lc, window=window):
            k, v = to_cache_layout(cfg, k, v)
            if is_fp8_cache(lc):  # FP8 keys and values with per-slot scales (`rljax.models.fp8`)
                return fp8_cache_attend(cfg, lc, q, k, v, write, axes, layout, positions_bt, k_pos_bs, window,
                                        (start_b, end_b) if kernel else None)
            ck = write(lc["k"], k.astype(lc["k"].dtype), axes["k"])
            cv = write(lc["v"], v.astype(lc["v"].dtype), axes["v"])
            if kernel:
                out = decode_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), start_b, end_b, cfg)
            else:
                out = cached_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), positions_bt, k_pos_bs, window,
                                       cfg, layout)
            return out, {"k": ck, "v": cv}
        h, lc_new, aux = block(h, lp, attend, rope_btih, cfg, mlp_of_kind(kind))
        new_layers.append(lc_new)
        if aux is not None:  # the sparse layers' routes: a dense layer routes nothing
            routes.append(aux.routes_btk)
    new_cache = {"layers": tuple(new_layers), "pos": k_pos_bs, "index": index + t}
    if return_routes:
        return rms_norm(h, params["final_norm"], cfg).astype(dt), new_cache, jnp.stack(routes)
    return rms_norm(h, params["final_norm"], cfg).astype(dt), new_cache


def hidden_states_and_routes(cfg: ModelConfig, params: Params, tokens_bt, positions_bt=None, attn_mask_bt=None, *,
                             routes_lbtk=None, remat=False, unroll: bool = False, segment_ids_bt=None,
                             rope_cos_sin=None):
    """The cache-free `hidden_states` (the same computation) together with an MoE model's routing:
    (h_btd, `rljax.models.moe.MoEAux` stacked over layers, [L, B, T, ...], or None for a dense
    model). `rope_cos_sin`: see `hidden_states`. `routes_lbtk` (int [L, B, T, k],
    e.g. the sampler's record) replays those routes: every layer computes each token with the
    recorded experts, gated by its own router's probabilities at them (routing replay)."""
    b, t = tokens_bt.shape
    attn_mask_bt = jnp.ones((b, t), bool) if attn_mask_bt is None else attn_mask_bt.astype(bool)
    positions_bt = default_positions(attn_mask_bt) if positions_bt is None else positions_bt
    if cfg.moe is None and rope_cos_sin is None and (mesh := context_mesh()) is not None:  # context parallelism
        return _context_sequence(cfg, params, mesh, tokens_bt, positions_bt.astype(jnp.int32), attn_mask_bt,
                                 segment_ids_bt, remat=remat, unroll=unroll), None
    h, _, aux = _full_sequence(cfg, params, tokens_bt, positions_bt.astype(jnp.int32), attn_mask_bt, remat=remat,
                               unroll=unroll, rope_cos_sin=rope_cos_sin, return_kv=False, segment_ids_bt=segment_ids_bt,
                               routes_lbtk=None if routes_lbtk is None else routes_lbtk.astype(jnp.int32))
    return h, aux


def _context_sequence(cfg: ModelConfig, params: Params, mesh, tokens_bt, positions_bt, attn_mask_bt, segment_ids_bt,
                      *, remat, unroll: bool):
    """The cache-free forward under a `context` mesh axis of C devices: the rows are padded to a
    multiple of 2C slots (padding is masked), permuted into zig-zag order (each device's share of
    every row balanced for causal attention), run with `context_attention`, and the hidden states
    permuted back and unpadded: the same values as the one-device forward, in the callers' order."""
    degree = mesh.shape[CONTEXT_AXIS]
    t = tokens_bt.shape[1]
    pad = lambda x: zigzag(jnp.pad(x, ((0, 0), (0, padded_length(t, degree) - t))), degree)
    seg = None if segment_ids_bt is None else pad(segment_ids_bt.astype(jnp.int32))
    h = _full_sequence(cfg, params, pad(tokens_bt), pad(positions_bt), pad(attn_mask_bt), remat=remat, unroll=unroll,
                       rope_cos_sin=None, return_kv=False, segment_ids_bt=seg, context=mesh)[0]
    return unzigzag(h, degree)[:, :t]


def _embed(cfg: ModelConfig, params: Params, tokens_bt):
    h = embed_tokens(cfg, params, tokens_bt)
    if cfg.scale_embeddings:
        # Gemma rounds the scale to the compute dtype (as HF does): sqrt(D) in bf16
        h = h * jnp.asarray(np.sqrt(cfg.hidden_size), cfg.compute_jnp_dtype).astype(jnp.float32)
    return h


def _full_sequence(cfg: ModelConfig, params: Params, tokens_bt, positions_bt, attn_mask_bt, *, remat: bool,
                   unroll: bool, rope_cos_sin, return_kv: bool, segment_ids_bt=None, context=None, routes_lbtk=None):
    """The cache-free forward: every layer in one `lax.scan`, attention by `resolve_attention`.

    For cuDNN, whose mask is per-row lengths, the rows are rolled left once so each row's real
    tokens start at slot 0 (`rljax.models.attention` explains the contract), and the outputs are
    rolled back, so callers see their own slot order. Returns the final-normed hidden states,
    with `return_kv` each layer's keys and values stacked, [L, B, T, K, H] in the compute dtype
    (else None), and the MLPs' aux stacked over layers (an MoE model's `MoEAux`, [L, B, T, ...],
    L its sparse layers; None for a dense model). `routes_lbtk` (int [L, B, T, k], the same L)
    replays those expert routes."""
    dt = cfg.compute_jnp_dtype
    impl = "context" if context is not None else resolve_attention(cfg)
    shift_b, lengths_b = align_rows(attn_mask_bt)
    packed = segment_ids_bt is not None
    # Kernels' segment ids: padding 0, real tokens 1 (or a packed row's segment id + 1).
    segments_bt = jnp.where(attn_mask_bt, segment_ids_bt + 1, 0) if packed else attn_mask_bt.astype(jnp.int32)
    if impl == "cudnn":
        tokens_bt, positions_bt, attn_mask_bt, segments_bt = (
            roll_rows(x, shift_b) for x in (tokens_bt, positions_bt, attn_mask_bt, segments_bt))
    rows = {"q_pos_bt": positions_bt, "k_pos_bt": jnp.where(attn_mask_bt, positions_bt, -1),
            "lengths_b": lengths_b, "segments_bt": segments_bt, "packed_bt": segments_bt if packed else None}
    rope_btih = rope_tables(positions_bt, cfg, rope_cos_sin)
    windows = cfg.layer_windows()
    attend_layer = fresh_attention(impl, windows, cfg) if context is None else context_attention(context, cfg)

    def scan_body(mlp):
        def body(h, xs):
            lp, window, routes_btk = xs
            attend = lambda q, k, v: (attend_layer(q, k, v, window, rows), (k, v) if return_kv else None)
            h, kv, aux = block(h, lp, attend, rope_btih, cfg, mlp, routes_btk)
            return h, (kv, aux)
        return remat_layer(body, remat)  # none, selective or full (`rljax.models.remat`)

    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        layers = stack_layer_list(cfg, layers)
    h0 = _embed(cfg, params, tokens_bt)
    if context is None:  # the context path places its own rows (`_context_sequence`)
        h0 = pin_rows(h0)  # inside an update's trace only (`rljax.models.row_pinning`)
    if is_mixed(cfg):
        h, kv, aux = _segmented_scan(cfg, scan_body, h0, layers, windows, routes_lbtk, return_kv, unroll)
    else:  # one kind of MLP: one scan over every layer
        h, (kv, aux) = jax.lax.scan(scan_body(layer_mlp(cfg)), h0,
                                    (layers, jnp.asarray(windows, jnp.int32), routes_lbtk), unroll=bool(unroll))
    h = rms_norm(h, params["final_norm"], cfg).astype(dt)
    if impl == "cudnn":
        h = roll_rows(h, -shift_b)
        unroll_rows = lambda x_lbt: jax.vmap(roll_rows, in_axes=(0, None))(x_lbt, -shift_b)
        kv, aux = jax.tree.map(unroll_rows, kv), jax.tree.map(unroll_rows, aux)
    return h, kv, aux


def _segmented_scan(cfg: ModelConfig, scan_body, h, layers, windows, routes_lbtk, return_kv: bool, unroll):
    """A stack of dense and MoE layers: one `lax.scan` per run of one MLP kind
    (`rljax.models.mlp_kinds` gives the layout and the reason); the keys and values concatenated
    over every layer, the routing over the sparse layers only. Returns (h, kv, aux)."""
    kvs, auxes = [], []
    for seg in segments(cfg):
        n, moe = seg.stop - seg.start, seg.kind == "moe"
        routes = routes_lbtk[seg.row:seg.row + n] if moe and routes_lbtk is not None else None
        xs = (segment_layers(layers, seg), jnp.asarray(windows[seg.start:seg.stop], jnp.int32), routes)
        h, (kv, aux) = jax.lax.scan(scan_body(mlp_of_kind(seg.kind)), h, xs, unroll=bool(unroll))
        kvs.append(kv)
        if moe:
            auxes.append(aux)
    concat = lambda *xs: jnp.concatenate(xs, axis=0)
    return h, (jax.tree.map(concat, *kvs) if return_kv else None), jax.tree.map(concat, *auxes)


def prefill_cache(cfg: ModelConfig, params: Params, tokens_bt, attn_mask_bt, positions_bt=None, *,
                  return_routes: bool = False):
    """A prompt's forward pass through the cache-free path (so its attention is the fused kernel
    where one serves), returning (hidden states [B, P, D], a KV cache of exactly P slots holding
    its keys and values, index P): what `hidden_states` with an empty P-slot cache returns, with
    the attention of the training forward instead of `cached_attention`. `return_routes` appends
    an MoE model's routes of the prompt, int32 [L, B, P, k] (the sampler's record for routing replay)."""
    p = tokens_bt.shape[1]
    attn_mask_bt = attn_mask_bt.astype(bool)
    positions_bt = default_positions(attn_mask_bt) if positions_bt is None else positions_bt.astype(jnp.int32)
    h, (k_lbtkh, v_lbtkh), aux = _full_sequence(cfg, params, tokens_bt, positions_bt, attn_mask_bt, remat=False,
                                                unroll=False, rope_cos_sin=None, return_kv=True)
    layers = tuple(dict(zip(("k", "v"), to_cache_layout(cfg, k_lbtkh[i], v_lbtkh[i]))) for i in range(cfg.num_layers))
    cache = {"layers": layers, "pos": jnp.where(attn_mask_bt, positions_bt, -1), "index": jnp.asarray(p, jnp.int32)}
    return (h, cache, aux.routes_btk) if return_routes else (h, cache)


def _cache_writer(index):
    """fn(buffer, update, slot_axis): `update` written into `buffer` at slot `index` (scalar) or at
    each row's own slot (`index` [B])."""
    if jnp.ndim(index) == 0:
        def write(buf, x, axis):
            return jax.lax.dynamic_update_slice_in_dim(buf, x, index, axis)
        return write

    def write(buf, x, axis):
        row = lambda b, u, i: jax.lax.dynamic_update_slice_in_dim(b, u, i, axis - 1)
        return jax.vmap(row)(buf, x, index)
    return write


def output_embedding(cfg: ModelConfig, params: Params):
    """The [V, D] matrix the logits are computed against: the tied embedding or the LM head (an
    adapted head merged with its LoRA delta; a tied head keeps the base embedding, as in PEFT)."""
    w_vd = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    return w_vd.output_matrix() if is_adapted(w_vd) else w_vd


def logits_from_hidden(cfg: ModelConfig, params: Params, h_btd):
    """Vocabulary logits in f32: h @ W^T with W the tied embedding or the LM head."""
    w_vd = output_embedding(cfg, params)
    b, t, d = h_btd.shape
    logits = jax.lax.dot_general(h_btd.reshape(b * t, d), w_vd.astype(h_btd.dtype), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32).reshape(b, t, -1)
    return softcap(logits, cfg.final_logit_softcap)


def forward(cfg: ModelConfig, params: Params, tokens_bt, positions_bt=None, attn_mask_bt=None,
            cache: Cache | None = None, *, remat: bool = False, unroll: bool = False,
            rope_cos_sin=None, kv_attend=None):
    """Pure forward pass: (params, tokens, positions, mask, cache) -> (logits_btv f32, new cache).

    `attn_mask_bt` marks real tokens (False for padding); `positions_bt` defaults to
    cumsum(mask) - 1. With a cache the tokens are appended at `cache['index']`. `rope_cos_sin`,
    `kv_attend`: see `hidden_states`.
    """
    h, new_cache = hidden_states(cfg, params, tokens_bt, positions_bt, attn_mask_bt, cache, remat=remat,
                                 unroll=unroll, rope_cos_sin=rope_cos_sin, kv_attend=kv_attend)
    return logits_from_hidden(cfg, params, h), new_cache
