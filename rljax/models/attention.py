"""Attention: the einsum reference, and the field's fused kernels behind one choice.

`model.attention` picks the implementation of full-sequence attention (training, scoring and
the sampler's prefill); `resolve_attention` turns "auto" into the backend's kernel:

    xla     the einsum reference below: any mask, soft-capping, windows, f32 or bf16. The tested
            reference for every other path, and the CPU's choice.
    cudnn   `jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN's fused flash
            attention on NVIDIA GPUs (bf16/fp16 operands only; no logit soft-capping).
    splash  JAX's Pallas splash-attention kernel for TPU (`jax.experimental.pallas.ops.tpu.
            splash_attention`), soft-capping and windows included.

Why a fused kernel: the reference materialises f32 [B, K, G, T, S] scores and probabilities per
layer (and the backward recomputes them); a flash kernel (Dao et al., 2022; FlashAttention-2,
Dao, 2023) streams key blocks through an online softmax and never holds T x S in memory.

How padding reaches the kernels. Our rows carry validity and order as positions (`k_pos < 0`
marks padding; causality is `k_pos <= q_pos`), which any mask expresses but a kernel does not
take. Rollout rows are a left-padded prompt followed by a right-padded completion: the real
tokens of a row are contiguous, with consecutive positions. So:
- cuDNN takes per-row sequence lengths (its PADDING_CAUSAL mask: keys [0, len) of each row).
  `hidden_states` rolls each row left once, before the first layer, so its real tokens start at
  slot 0 (`align_rows`), runs every layer on the aligned rows, and rolls the outputs back.
- splash takes segment ids: real tokens are segment 1, padding segment 0, with its causal mask
  in slot order (no roll). A padding query sees itself, so no softmax row is empty.
Both need each row's real tokens contiguous with consecutive positions; rows with holes (a mask
that is False between real tokens) or jumps in position need "xla", the only path that reads
positions directly. Soft-capping: splash applies it, cuDNN cannot, so "auto" keeps Gemma 2 on
XLA on a GPU and "cudnn" refuses it. Sliding windows: both kernels take a left window of
`window - 1` keys (q_pos - k_pos < window).

Decode. `model.decode_attention` picks how a one-token decode step attends over the KV cache
(`resolve_decode_attention`):

    xla     `cached_attention` below: einsums over every cache slot, with keys stored transposed,
            [B, K, H, S], so q @ K^T is a plain row-major matmul (the CPU's choice).
    pallas  JAX's Pallas GPU decode-attention kernel (`jax.experimental.pallas.ops.gpu.
            decode_attention`, split-K flash decoding: Dao et al., 2023, "Flash-Decoding"): each
            (row, kv head) reads only its valid slots [start, end), in key blocks, with an online
            softmax, and the splits are merged. Keys are then stored [B, K, S, H], like values,
            the layout the kernel reads without a transpose (`key_cache_layout`).

The kernel takes a valid range per row rather than a mask: every cache this package builds keeps
a row's valid keys contiguous (a left-padded prompt, then the decoded tokens; the continuous and
paged schedulers' views likewise), so start = the first slot with a position >= 0 and end = the
write index after this step. No soft-cap and no sliding window (the kernel has neither), so "auto"
keeps such models, and multi-token appends (multi-turn, chunked prefill), on the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rljax.errors import ConfigError
from rljax.models.config import ModelConfig

_NEG = -1e30
_SPLASH_BLOCK = 128  # splash's block (its minimum: a multiple of 128 lanes); time is padded to it


# ----------------------------------------------------------------------------- the choice


def cudnn_unsupported(cfg: ModelConfig) -> str | None:
    """Why cuDNN's fused attention cannot serve `cfg` (None when it can): it runs bf16 or fp16
    operands, head dims up to 256 in multiples of 8, and applies no logit soft-cap."""
    if cfg.compute_dtype not in ("bfloat16", "float16"):
        return f"cuDNN fused attention needs bf16/fp16 compute (model.compute_dtype={cfg.compute_dtype!r})"
    if cfg.head_dim > 256 or cfg.head_dim % 8:
        return f"cuDNN fused attention needs head_dim <= 256 and a multiple of 8 (got {cfg.head_dim})"
    if cfg.attn_logit_softcap is not None:
        return "cuDNN fused attention has no attention-logit soft-cap (Gemma 2)"
    return None


def splash_unsupported(num_devices: int | None = None) -> str | None:
    """Why "auto" does not pick splash on a TPU (None when it does): the kernel is a Pallas call,
    which XLA's partitioner does not split, so under a multi-device mesh it would run the whole
    batch on every device; it needs a `shard_map` over the batch axes, which the model function
    does not own. One device: splash."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    if num_devices > 1:
        return f"splash is not partitioned over {num_devices} devices (single-device only)"
    return None


def resolve_attention(cfg: ModelConfig, platform: str | None = None, num_devices: int | None = None) -> str:
    """The implementation full-sequence attention runs with: `cfg.attention`, or for "auto" the
    backend's kernel where it serves the model (cuDNN on GPU; splash on a single TPU device),
    else "xla". cuDNN's custom call carries JAX's partitioning rules, so it serves sharded runs.

    An explicit "cudnn" that cannot serve the model is a ConfigError naming why; "cudnn" or
    "splash" on another backend runs as asked (a test lowers the cuDNN program on a CPU host)."""
    platform = platform or jax.default_backend()
    if cfg.attention == "auto":
        if platform in ("gpu", "cuda") and cudnn_unsupported(cfg) is None:
            return "cudnn"
        return "splash" if platform == "tpu" and splash_unsupported(num_devices) is None else "xla"
    if cfg.attention == "cudnn" and (why := cudnn_unsupported(cfg)):
        raise ConfigError(f"model.attention='cudnn': {why}; use 'auto' or 'xla'")
    return cfg.attention


def pallas_decode_unsupported(cfg: ModelConfig) -> str | None:
    """Why the Pallas GPU decode kernel cannot serve `cfg` (None when it can): it has no logit
    soft-cap and no sliding window, and its blocks need a power-of-two head_dim >= 16."""
    if cfg.attn_logit_softcap is not None:
        return "the Pallas decode kernel has no attention-logit soft-cap (Gemma 2)"
    if any(cfg.layer_windows()):
        return "the Pallas decode kernel has no sliding window"
    if cfg.head_dim < 16 or cfg.head_dim & (cfg.head_dim - 1):
        return f"the Pallas decode kernel needs a power-of-two head_dim >= 16 (got {cfg.head_dim})"
    return None


def resolve_decode_attention(cfg: ModelConfig, platform: str | None = None, num_devices: int | None = None) -> str:
    """How a decode step attends over the KV cache: `cfg.decode_attention`, or for "auto" the
    Pallas kernel on a single GPU where it serves the model, else "xla" (a Pallas call is not
    partitioned: see `splash_unsupported`). An explicit "pallas" that cannot serve the model is a
    ConfigError; on a CPU it runs in Pallas interpret mode (how the tests run it)."""
    platform = platform or jax.default_backend()
    if cfg.decode_attention == "auto":
        num_devices = jax.device_count() if num_devices is None else num_devices
        ok = platform in ("gpu", "cuda") and num_devices == 1 and pallas_decode_unsupported(cfg) is None
        return "pallas" if ok else "xla"
    if cfg.decode_attention == "pallas" and (why := pallas_decode_unsupported(cfg)):
        raise ConfigError(f"model.decode_attention='pallas': {why}; use 'auto' or 'xla'")
    return cfg.decode_attention


def key_cache_layout(cfg: ModelConfig, platform: str | None = None) -> str:
    """The key cache's axis order: "bksh" (like values) for the Pallas kernel, which reads key
    blocks [block, H]; "bkhs" (transposed) for the einsum path (see `cached_attention`)."""
    return "bksh" if resolve_decode_attention(cfg, platform) == "pallas" else "bkhs"


def describe_attention(cfg: ModelConfig, platform: str | None = None) -> str:
    """One line for the run log: the implementation chosen, and why when "auto" fell back."""
    platform = platform or jax.default_backend()
    impl = resolve_attention(cfg, platform)
    line = f"attention: {impl} (model.attention={cfg.attention!r}, backend {platform})"
    if cfg.attention == "auto" and impl == "xla" and platform in ("gpu", "cuda"):
        line += f"; {cudnn_unsupported(cfg)}"
    if cfg.attention == "auto" and impl == "xla" and platform == "tpu":
        line += f"; {splash_unsupported()}"
    decode = resolve_decode_attention(cfg, platform)
    line += f"; decode: {decode} (model.decode_attention={cfg.decode_attention!r})"
    if cfg.decode_attention == "auto" and decode == "xla" and platform in ("gpu", "cuda"):
        line += f"; {pallas_decode_unsupported(cfg) or splash_unsupported().replace('splash', 'the decode kernel')}"
    return line


# ----------------------------------------------------------------------------- the reference


def softcap(x, cap):
    return x if cap is None else jnp.tanh(x / cap) * cap


def _visible_softmax(logits_bkgts, q_pos_bt, k_pos_bs, window, cfg: ModelConfig, q_seg_bt=None, k_seg_bs=None):
    """Soft-capped softmax over the keys each query may see (see `attention`), in f32."""
    logits_bkgts = softcap(logits_bkgts, cfg.attn_logit_softcap)
    dist_bts = q_pos_bt[:, :, None] - k_pos_bs[:, None, :]
    visible_bts = (k_pos_bs[:, None, :] >= 0) & (dist_bts >= 0)
    visible_bts &= (window == 0) | (dist_bts < window)
    if q_seg_bt is not None:
        visible_bts &= q_seg_bt[:, :, None] == k_seg_bs[:, None, :]
    return jax.nn.softmax(jnp.where(visible_bts[:, None, None], logits_bkgts, _NEG), axis=-1)


def attention(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, window, cfg: ModelConfig, q_seg_bt=None, k_seg_bs=None):
    """Causal grouped-query attention over key slots: q, k, v in the compute dtype, scores and
    softmax in f32, the probabilities rounded to v's dtype for the PV product (as FlashAttention
    does), the output accumulated and returned in f32.

    A key is visible to a query when it is valid (position >= 0), not in the query's future
    (k_pos <= q_pos), for sliding layers q_pos - k_pos < window, and, with segment ids (packed
    rows, whose positions restart in each segment), in the query's own segment. Positions rather
    than slot indices carry causality, so left padding and caches work without extra bookkeeping.
    """
    b, t, n, h = q_btnh.shape
    kh = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, kh, n // kh, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh,
                        preferred_element_type=jnp.float32) * cfg.query_scale
    probs = _visible_softmax(logits, q_pos_bt, k_pos_bs, window, cfg, q_seg_bt, k_seg_bs).astype(v_bskh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h)


# For training: the backward pass recomputes the [B, K, G, T, S] scores and probabilities from q
# and k instead of storing them for every layer, so the saved activations hold no T^2 tensor per
# layer (the idea of FlashAttention's backward, Dao et al., 2022). Recomputing costs 2 T^2 H N
# flops per row, small next to the projections at these lengths; the gradients are bitwise equal.
attention_recomputed = jax.checkpoint(attention, static_argnums=(6,))

# Rows longer than this attend in query chunks of this many (`attention_query_chunked`).
QUERY_CHUNK = 2048


def attention_query_chunked(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, window, cfg: ModelConfig, q_seg_bt=None,
                            k_seg_bs=None, chunk: int = QUERY_CHUNK):
    """`attention_recomputed` over chunks of `chunk` queries in a `lax.map` (each against every
    key), so a layer holds [B, K, G, chunk, S] scores, never [T, T], forward or backward (each
    chunk rematerialised): the reference for long rows. Each query's softmax is over the same
    keys, so the values are the unchunked reference's. Queries are zero-padded to a whole chunk
    (their outputs dropped)."""
    b, t = q_btnh.shape[:2]
    pad = (-t) % chunk

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(b, -1, chunk, *x.shape[2:]).swapaxes(0, 1)

    xs = (split(q_btnh), split(q_pos_bt)) + (() if q_seg_bt is None else (split(q_seg_bt),))
    run = lambda x: attention_recomputed(x[0], k_bskh, v_bskh, x[1], k_pos_bs, window, cfg,
                                         x[2] if len(x) > 2 else None, k_seg_bs)
    out = jax.lax.map(run, xs)  # [n, B, chunk, N, H]
    return out.swapaxes(0, 1).reshape(b, -1, *out.shape[3:])[:, :t]


def reference_attention(q_btnh, *args, **kwargs):
    """The reference path for a full sequence: `attention_recomputed`, in query chunks for rows
    longer than `QUERY_CHUNK` (no [T, T] scores)."""
    impl = attention_query_chunked if q_btnh.shape[1] > QUERY_CHUNK else attention_recomputed
    return impl(q_btnh, *args, **kwargs)


def cached_attention(q_btnh, k_cache, v_bksh, q_pos_bt, k_pos_bs, window, cfg: ModelConfig, key_layout="bkhs"):
    """`attention` over a KV cache that stores keys transposed, [B, K, H, S], and values as
    [B, K, S, H]: both einsums are then plain row-major batched matmuls over (b, k) (q @ K^T reads
    keys with slots contiguous), so neither transposes the cache, the big operand, per step.
    Stored [B, K, S, H] (`key_layout="bksh"`, the Pallas kernel's layout), keys are read
    transposed by q @ K^T: how a multi-token append attends in that layout."""
    b, t, n, h = q_btnh.shape
    kh = k_cache.shape[1]
    q_bkqh = q_btnh.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, -1, h)
    spec = "bkqh,bkhs->bkqs" if key_layout == "bkhs" else "bkqh,bksh->bkqs"
    logits = jnp.einsum(spec, q_bkqh, k_cache, preferred_element_type=jnp.float32) * cfg.query_scale
    probs = _visible_softmax(logits.reshape(b, kh, n // kh, t, -1), q_pos_bt, k_pos_bs, window, cfg)
    probs = probs.astype(v_bksh.dtype).reshape(b, kh, -1, v_bksh.shape[2])
    out_bkqh = jnp.einsum("bkqs,bksh->bkqh", probs, v_bksh, preferred_element_type=jnp.float32)
    return out_bkqh.reshape(b, kh, n // kh, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


# ----------------------------------------------------------------------------- row alignment


def align_rows(valid_bt):
    """(shift_b, lengths_b) that left-align each row: rolling a row left by its shift puts its
    real tokens at slots [0, length). The shift is the index of the first real token (0 for a row
    with none)."""
    valid_bt = valid_bt.astype(bool)
    return jnp.argmax(valid_bt, axis=1).astype(jnp.int32), jnp.sum(valid_bt, axis=1, dtype=jnp.int32)


def roll_rows(x_bt, shift_b):
    """Row b of `x_bt` rolled left by shift_b[b] along axis 1 (negative: right); any trailing
    axes ride along. One gather; its transpose (for the backward) is the opposite roll."""
    t = x_bt.shape[1]
    idx_bt = (jnp.arange(t, dtype=jnp.int32)[None, :] + shift_b[:, None]) % t
    idx = idx_bt.reshape(idx_bt.shape + (1,) * (x_bt.ndim - 2))
    return jnp.take_along_axis(x_bt, idx, axis=1)


# ----------------------------------------------------------------------------- the kernels


def _interpret_here(platform: str) -> bool:
    """Whether a Pallas kernel written for `platform` ("gpu" or "tpu") must run in interpret mode
    here: off its platform. (The cuda-lowering tests replace this to emit the real kernel.)"""
    return jax.default_backend() != platform


def cudnn_attention(q_btnh, k_btkh, v_btkh, lengths_b, window: int, cfg: ModelConfig, *, segments_bt=None,
                    implementation: str = "cudnn"):
    """Causal attention over left-aligned rows through `jax.nn.dot_product_attention`: keys and
    queries [0, lengths_b) of each row are real (cuDNN's PADDING_CAUSAL mask), `window` > 0 a
    left window of window - 1 keys. Returns f32 [B, T, N, H] like `attention` (cuDNN writes
    the compute dtype; the output projection rounds to it anyway).

    Packed rows (`segments_bt`): the API takes no segment ids, so they reach cuDNN as a boolean
    [B, 1, T, T] mask (same segment), which it applies as a bias: still fused, but it reads a T^2
    mask per layer. `implementation="xla"` runs the same call through JAX's XLA implementation
    of the API: how the tests check this wrapper's masks on a CPU."""
    mask = None if segments_bt is None else (segments_bt[:, None, :, None] == segments_bt[:, None, None, :])
    # A row with no real token (a filler) attends to its first slot instead of to nothing: finite,
    # and masked out downstream, where an empty softmax could write NaN into the loss's products.
    lengths_b = jnp.maximum(lengths_b, 1)
    out = jax.nn.dot_product_attention(
        q_btnh, k_btkh, v_btkh, mask=mask, scale=cfg.query_scale, is_causal=True, query_seq_lengths=lengths_b,
        key_value_seq_lengths=lengths_b, local_window_size=(window - 1, 0) if window else None,
        implementation=implementation)
    return out.astype(jnp.float32)


@functools.lru_cache(maxsize=64)
def _splash_kernel(num_heads: int, time: int, window: int, cap, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (time, time)
    head = sm.LocalMask(shape, (window - 1, 0), offset=0) if window else sm.CausalMask(shape)
    block = _SPLASH_BLOCK
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # its mask tables are constants, built once, outside any trace
        return sk.make_splash_mha(sm.MultiHeadMask([head] * num_heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, attn_logits_soft_cap=cap, interpret=interpret)


def splash_attention(q_btnh, k_btkh, v_btkh, segments_bt, window: int, cfg: ModelConfig, *,
                     interpret: bool | None = None):
    """Causal attention through the Pallas splash kernel, one row at a time (vmap over B):
    segment ids keep segments apart (a row's real tokens are segment 1 and its padding 0, or a
    packed row's segments and its padding), the causal or local mask is in slot order,
    soft-capping is the kernel's. Queries are pre-scaled (the kernel does not scale), the
    time axis is padded to the kernel's block (padding is segment 0). Returns f32 [B, T, N, H].

    `interpret` (default: off on TPU, on elsewhere) runs the kernel in Pallas interpret mode, how
    the tests run it on a CPU."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    t, n = q_btnh.shape[1:3]
    interpret = _interpret_here("tpu") if interpret is None else interpret
    pad = (-t) % _SPLASH_BLOCK
    tp = t + pad
    seg_bt = jnp.pad(segments_bt.astype(jnp.int32), ((0, 0), (0, pad)))
    q = (q_btnh.astype(jnp.float32) * cfg.query_scale).astype(q_btnh.dtype)
    to_heads = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # [B, heads, T, H]
    kernel = _splash_kernel(n, tp, int(window), cfg.attn_logit_softcap, bool(interpret))
    row = lambda q_nth, k_kth, v_kth, seg_t: kernel(q_nth, k_kth, v_kth, segment_ids=sk.SegmentIds(q=seg_t, kv=seg_t))
    out_bnth = jax.vmap(row)(to_heads(q), to_heads(k_btkh), to_heads(v_btkh), seg_bt)
    return out_bnth.transpose(0, 2, 1, 3)[:, :t].astype(jnp.float32)


def fresh_attention(impl: str, windows: tuple[int, ...], cfg: ModelConfig):
    """attend(q, k, v, window_index, rows) for one layer of a full-sequence forward, with `rows`
    the `hidden_states` row description (positions, key positions, lengths, segment ids, and the
    packed rows' segment ids or None). A kernel
    takes a static window, so where layers differ (Gemma 2's local and global layers, scanned
    with the window as data) the layer switches between one kernel per distinct window."""
    distinct = tuple(sorted(set(windows)))

    def one(window: int):
        def run(q, k, v, rows):
            if impl == "cudnn":
                return cudnn_attention(q, k, v, rows["lengths_b"], window, cfg, segments_bt=rows["packed_bt"])
            if impl == "splash":
                return splash_attention(q, k, v, rows["segments_bt"], window, cfg)
            return reference_attention(q, k, v, rows["q_pos_bt"], rows["k_pos_bt"], window, cfg,
                                       rows["packed_bt"], rows["packed_bt"])
        return run

    def attend(q, k, v, window_index, rows):
        if impl == "xla":  # the reference takes the window as data: one program for every layer
            return reference_attention(q, k, v, rows["q_pos_bt"], rows["k_pos_bt"], window_index, cfg,
                                       rows["packed_bt"], rows["packed_bt"])
        if len(distinct) == 1:
            return one(distinct[0])(q, k, v, rows)
        branch = jnp.searchsorted(jnp.asarray(distinct, jnp.int32), window_index)
        return jax.lax.switch(branch, [one(w) for w in distinct], q, k, v, rows)

    return attend


# ----------------------------------------------------------------------------- the decode kernel


def valid_range(k_pos_bs, end_b):
    """(start_b, end_b) of each row's valid cache slots for `decode_attention`: start at the first
    slot holding a key (position >= 0), end at the write index after this step. A row with no key
    gets [0, 1): one finite, ignored output instead of an empty softmax."""
    has_b = jnp.any(k_pos_bs >= 0, axis=1)
    start_b = jnp.where(has_b, jnp.argmax(k_pos_bs >= 0, axis=1), 0).astype(jnp.int32)
    end_b = jnp.broadcast_to(jnp.asarray(end_b, jnp.int32), start_b.shape)
    return start_b, jnp.where(has_b, end_b, 1)


def _decode_split(slots: int) -> tuple[int, int, int]:
    """(padded slots, k_splits, block_k) for the Pallas decode kernel: slots padded to a multiple
    of 16 (the kernel's least block), split into up to 16 parts of >= 16 slots (Flash-Decoding's
    parallelism over the key axis), each part a whole number of blocks of up to 128 slots."""
    padded = -(-slots // 16) * 16
    splits = max(s for s in range(1, 17) if padded % s == 0 and (padded // s) % 16 == 0)
    part = padded // splits
    block = max(b for b in (16, 32, 64, 128) if part % b == 0)
    return padded, splits, block


def decode_attention(q_b1nh, k_bksh, v_bksh, start_b, end_b, cfg: ModelConfig, *, interpret: bool | None = None,
                     k_scale=None, v_scale=None):
    """One decode step's attention through the project's Pallas GPU kernel
    (`rljax.models.decode_kernel`: key splits sized by the batch, the query group in one block,
    the finished f32 output written by the kernel when one split fills the GPU): the query of each
    row attends over its cache slots [start_b, end_b) (see `valid_range`); keys and values
    [B, K, S, H]. Returns f32 [B, 1, N, H] like `cached_attention`. JAX's stock kernel,
    `decode_attention_stock`, is the reference it is tested against; `cached_attention` both's.
    `k_scale`, `v_scale` ([B, K, S, 1] f32): an FP8 cache (`rljax.models.fp8`), dequantised in the kernel."""
    from rljax.models.decode_kernel import split_decode_attention

    interpret = _interpret_here("gpu") if interpret is None else interpret
    b, _, n, h = q_b1nh.shape
    kh, s = k_bksh.shape[1], k_bksh.shape[2]
    padded = -(-s // 16) * 16
    scales = () if k_scale is None else (k_scale[..., 0], v_scale[..., 0])  # [B, K, S]
    if padded != s:  # see `decode_attention_stock`
        pad = ((0, 0), (0, 0), (0, padded - s), (0, 0))
        k_bksh, v_bksh = jnp.pad(k_bksh, pad), jnp.pad(v_bksh, pad)
        scales = tuple(jnp.pad(x, pad[:3]) for x in scales)
    out_bkgh = split_decode_attention(q_b1nh.reshape(b, kh, n // kh, h), k_bksh, v_bksh, start_b, end_b,
                                      scale=float(cfg.query_scale), interpret=bool(interpret),
                                      **dict(zip(("k_scale_bks", "v_scale_bks"), scales)))
    return out_bkgh.reshape(b, 1, n, h)


def decode_attention_stock(q_b1nh, k_bksh, v_bksh, start_b, end_b, cfg: ModelConfig, *,
                           interpret: bool | None = None):
    """One decode step's attention through JAX's stock Pallas GPU decode kernel: the query of each row
    attends over its cache slots [start_b, end_b) (see `valid_range`); keys and values [B, K, S, H].
    Returns f32 [B, 1, N, H] like `cached_attention`. A cache width that is not a multiple of the
    kernel's 16-slot block is padded every step (a copy of the cache): the samplers' widths are a
    prompt bucket plus a power-of-two new-token bucket, so keep prompt buckets multiples of 16.

    `interpret` (default: off on a GPU, on elsewhere) runs the kernel in Pallas interpret mode,
    how the tests check it against `cached_attention` on a CPU."""
    from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode

    interpret = _interpret_here("gpu") if interpret is None else interpret
    b, _, n, h = q_b1nh.shape
    kh, s = k_bksh.shape[1], k_bksh.shape[2]
    padded, splits, block = _decode_split(s)
    if padded != s:
        pad = ((0, 0), (0, 0), (0, padded - s), (0, 0))
        k_bksh, v_bksh = jnp.pad(k_bksh, pad), jnp.pad(v_bksh, pad)
    q_bkgh = q_b1nh.reshape(b, kh, n // kh, h)
    # `mqa` (one kv head, its query group, a range per row) mapped over the kv heads: the cache is
    # read in place, where `gqa` would swap [B, S, K, H] to [B, K, S, H] (a copy per step).
    one_head = functools.partial(pallas_decode.mqa, sm_scale=float(cfg.query_scale), block_k=block, k_splits=splits,
                                 interpret=bool(interpret))
    out_bkgh = jax.vmap(one_head, in_axes=(1, 1, 1, None, None), out_axes=1)(q_bkgh, k_bksh, v_bksh, start_b, end_b)
    return out_bkgh.reshape(b, 1, n, h).astype(jnp.float32)
