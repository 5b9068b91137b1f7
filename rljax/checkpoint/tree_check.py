"""Does a checkpoint fit the model? One-line answers naming the first mismatch.

Orbax would otherwise fail deep inside tensorstore (or, worse, restore a tree of another
structure). We compare the saved tree metadata with the template leaf by leaf, by dotted path
(``layers.q``, ``opt_state.0.mu.embed``), and the saved `ModelConfig` with the current one
field by field, before reading any array.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from rljax.errors import CheckpointError
from rljax.models import ModelConfig


def _key_name(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{dotted.path: (shape, dtype)}`` for every array leaf of a tree or of orbax tree metadata."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    specs = {}
    for path, leaf in flat:
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        specs[".".join(_key_name(p) for p in path)] = (tuple(np.shape(leaf)), np.dtype(dtype))
    return specs


def check_fits(saved_tree: Any, template: Any, item: str, where: str) -> None:
    """Raise `CheckpointError` unless `saved_tree` has exactly the leaves, shapes and dtypes of `template`."""
    saved, wanted = leaf_specs(saved_tree), leaf_specs(template)
    fix = "load it with the model and optimiser it was saved with"
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise CheckpointError(f"{where} does not fit: {item}.{missing[0]} is not in the checkpoint "
                              f"({len(missing)} missing); {fix}")
    unexpected = sorted(set(saved) - set(wanted))
    if unexpected:
        raise CheckpointError(f"{where} does not fit: the checkpoint has {item}.{unexpected[0]} that the model "
                              f"lacks ({len(unexpected)} extra); {fix}")
    for path in sorted(wanted):
        if saved[path] != wanted[path]:
            (s_shape, s_dtype), (w_shape, w_dtype) = saved[path], wanted[path]
            raise CheckpointError(f"{where} does not fit: {item}.{path} is {s_dtype}{list(s_shape)} in the "
                                  f"checkpoint but {w_dtype}{list(w_shape)} in the model; {fix}")


def model_config_from_dict(fields: dict, where: str) -> ModelConfig:
    """Rebuild a `ModelConfig` from its saved fields (JSON turned tuples into lists)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"{where} has model fields {unknown} this rljax does not know; upgrade rljax")
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def check_model_config(saved: ModelConfig, current: ModelConfig, where: str) -> None:
    """Raise `CheckpointError` naming the first field where the two model configs differ."""
    for f in dataclasses.fields(ModelConfig):
        a, b = getattr(saved, f.name), getattr(current, f.name)
        if a != b:
            raise CheckpointError(f"{where} is from another model: {f.name}={a!r} in the checkpoint but "
                                  f"{b!r} in the config; use the matching model config or a new run directory")
