"""FP8 rollout weights: the sampler's layer matmul weights rounded to float8_e4m3fn with one scale
per output channel, refreshed from the trainer's weights at every weight sync.

    scale_c = max_{i in c} |W_ic| / 448           (448: e4m3fn's largest finite value)
    Q_ic    = round_e4m3(W_ic / scale_c)          (round to nearest, ties to even: a cast)
    W~_ic   = Q_ic * scale_c                      what the sampler multiplies by

Per-channel rather than per-tensor: a channel's error is then relative to its own largest weight,
which is what a column of the output sees. The scales apply to the matmul's output (y_c = scale_c
* sum_i x_i Q_ic), so a kernel can multiply FP8 operands and scale after.

Which FP8 path. XLA's FP8 GEMM rewrite on Hopper wants both operands in FP8 (W8A8), so there
are two forms, one `SampleControls.weight_dtype` value each:

- "fp8": weight-only, emulated. The sampler holds W~ in the compute dtype (`fp8_sampler_params`),
  so every backend runs the arithmetic of an FP8 weight kernel that dequantises inside. It
  reproduces the rollout mismatch of FP8 weights but moves bf16 bytes: no faster.
- "fp8_w8a8": the real FP8 matmul. The sampler holds `rljax.models.fp8.Fp8Weight`s (e4m3 values,
  f32 channel scales: half the weight bytes) and quantises each activation row at each call; the
  dot's operands are both float8_e4m3fn (`Fp8Weight.project`), what a Hopper GPU runs as an FP8
  GEMM. It adds the activations' rounding to the weights', so its mismatch is larger.

A separate `fp8_matmul` switch beside weight_dtype would leave combinations that mean nothing
(W8A8 of model-dtype weights); one value per recipe keeps the choice in one field. The trainer
stays in its own dtypes.

The embedding and the LM head stay in their dtype (vLLM's default for FP8 checkpoints: the head
decides the log-probs, and quantising it adds most of the mismatch for the least bandwidth at
large batch). Norms and biases stay too. Only the dense layer weights are quantised; MoE experts
and adapters pass through unchanged.

The mismatch shows in `update/logp_diff_*`; correct it with token-level TIS (docs/api/sampling.md).
"""

from __future__ import annotations

import jax

from rljax.models.fp8 import E4M3_MAX, Fp8Weight, dequantize_fp8, quantize_fp8

__all__ = ["E4M3_MAX", "LAYER_WEIGHTS", "dequantize_fp8", "quantize_fp8", "fp8_sampler_params",
           "w8a8_sampler_params", "sampler_params"]

# Stacked layer weights [L, ...] and the axes each contracts over (its input axes): the rest are
# output channels, each with its own scale.
LAYER_WEIGHTS = {"q": (1,), "k": (1,), "v": (1,), "o": (1, 2), "gate": (1,), "up": (1,), "down": (1,)}


def fp8_sampler_params(params):
    """The sampler's copy of `params` with every dense layer weight (`LAYER_WEIGHTS`, stacked or
    already split per layer) replaced by its FP8 round trip, in its own dtype; everything else
    (embedding, LM head, norms, biases) is the trainer's."""
    return _map_layer_weights(params, lambda w, axes: dequantize_fp8(*quantize_fp8(w, axes), w.dtype))


def w8a8_sampler_params(params):
    """The sampler's W8A8 copy of `params` (`weight_dtype = "fp8_w8a8"`): every dense layer weight
    (`LAYER_WEIGHTS`) replaced by an `Fp8Weight` (float8_e4m3fn values and f32 per-output-channel
    scales: about half the bytes of bf16), which `rljax.models.layers.project` multiplies as an FP8
    x FP8 matmul with per-row activation scales (`rljax.models.fp8`). Embedding, LM head, norms
    and biases are the trainer's."""
    return _map_layer_weights(params, Fp8Weight.quantize)


def sampler_params(params, weight_dtype: str):
    """The weights the sampler multiplies by for `SampleControls.weight_dtype` (traceable)."""
    if weight_dtype == "fp8":
        return fp8_sampler_params(params)
    if weight_dtype == "fp8_w8a8":
        return w8a8_sampler_params(params)
    return params


def _map_layer_weights(params, fn):
    """`params` with fn(w, input axes) applied to each `LAYER_WEIGHTS` weight, stacked [L, ...] or
    already split per layer."""
    layers = params["layers"]

    def round_trip(name, w, stacked: bool):
        if name not in LAYER_WEIGHTS or not hasattr(w, "dtype"):
            return w
        return fn(w, LAYER_WEIGHTS[name] if stacked else tuple(a - 1 for a in LAYER_WEIGHTS[name]))

    if isinstance(layers, dict):
        new_layers = {name: round_trip(name, w, True) for name, w in layers.items()}
    else:  # split per layer (`rljax.models.unstack_layers`)
        new_layers = type(layers)({name: round_trip(name, w, False) for name, w in lp.items()} for lp in layers)
    return dict(params, layers=new_layers)


fp8_sampler_params_jit = jax.jit(fp8_sampler_params)
sampler_params_jit = jax.jit(sampler_params, static_argnames=("weight_dtype",))
