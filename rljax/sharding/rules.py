"""Partition rules: param paths -> PartitionSpecs, for every model family.

A rule names, by a regex over the "/"-joined pytree path, which dim of a tensor tensor
parallelism splits (Megatron-LM, Shoeybi et al., 2019): attention q/k/v on their head dim
(N or K) and the output projection o on N, the MLP gate/up on F and down on F, the vocabulary
on V. The split is column-then-row, so each attention/MLP block needs one all-reduce.

FSDP (ZeRO-3, Rajbhandari et al., 2020) is shape-driven, not per rule: every tensor of at least
`min_fsdp_size` elements is sharded over the `fsdp` axis on its largest remaining dim that
divides the axis size, never on the stacked layer axis L (the layer scan slices it). A tensor
that is small or has no divisible dim stays replicated: correct, and its bytes are negligible.

Expert parallelism (GShard, Lepikhin et al., 2020): a rule's `expert_dim` names the E dim of a
mixture of experts' stacked expert weights, split over the `expert` axis when the mesh has one
(`rljax.models.expert_parallel`). On such a mesh batches split over data x fsdp x expert.

Because rules match paths by suffix, any tree whose leaves carry param names gets param
layouts: optax states mirror the params tree (`mu/layers/q` has the shape of `layers/q`), and
`opt_state_shardings` derives their shardings from the params' through `optax.tree_map_params`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rljax.sharding.mesh import BATCH_AXES, axis_size

_MIN_FSDP_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class Rule:
    """`pattern` (regex searched in the path) -> split dim `tensor_dim` (negative, from the end).

    `rank` is the rank of one layer's tensor; a leaf with one more dim has a stacked leading
    layer axis, which is never sharded. `expert_dim` (negative) is split over `expert`.
    """

    pattern: str
    rank: int
    tensor_dim: int | None = None
    expert_dim: int | None = None

    def matches(self, path: str) -> bool:
        return re.search(self.pattern, path) is not None


# Shape letters as in rljax.models.transformer (per layer, without the stacked L axis).
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(r"(^|/)(embed|lm_head)$", rank=2, tensor_dim=-2),  # [V, D]: vocab parallel
    Rule(r"(^|/)q$", rank=3, tensor_dim=-2),  # [D, N, H]: split query heads
    Rule(r"(^|/)(k|v)$", rank=3, tensor_dim=-2),  # [D, K, H]: split kv heads
    Rule(r"(^|/)o$", rank=3, tensor_dim=-3),  # [N, H, D]: split input heads (row parallel)
    Rule(r"(^|/)(q_bias|k_bias|v_bias)$", rank=2, tensor_dim=-2),  # [N or K, H]
    Rule(r"(^|/)(gate|up)$", rank=2, tensor_dim=-1),  # [D, F]: column parallel
    Rule(r"(^|/)down$", rank=2, tensor_dim=-2),  # [F, D]: row parallel
    Rule(r"(^|/)(\w*norm|o_bias|value_head)$", rank=1),  # [D] or [H]: no split
    # Mixture of experts (rljax.models.moe): experts split on E (expert axis) and F (tensor).
    Rule(r"(^|/)expert_(gate|up)$", rank=3, tensor_dim=-1, expert_dim=-3),  # [E, D, F]
    Rule(r"(^|/)expert_down$", rank=3, tensor_dim=-2, expert_dim=-3),  # [E, F, D]
    Rule(r"(^|/)shared_(gate|up)$", rank=2, tensor_dim=-1),  # [D, Fs]: the shared expert, column parallel
    Rule(r"(^|/)shared_down$", rank=2, tensor_dim=-2),  # [Fs, D]: row parallel
    Rule(r"(^|/)router$", rank=2),  # [D, E]: FSDP only, never on the layer axis
    Rule(r"(^|/)shared_router$", rank=1),  # [D]
    # LoRA adapters (rljax.lora) split on tensor where their weight is, so x A B shards as x W does.
    Rule(r"(^|/)(q|k|v)/lora_b$", rank=3, tensor_dim=-2),  # [r, N or K, H]: heads
    Rule(r"(^|/)o/lora_a$", rank=3, tensor_dim=-3),  # [N, H, r]: input heads
    Rule(r"(^|/)(gate|up)/lora_b$", rank=2, tensor_dim=-1),  # [r, F]
    Rule(r"(^|/)down/lora_a$", rank=2, tensor_dim=-2),  # [F, r]
    Rule(r"(^|/)embed/lora_a$", rank=2, tensor_dim=-2),  # [V, r]: vocab
    Rule(r"(^|/)lm_head/lora_b$", rank=2, tensor_dim=-1),  # [r, V]: vocab
    Rule(r"(^|/)((q|k|v|gate|up|lm_head)/lora_a|(o|down|embed)/lora_b)$", rank=2),  # [D, r], [r, D]
    Rule(r"(^|/)value_bias$", rank=0),
)


def path_str(path) -> str:
    """'layers/q' for a pytree key path (dict keys, sequence indices and attribute names)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh, rules=DEFAULT_RULES, *, fsdp: bool = True,
             min_fsdp_size: int = _MIN_FSDP_SIZE) -> P:
    """PartitionSpec of one tensor: its rule's tensor split, then FSDP on the largest free dim."""
    ndim = len(shape)
    spec: list[Any] = [None] * ndim
    rule = next((r for r in rules if r.matches(path)), None)
    frozen = {0} if rule is not None and ndim == rule.rank + 1 else set()  # stacked layer axis
    ep = axis_size(mesh, "expert")
    if rule is not None and rule.expert_dim is not None and ep > 1 and ndim >= -rule.expert_dim:
        d = ndim + rule.expert_dim
        if d not in frozen and shape[d] % ep == 0:
            spec[d] = "expert"
    tp = axis_size(mesh, "tensor")
    if rule is not None and rule.tensor_dim is not None and tp > 1 and ndim >= -rule.tensor_dim:
        d = ndim + rule.tensor_dim
        if d not in frozen and shape[d] % tp == 0:
            spec[d] = "tensor"
    fs = axis_size(mesh, "fsdp")
    size = 1
    for s in shape:
        size *= s
    if fsdp and fs > 1 and size >= min_fsdp_size:
        free = [d for d in range(ndim) if spec[d] is None and d not in frozen and shape[d] % fs == 0]
        if free:
            spec[max(free, key=lambda d: (shape[d], -d))] = "fsdp"
    return P(*spec)


def tree_specs(tree, mesh: Mesh, rules=DEFAULT_RULES, *, fsdp: bool = True,
               min_fsdp_size: int = _MIN_FSDP_SIZE):
    """A PartitionSpec for every array leaf of `tree` (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec_for(path_str(p), tuple(x.shape), mesh, rules, fsdp=fsdp,
                              min_fsdp_size=min_fsdp_size), tree)


def named(mesh: Mesh, specs):
    """PartitionSpecs -> NamedShardings on `mesh` (NamedShardings and None pass through)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s) if isinstance(s, P) else s, specs,
                        is_leaf=lambda s: isinstance(s, P) or s is None)


def param_shardings(params, mesh: Mesh, rules=DEFAULT_RULES, *, fsdp: bool = True,
                    min_fsdp_size: int = _MIN_FSDP_SIZE):
    """NamedSharding for every param (stacked or unstacked layers, policy or value params)."""
    return named(mesh, tree_specs(params, mesh, rules, fsdp=fsdp, min_fsdp_size=min_fsdp_size))


def shard_params(params, mesh: Mesh, rules=DEFAULT_RULES, *, fsdp: bool = True):
    """Params placed on `mesh` by `rules` (an on-device transfer when they are already on device)."""
    return jax.device_put(params, param_shardings(params, mesh, rules, fsdp=fsdp))


def opt_state_shardings(tx: optax.GradientTransformation, params, param_shardings_tree, mesh: Mesh):
    """Shardings of `tx.init(params)`: every params-shaped subtree takes the params' shardings,
    every other leaf (step counts, scalars) is replicated. Computed without allocating the state."""
    abstract_state = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(tx, lambda _, s: s, abstract_state, param_shardings_tree,
                                 transform_non_params=lambda _: replicated)


def _all_batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """(data, fsdp), and `expert` after them when the mesh has that axis."""
    return BATCH_AXES + ("expert",) if "expert" in mesh.shape else BATCH_AXES


def batch_axes(mesh: Mesh, size: int) -> tuple[str, ...] | str | None:
    """The mesh axes a leading dim of `size` shards over: (data, fsdp[, expert]), else (data,
    fsdp), else data, else fsdp, else none."""
    candidates = (BATCH_AXES, "data", "fsdp")
    if "expert" in mesh.shape:
        candidates = (_all_batch_axes(mesh),) + candidates
    for axes in candidates:
        n = axis_size(mesh, axes)
        if n > 1 and size % n == 0:
            return axes
    return None


def rows_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """`rows` rows (a batch's leading dim) over `batch_axes`; replicated when no batch axis divides."""
    return NamedSharding(mesh, P(batch_axes(mesh, rows)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch (or activation) array: leading dim over data x fsdp (x expert)."""
    return NamedSharding(mesh, P(_all_batch_axes(mesh)))


def batch_shardings(batch, mesh: Mesh):
    """Per-leaf batch shardings: leading dim over data x fsdp where it divides, scalars replicated."""
    def one(x):
        if not x.shape:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P(batch_axes(mesh, x.shape[0])))
    return jax.tree.map(one, batch)


def cache_shardings(cache, mesh: Mesh):
    """KV cache (`rljax.models.init_cache`): k [B, K, H, S] and v [B, K, S, H] over batch and kv
    heads (tensor),
    pos [B, S] over batch, the write index replicated."""
    tp = axis_size(mesh, "tensor")

    def one(x):
        if x.ndim == 4:
            heads = "tensor" if tp > 1 and x.shape[1] % tp == 0 else None
            return NamedSharding(mesh, P(batch_axes(mesh, x.shape[0]), heads, None, None))
        if x.ndim >= 1:
            return NamedSharding(mesh, P(batch_axes(mesh, x.shape[0])))
        return NamedSharding(mesh, P())
    return jax.tree.map(one, cache)
