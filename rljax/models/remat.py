"""What a layer keeps for its backward pass: the three rematerialisation modes of the trained forward.

    none       every intermediate the backward needs is saved          (most memory, no recompute)
    selective  matmul outputs saved, elementwise work recomputed       (`SELECTIVE_POLICY`)
    full       only the layer's input saved, the whole layer recomputed (least memory)

Selective remat is the policy of Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022): the matmuls are most of a layer's FLOPs and a small share of its saved
bytes, while the norms, rotary embedding, softmax, SiLU and residual adds are the reverse (cheap to
recompute, and in f32 on this model's residual stream, `rljax.models.hidden_states`). So the policy
saves every `dot_general` result (`jax.checkpoint_policies.dots_saveable`) and recomputes the
rest: the backward re-runs no matmul, and holds less than without remat. On the einsum attention
path the attention scores are a matmul output and are saved; a fused attention kernel (cuDNN)
saves its own residuals through its custom VJP.

`update.remat` takes these names, or `true` (= "full") and `false` (= "none"); `"auto"` is chosen
from the memory plan before the program is built (`rljax.plan.remat`).
"""

from __future__ import annotations

import jax

from rljax.errors import ConfigError
from rljax.models.layers import MATMUL_NAME

REMAT_MODES = ("none", "selective", "full")
# the projections' products (named in `rljax.models.layers.project`, whose custom VJP hides its
# dot from `dots_saveable`) and every other matmul (the einsum attention's scores and values)
SELECTIVE_POLICY = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_only_these_names(MATMUL_NAME), jax.checkpoint_policies.dots_saveable)


def remat_mode(remat: bool | str | None) -> str:
    """`remat` as one of REMAT_MODES: False/None -> "none", True -> "full", a mode as it is."""
    if remat is None or remat is False:
        return "none"
    if remat is True:
        return "full"
    if remat in REMAT_MODES:
        return remat
    if remat == "auto":
        raise ConfigError("update.remat='auto' is chosen from the memory plan before the update is built: "
                          "`rljax train` does it; from Python call rljax.plan.remat.choose_remat(cfg), or set "
                          "update.remat to none, selective or full")
    raise ConfigError(f"update.remat={remat!r}: choose auto, none, selective, full (or true/false)")


def remat_layer(fn, remat: bool | str | None):
    """`fn` (a layer's scan body) wrapped by `remat`'s mode: as it is, `jax.checkpoint` with the
    selective policy, or `jax.checkpoint` saving nothing inside the layer."""
    mode = remat_mode(remat)
    if mode == "none":
        return fn
    if mode == "selective":
        return jax.checkpoint(fn, policy=SELECTIVE_POLICY)
    return jax.checkpoint(fn)
