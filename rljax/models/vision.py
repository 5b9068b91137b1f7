"""The Qwen2.5-VL vision tower: an encoder whose merged patch embeddings the decoder consumes.

    patches [Np, C*Tp*P*P]  --patch embed-->  x [Np, Dv]
    x = x + proj(attend_within_segment(rope2d(q), rope2d(k), v))     per block, RMSNorm pre-norms
    x = x + down(silu(gate(norm(x))) * up(norm(x)))                   (SwiGLU with biases)
    merged [Np/4, Do] = fc2(gelu(fc1(concat_2x2(ln_q(x)))))           the 2x2 patch merger

Qwen2.5-VL (Bai et al., 2025), "Qwen2.5-VL Technical Report": a ViT over 14x14 patches of two
frames (an image is its own frame twice), 2D rotary embeddings (half the rotary frequencies
rotate by the patch row, half by its column), window attention in most blocks (a patch attends
to the patches of its own window of `window_size` pixels per side) and full attention over the
image in the blocks `fullatt_block_indexes` names, then a merger that concatenates each 2x2
block of neighbouring patches (consecutive in the processor's patch order) into one token of the
language model's width.

Windows here are a segment mask, not a permutation: HF reorders the patches window by window
and attends over contiguous runs (`cu_seqlens`), then undoes the order after the merger.
Attention without a causal mask is equivariant to that reorder, so attending with a mask "same
image, same frame, same window" gives the same numbers without moving any patch. The host
computes each patch's (row, column, image segment, window segment) once in NumPy
(`patch_layout`), so the tower is one jitted function of fixed shapes; padding patches (segment
-1) only see each other and their merged rows are dropped by the caller.

Params (Lv blocks stacked, as in `rljax.models.transformer`): patch_embed [C*Tp*P*P, Dv];
blocks/norm1, norm2 [Lv, Dv]; blocks/qkv [Lv, Dv, 3, Nv, Hv], qkv_bias [Lv, 3, Nv, Hv];
blocks/proj [Lv, Nv, Hv, Dv], proj_bias [Lv, Dv]; blocks/gate, up [Lv, Dv, Fv] (+ _bias [Lv, Fv]);
blocks/down [Lv, Fv, Dv] (+ down_bias [Lv, Dv]); merger/ln_q [Dv], fc1 [4Dv, 4Dv], fc1_bias,
fc2 [4Dv, Do], fc2_bias [Do].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rljax.errors import ConfigError
from rljax.models.layers import project
from rljax.models.remat import remat_layer

# the query chunk of the tower's chunked attention (`chunked_segment_attention`): scores of
# Nv x 256 x Np f32 at a time (16 MiB per 1,024-patch image at Qwen2.5-VL's 16 heads)
ATTENTION_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Architecture of a Qwen2.5-VL vision tower (HF `vision_config`)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0
    tokens_per_second: int = 4
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"vision hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a "
                              "multiple of 4 (2D rotary over rows and columns)")
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ConfigError(f"vision window_size={self.window_size} must be a multiple of patch_size x "
                              f"spatial_merge_size = {self.patch_size * self.spatial_merge_size}")
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    def full_attention_blocks(self) -> tuple[bool, ...]:
        return tuple(i in self.fullatt_block_indexes for i in range(self.depth))

    def num_params(self) -> int:
        d, f, m = self.hidden_size, self.intermediate_size, self.merge_unit * self.hidden_size
        per_block = 2 * d + 3 * d * d + 3 * d + d * d + d + 3 * d * f + 2 * f + d
        return self.patch_dim * d + self.depth * per_block + d + m * m + m + m * self.out_hidden_size + \
            self.out_hidden_size


@struct.dataclass
class PatchLayout:
    """Where each patch of a batch of images sits (host-built by `patch_layout`; all [Np]).

    `hw_n2`: its (row, column) in its image's patch grid (2D rotary); `image_n`: the segment of
    full attention (one per image frame), `window_n`: the segment of window attention; -1 marks
    padding patches."""

    hw_n2: jax.Array
    image_n: jax.Array
    window_n: jax.Array


def num_merged_tokens(vcfg: VisionConfig, grid_thw) -> int:
    """Tokens the merger makes of images with patch grids `grid_thw` [I, 3]: sum t*h*w / 4."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    return int(grid.prod(axis=1).sum()) // vcfg.merge_unit


def patch_layout(vcfg: VisionConfig, grid_thw, num_patches: int | None = None) -> PatchLayout:
    """Per-patch rows, columns and attention segments of images with grids `grid_thw` [I, 3],
    in the processor's patch order (2x2 merge blocks consecutive), padded to `num_patches`.

    A window is `window_size / patch_size` patches per side, counted in merge blocks from the
    image's top-left corner; the last window of a row or column is cut short where the window
    does not divide the grid (as HF pads its window index)."""
    m = vcfg.spatial_merge_size
    win = vcfg.window_size // vcfg.patch_size // m  # window side in merge blocks
    hw, image, window = [], [], []
    next_window = 0
    for i, (t, h, w) in enumerate(np.asarray(grid_thw, np.int64).reshape(-1, 3)):
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        order = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
        r, c = order(rows), order(cols)
        windows_w = -(-(w // m) // win)
        windows_per_frame = -(-(h // m) // win) * windows_w
        win_id = (r // m // win) * windows_w + (c // m // win)
        for f in range(t):
            hw.append(np.stack([r, c], -1))
            image.append(np.full(h * w, 0) + len(image))
            window.append(win_id + next_window)
            next_window += windows_per_frame
    n = sum(len(x) for x in image)
    num_patches = n if num_patches is None else num_patches
    if num_patches < n or num_patches % vcfg.merge_unit:
        raise ValueError(f"num_patches={num_patches} must be >= {n} and a multiple of {vcfg.merge_unit}")
    pad = num_patches - n
    cat = lambda xs, shape: np.concatenate(xs + [np.full(shape, -1)]).astype(np.int32) if xs else \
        np.full(shape, -1, np.int32)
    return PatchLayout(hw_n2=np.maximum(cat(hw, (pad, 2)), 0), image_n=cat(image, (pad,)),
                       window_n=cat(window, (pad,)))


def init_vision_params(vcfg: VisionConfig, key: jax.Array, std: float = 0.02, dtype=jnp.float32):
    """Random-init tower params (normal(0, std) weights, unit norms, zero biases)."""
    L, D, N, H, F = vcfg.depth, vcfg.hidden_size, vcfg.num_heads, vcfg.head_dim, vcfg.intermediate_size
    M, O = vcfg.merge_unit * D, vcfg.out_hidden_size
    keys = iter(jax.random.split(key, 8))
    normal = lambda *shape: (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)
    zeros = lambda *shape: jnp.zeros(shape, dtype)
    blocks = {
        "norm1": jnp.ones((L, D), dtype), "norm2": jnp.ones((L, D), dtype),
        "qkv": normal(L, D, 3, N, H), "qkv_bias": zeros(L, 3, N, H),
        "proj": normal(L, N, H, D), "proj_bias": zeros(L, D),
        "gate": normal(L, D, F), "gate_bias": zeros(L, F), "up": normal(L, D, F), "up_bias": zeros(L, F),
        "down": normal(L, F, D), "down_bias": zeros(L, D),
    }
    merger = {"ln_q": jnp.ones((D,), dtype), "fc1": normal(M, M), "fc1_bias": zeros(M),
              "fc2": normal(M, O), "fc2_bias": zeros(O)}
    return {"patch_embed": normal(vcfg.patch_dim, D), "blocks": blocks, "merger": merger}


def _rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)


def vision_rope(vcfg: VisionConfig, hw_n2):
    """(cos, sin) [Np, 1, Hv] of the 2D rotary angles: frequencies theta^(-4i/Hv) for i < Hv/4,
    the first Hv/4 angles rotate by the patch row, the next Hv/4 by its column, repeated for the
    two halves of HF's rotate-half layout."""
    half = vcfg.head_dim // 2
    inv_freq = 1.0 / (vcfg.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half))
    angles = hw_n2.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)  # [Np, 2, Hv/4]
    angles = angles.reshape(angles.shape[0], -1)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _segment_attention(q_qnh, k_knh, v_knh, mask_qk):
    """softmax(q k^T / sqrt(Hv) where `mask_qk`, else -inf) v, per head: [Nq, Nv, Hv]."""
    logits = jnp.einsum("qnh,knh->nqk", q_qnh, k_knh, preferred_element_type=jnp.float32) * q_qnh.shape[-1]**-0.5
    probs = jax.nn.softmax(jnp.where(mask_qk[None], logits, -jnp.inf), axis=-1)
    return jnp.einsum("nqk,knh->qnh", probs, v_knh, preferred_element_type=jnp.float32)


def query_chunk(num_patches: int, most: int | None = None) -> int:
    """The largest divisor of `num_patches` that is at most `most` (default `ATTENTION_CHUNK`): the
    query chunk of the chunked attention."""
    most = ATTENTION_CHUNK if most is None else most
    return next(c for c in range(min(most, num_patches), 0, -1) if num_patches % c == 0)


def chunked_segment_attention(q_nnh, k_nnh, v_nnh, seg_n, chunk: int):
    """`_segment_attention` over the mask "same segment" (`seg_n` [Np]), `chunk` queries at a time,
    each chunk under `jax.checkpoint` (nothing saved): the scores [Nv, chunk, Np] live one chunk
    at a time in the forward and are recomputed in the backward, never kept for it, so the
    attention holds O(Nv x chunk x Np) bytes instead of O(Nv x Np^2) per block (the memory-efficient
    attention of Rabe and Staats, "Self-attention Does Not Need O(n^2) Memory", 2021; each query's
    softmax spans all its keys, so the numbers are the dense path's)."""
    n = q_nnh.shape[0]

    @jax.checkpoint
    def one(q_cnh, seg_c, k, v, seg):
        return _segment_attention(q_cnh, k, v, seg_c[:, None] == seg[None, :])

    qs = q_nnh.reshape(n // chunk, chunk, *q_nnh.shape[1:])
    out = jax.lax.map(lambda xs: one(xs[0], xs[1], k_nnh, v_nnh, seg_n), (qs, seg_n.reshape(n // chunk, chunk)))
    return out.reshape(q_nnh.shape)


def _block(x_nd, bp, seg_n, cos_sin, vcfg: VisionConfig, chunk: int = 0):
    """One tower block: attention within the segments `seg_n` names (with `chunk`, chunked:
    `chunked_segment_attention`), then the SwiGLU MLP."""
    h = _rms_norm(x_nd, bp["norm1"], vcfg.rms_norm_eps)
    qkv = project(h, bp["qkv"]) + bp["qkv_bias"].astype(jnp.float32)  # [Np, 3, Nv, Hv]
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    q, k = _rotate(q, *cos_sin), _rotate(k, *cos_sin)
    attn = chunked_segment_attention(q, k, v, seg_n, chunk) if chunk else \
        _segment_attention(q, k, v, seg_n[:, None] == seg_n[None, :])
    x_nd = x_nd + project(attn, bp["proj"], contract=2) + bp["proj_bias"].astype(jnp.float32)
    h = _rms_norm(x_nd, bp["norm2"], vcfg.rms_norm_eps)
    gate = project(h, bp["gate"]) + bp["gate_bias"].astype(jnp.float32)
    up = project(h, bp["up"]) + bp["up_bias"].astype(jnp.float32)
    return x_nd + project(jax.nn.silu(gate) * up, bp["down"]) + bp["down_bias"].astype(jnp.float32)


def vision_tower(vcfg: VisionConfig, vparams, pixels_np, layout: PatchLayout, *, remat: bool | str = False,
                 chunked: bool = False):
    """Merged image embeddings [Np / 4, Do] (f32) for flattened patches `pixels_np` [Np, C*Tp*P*P]
    laid out by `layout`: patch embedding, the blocks (window or full attention, per
    `fullatt_block_indexes`), the 2x2 merger. Attention is the einsum reference over all Np
    patches with a segment mask (O(Np^2) memory; fine for a forward over the image sizes RL
    prompts use). For a trained tower, `chunked` attends query chunk by query chunk and saves no
    scores (`chunked_segment_attention`, same numbers), and `remat` (`rljax.models.remat`: none,
    selective, full) recomputes each block in the backward as the decoder's layers do: the update
    (`rljax.update.vision`) sets both, so its saved activations are O(Lv x Np x Dv) per row, not
    O(Lv x Nv x Np^2)."""
    x = project(pixels_np.astype(jnp.float32), vparams["patch_embed"])
    cos_sin = vision_rope(vcfg, layout.hw_n2)
    is_full_l = jnp.asarray(vcfg.full_attention_blocks())
    chunk = query_chunk(x.shape[0]) if chunked else 0

    def body(x, xs):
        bp, is_full = xs  # a full-attention block attends within images, the others within windows
        return _block(x, bp, jnp.where(is_full, layout.image_n, layout.window_n), cos_sin, vcfg, chunk), None

    x, _ = jax.lax.scan(remat_layer(body, remat), x, (vparams["blocks"], is_full_l))
    mp = vparams["merger"]
    x = _rms_norm(x, mp["ln_q"], vcfg.rms_norm_eps).reshape(-1, vcfg.merge_unit * vcfg.hidden_size)
    x = jax.nn.gelu(project(x, mp["fc1"]) + mp["fc1_bias"].astype(jnp.float32), approximate=False)
    return project(x, mp["fc2"]) + mp["fc2_bias"].astype(jnp.float32)
