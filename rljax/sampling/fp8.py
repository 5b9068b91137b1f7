"""FP8 rollout weights: the sampler's layer matmul weights rounded to float8_e4m3fn with one scale
per output channel, refreshed from the trainer's weights at every weight sync.

    scale_c = max_{i in c} |W_ic| / 448           (448: e4m3fn's largest finite value)
    Q_ic    = round_e4m3(W_ic / scale_c)          (round to nearest, ties to even: a cast)
    W~_ic   = Q_ic * scale_c                      what the sampler multiplies by

Per-channel rather than per-tensor: a channel's error is then relative to its own largest weight,
which is what a column of the output sees. The scales apply to the matmul's output (y_c = scale_c
* sum_i x_i Q_ic), so a kernel can multiply FP8 operands and scale after.

Which FP8 path. XLA's FP8 GEMM rewrite on Hopper wants both operands in FP8 with scalar scales
(W8A8: a per-tensor activation scale too, and the per-channel weight scales on the output). This
module is the weight-only form: the sampler holds W~ in the compute dtype (`fp8_sampler_params`),
so every backend, the CPU included, runs the same arithmetic as an FP8 weight kernel that
dequantises inside (the tests emulate FP8 by casting). It reproduces the rollout *mismatch* that
FP8 sampling causes, which is what the trainer has to correct; it does not yet move fewer weight
bytes on a GPU (that needs the FP8 operands kept in the matmul: the next step). The trainer stays
in its own dtypes.

The embedding and the LM head stay in their dtype (vLLM's default for FP8 checkpoints: the head
decides the log-probs, and quantising it adds most of the mismatch for the least bandwidth at
large batch). Norms and biases stay too. Only the dense layer weights are quantised; MoE experts
and adapters pass through unchanged.

The mismatch shows in `update/logp_diff_*`; correct it with token-level TIS (docs/api/sampling.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
# Stacked layer weights [L, ...] and the axes each contracts over (its input axes): the rest are
# output channels, each with its own scale.
LAYER_WEIGHTS = {"q": (1,), "k": (1,), "v": (1,), "o": (1, 2), "gate": (1,), "up": (1,), "down": (1,)}


def quantize_fp8(w, in_axes: tuple[int, ...]):
    """(q float8_e4m3fn, scale f32 broadcastable to w): per-output-channel scales over `in_axes`."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=in_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jnp.clip(w32 / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q, scale, dtype):
    """Q * scale in `dtype`."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


def fp8_sampler_params(params):
    """The sampler's copy of `params` with every dense layer weight (`LAYER_WEIGHTS`, stacked or
    already split per layer) replaced by its FP8 round trip, in its own dtype; everything else
    (embedding, LM head, norms, biases) is the trainer's."""
    layers = params["layers"]

    def round_trip(name, w, stacked: bool):
        if name not in LAYER_WEIGHTS or not hasattr(w, "dtype"):
            return w
        axes = LAYER_WEIGHTS[name] if stacked else tuple(a - 1 for a in LAYER_WEIGHTS[name])
        return dequantize_fp8(*quantize_fp8(w, axes), w.dtype)

    if isinstance(layers, dict):
        new_layers = {name: round_trip(name, w, True) for name, w in layers.items()}
    else:  # split per layer (`rljax.models.unstack_layers`)
        new_layers = type(layers)({name: round_trip(name, w, False) for name, w in lp.items()} for lp in layers)
    return dict(params, layers=new_layers)


fp8_sampler_params_jit = jax.jit(fp8_sampler_params)
