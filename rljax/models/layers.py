"""The decoder layer's building blocks, as pure functions of one layer's params `lp`.

    block(h, lp, attend, rope_tables(positions, cfg), cfg)
      = h' + MLP(norm(h')),   h' = h + o(attend(rope(q(norm(h))), rope(k(norm(h))), v(norm(h))))

with the sandwich (post-)norms of Gemma 2 where `cfg.sandwich_norm`. Each piece is the paper's:
RMSNorm (Zhang & Sennrich, 2019), rotary embeddings in HF's rotate-half layout (RoFormer, Su et
al., 2021), SwiGLU (Shazeer, 2020; GeGLU for Gemma). Two carry a custom backward for memory
and speed: `_matmul` (the f32 cotangent rounded to the operands' dtype, so bf16 matmuls stay
bf16 x bf16 -> f32) and `gated_activation` (saves only gate and up). `project`, `embed_tokens`
and `is_adapted` are where a LoRA adapter (`rljax.lora.LoraWeight`) joins a weight's use.

The layer stack, KV cache and forward passes that compose them are in `rljax.models.transformer`
(which holds the params layout and the shape letters: B batch, T time, D hidden, N query heads,
K kv heads, H head dim, F MLP width); attention itself is `rljax.models.attention`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from rljax.models.config import ModelConfig, rope_attention_scale, rope_inv_freq

# Every projection's f32 product is tagged with this name: the selective remat policy
# (`rljax.models.remat`) saves it, so a layer's backward recomputes no matmul. An identity outside
# `jax.checkpoint`.
MATMUL_NAME = "matmul"


def rms_norm(x, w, cfg: ModelConfig):
    """RMSNorm (Zhang & Sennrich, 2019) in f32: x / rms(x) * w, or * (1 + w) for Gemma. Returns
    x's dtype: f32 on the residual stream (see `rljax.models.transformer.hidden_states`)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    scale = w.astype(jnp.float32) + (1.0 if cfg.norm_plus_one else 0.0)
    return (x32 * scale).astype(x.dtype)


def rope_tables(positions_bt, cfg: ModelConfig, cos_sin_ph=None):
    """(cos, sin) [B, T, 1, H] of the rotary angles at `positions_bt`, shared by every layer's
    queries and keys. With `cos_sin_ph` (from `rope_table`) the rows are gathered, not recomputed;
    a position outside the table gives NaN, so a table too short shows up in the logits."""
    if cos_sin_ph is not None and cos_sin_ph[0].ndim == 3:  # per-row tables [B, P, H] (M-RoPE: rljax.models.mrope)
        take = lambda t_bph: jnp.take_along_axis(t_bph, positions_bt[..., None], axis=1, mode="fill")[:, :, None, :]
        return tuple(take(t_bph) for t_bph in cos_sin_ph)
    if cos_sin_ph is not None:
        take = lambda t_ph: jnp.take(t_ph, positions_bt, axis=0, mode="fill")[:, :, None, :]
        return tuple(take(t_ph) for t_ph in cos_sin_ph)
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    angles_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    angles_bth = jnp.concatenate([angles_bth, angles_bth], axis=-1)[:, :, None, :]
    scale = rope_attention_scale(cfg)  # YaRN's attention temperature; 1.0 (no op) otherwise
    if scale != 1.0:
        return jnp.cos(angles_bth) * scale, jnp.sin(angles_bth) * scale
    return jnp.cos(angles_bth), jnp.sin(angles_bth)


def rope_table(cfg: ModelConfig, num_positions: int):
    """(cos, sin) [P, H] for positions 0 .. P-1: the values `rope_tables` computes, bitwise.

    For a decode loop: built once outside it and passed as `forward(..., rope_cos_sin=...)`, each
    step gathers its rows. Computed inside the step, XLA:CPU fuses the cos and sin into every
    layer's query and key fusions and evaluates them per element, once per layer and step; a
    gather from a table built once does none of that work in the loop."""
    positions_p1 = jnp.arange(num_positions, dtype=jnp.int32)[:, None]
    cos_p11h, sin_p11h = rope_tables(positions_p1, cfg)
    return cos_p11h[:, 0, 0], sin_p11h[:, 0, 0]


def rope(x_btnh, tables):
    """Rotary position embedding (RoFormer, Su et al., 2021), in the rotate-half layout of HF:
    x * cos + rotate_half(x) * sin, with `tables` from `rope_tables`."""
    cos, sin = tables
    x = x_btnh.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x_btnh.dtype)


def project(x, w, contract: int = 1, dtype=None):
    """Contracts the last `contract` axes of `x` with the first `contract` axes of `w`, as ONE
    2-D matmul over all leading rows: [B, T, in...] @ [in..., out...] -> [B, T, out...] in f32.

    Both operands are rounded to `dtype` (the compute dtype; default x's dtype) and the product is
    accumulated and returned in f32: in bf16 compute the operands are the only values rounded to
    bf16 (see `rljax.models.transformer.hidden_states` for why the result is not).

    Same math as an einsum, but folding batch and time into one row axis gives the backward pass
    a weight gradient with a single contracting axis (rows); with two (b and t), XLA:CPU first
    copies a transposed activation gradient, an extra pass over it for every weight.
    """
    if is_adapted(w):  # a weight with a LoRA adapter (rljax.lora.LoraWeight) adds its low-rank branch
        return w.project(x, contract, dtype)
    dtype = dtype or x.dtype
    lead, k_shape = x.shape[:x.ndim - contract], x.shape[x.ndim - contract:]
    k = int(np.prod(k_shape))
    y = checkpoint_name(_matmul(x.reshape(-1, k).astype(dtype), w.astype(dtype).reshape(k, -1)), MATMUL_NAME)
    return y.reshape(*lead, *w.shape[contract:])


def is_adapted(w) -> bool:
    """True for a weight that carries an adapter (`rljax.lora.LoraWeight`: a pytree with
    `project`, `lookup` and `output_matrix`) instead of being a plain array. Checked in Python at
    trace time, so a model without adapters compiles exactly as before."""
    return not isinstance(w, (jax.Array, np.ndarray))


def embed_tokens(cfg: ModelConfig, params: dict[str, Any], tokens_bt):
    """Rows of the input embedding for `tokens_bt`, [B, T, D] in f32 (with its LoRA delta when
    the embedding is adapted)."""
    w_vd = params["embed"]
    if is_adapted(w_vd):
        return w_vd.lookup(tokens_bt, cfg.compute_jnp_dtype)
    return jnp.take(w_vd, tokens_bt, axis=0).astype(jnp.float32)


@jax.custom_vjp
def _matmul(x_mk, w_kn):
    """x @ w with operands in the compute dtype, accumulated in f32 and returned in f32.

    The backward rounds the f32 cotangent to the operands' dtype (as bf16 autocast does), so all
    three matmuls of a bf16 layer run bf16 x bf16 -> f32, which XLA:CPU executes natively; left
    to autodiff, the f32 cotangent would upcast the weight and run the two backward matmuls in
    f32. For f32 inputs this is exactly autodiff's rule.
    """
    return jnp.dot(x_mk, w_kn, preferred_element_type=jnp.float32)


def _matmul_fwd(x_mk, w_kn):
    return _matmul(x_mk, w_kn), (x_mk, w_kn)


def _matmul_bwd(res, g_mn):
    x_mk, w_kn = res
    g_mn = g_mn.astype(x_mk.dtype)
    dx_mk = jax.lax.dot_general(g_mn, w_kn, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dw_kn = jax.lax.dot_general(x_mk, g_mn, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx_mk.astype(x_mk.dtype), dw_kn.astype(w_kn.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _activation(name: str, gate):
    return jax.nn.silu(gate) if name == "silu" else jax.nn.gelu(gate, approximate=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def gated_activation(gate, up, name: str, saved_dtype):
    """act(gate) * up in f32 (SwiGLU, Shazeer 2020; GeGLU for Gemma), with a backward that keeps
    only gate and up, rounded to `saved_dtype` (the compute dtype).

    Autodiff of the same expression saves every intermediate it touches (gate, up, the sigmoid,
    the activation, its derivative), each f32 [B, T, F]: in a layer scan those are five f32
    residual stacks of [L, B, T, F], the largest activations of a training step. The backward
    recomputes the activation and its derivative from the two saved inputs instead. In f32 the
    gradients are autodiff's; in bf16 compute they use the bf16-rounded gate and up, which are
    the values bf16 autocast saves for the same layer."""
    return _activation(name, gate) * up


def _gated_fwd(gate, up, name, saved_dtype):
    return gated_activation(gate, up, name, saved_dtype), (gate.astype(saved_dtype), up.astype(saved_dtype))


def _gated_bwd(name, saved_dtype, residuals, g):
    gate, up = (x.astype(jnp.float32) for x in residuals)
    act, act_vjp = jax.vjp(lambda x: _activation(name, x), gate)
    (d_gate,) = act_vjp(g * up)
    return d_gate, g * act


gated_activation.defvjp(_gated_fwd, _gated_bwd)


def dense_mlp(x_btd, lp, cfg: ModelConfig):
    """The SwiGLU (GeGLU) MLP, f32: down(act(x gate) * (x up)). MoE layers' MLP is `rljax.models.moe`."""
    dt = cfg.compute_jnp_dtype
    gate, up = project(x_btd, lp["gate"], dtype=dt), project(x_btd, lp["up"], dtype=dt)
    return project(gated_activation(gate, up, cfg.activation, dt), lp["down"], dtype=dt)


def _qkv(x_btd, lp, rope_btih, cfg: ModelConfig):
    """Queries, keys and values: projected, biased, normed and rotated in f32, then rounded to the
    compute dtype once (the dtype the KV cache stores)."""
    dt = cfg.compute_jnp_dtype
    q, k, v = (project(x_btd, lp[name], dtype=dt) for name in ("q", "k", "v"))
    if cfg.qkv_bias:
        q, k, v = (x + lp[f"{name}_bias"].astype(jnp.float32) for x, name in zip((q, k, v), "qkv"))
    if cfg.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], cfg), rms_norm(k, lp["k_norm"], cfg)
    return rope(q, rope_btih).astype(dt), rope(k, rope_btih).astype(dt), v.astype(dt)


def block(h_btd, lp, attend, rope_btih, cfg: ModelConfig, mlp=None, routes_btk=None):
    """One pre-norm block on the f32 residual stream `h_btd`; `attend(q, k, v)` supplies keys
    (fresh or from the cache). Returns (h, attend's extra, the MLP's aux).

    `mlp(x_btd, lp, cfg, routes_btk) -> (y_btd f32, aux or None)` is the layer's MLP kind
    (`rljax.models.moe.layer_mlp`: the MoE MLP, whose aux is its routing, and `routes_btk` the
    routes to replay); None is the dense SwiGLU."""
    x = rms_norm(h_btd, lp["attn_norm"], cfg)
    q, k, v = _qkv(x, lp, rope_btih, cfg)
    attn_btnh, extra = attend(q, k, v)
    attn = project(attn_btnh, lp["o"], contract=2, dtype=cfg.compute_jnp_dtype)
    if cfg.o_bias:
        attn = attn + lp["o_bias"].astype(jnp.float32)
    if cfg.sandwich_norm:
        attn = rms_norm(attn, lp["attn_post_norm"], cfg)
    h_btd = h_btd + attn
    x = rms_norm(h_btd, lp["mlp_norm"], cfg)
    mlp, aux = (dense_mlp(x, lp, cfg), None) if mlp is None else mlp(x, lp, cfg, routes_btk)
    if cfg.sandwich_norm:
        mlp = rms_norm(mlp, lp["mlp_post_norm"], cfg)
    return h_btd + mlp, extra, aux
