"""Typed configs from TOML files and `key=value` overrides.

Configs are frozen dataclasses (nested). `build(cls, mapping)` checks every key and type and
raises a one-line `ConfigError` that lists the valid choices; `apply_overrides` parses
`section.key=value` strings (values are TOML literals, or bare strings).

A numeric field declares its allowed range beside itself, `iterations: int = bounded(60, ge=0)`,
and `build` checks every given value against it before the dataclass is made, so a value out of
range is one line naming the key, the value and the range (`rl.iterations=-3 must be >= 0`),
raised at load time rather than by whichever stage first trips over it.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from rljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Bound:
    """The allowed values of a numeric setting: an interval (`ge`/`gt` below, `le`/`lt` above; an
    end left None is unbounded) plus any `also` values outside it that mean something (-1: "the
    rest"). None always passes (an optional setting left unset); a tuple passes when each item does."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple[float, ...] = ()

    def contains(self, x: float) -> bool:
        if x in self.also:
            return True
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))

    def describe(self) -> str:
        """The range as the error states it: `>= 0`, `> 0`, `in (0, 1]`, `>= 1 or -1`."""
        lo = (self.ge, "[", ">=") if self.ge is not None else (self.gt, "(", ">") if self.gt is not None else None
        hi = (self.le, "]", "<=") if self.le is not None else (self.lt, ")", "<") if self.lt is not None else None
        if lo and hi:
            text = f"in {lo[1]}{_num(lo[0])}, {_num(hi[0])}{hi[1]}"
        else:
            end = lo or hi
            text = f"{end[2]} {_num(end[0])}" if end else "any number"
        return text + "".join(f" or {_num(v)}" for v in self.also)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def bounded(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, also: tuple[float, ...] = ()):
    """A dataclass field whose numeric value must lie in the given range (see `Bound`); `build`
    refuses any other value at load time in one line."""
    return dataclasses.field(default=default, metadata={"bound": Bound(ge=ge, gt=gt, le=le, lt=lt, also=also)})


def field_bound(field: dataclasses.Field) -> Bound | None:
    """The range a field declares with `bounded`, or None."""
    return field.metadata.get("bound")


def check_bound(value: Any, bound: Bound, key: str) -> None:
    """Raises one ConfigError line when `value` (a number, None, or a nested tuple of them) lies
    outside `bound`."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            check_bound(item, bound, f"{key}[{i}]")
        return
    if isinstance(value, (int, float)) and not bound.contains(value):
        raise ConfigError(f"{key}={value!r} must be {bound.describe()}")


def _is_config(tp) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(value, opt, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            value = [value]
        elem = args[0] if args else Any
        return tuple(_coerce(v, elem, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table/dict, got {value!r}")
        return dict(value)
    if _is_config(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table of settings, got {value!r}")
        return build(tp, value, prefix=where + ".")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} must be a string")
        return value
    return value


def build(cls, mapping: dict[str, Any], prefix: str = ""):
    """Builds the frozen dataclass `cls` from a (nested) mapping, validating keys and types."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}; valid keys here: {', '.join(sorted(fields))}")
    kwargs = {name: _coerce(value, hints[name], prefix + name) for name, value in mapping.items()}
    for name, value in kwargs.items():
        bound = field_bound(fields[name])
        if bound is not None:
            check_bound(value, bound, prefix + name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from None


def to_dict(cfg) -> dict[str, Any]:
    """A config as a plain nested dict (TOML/JSON-ready; None values dropped)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        if v is not None:
            out[f.name] = v
    return out


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: treat as a string


def apply_overrides(mapping: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Applies `a.b.c=value` overrides to a nested dict (copied); values are TOML literals."""
    out = _deep_copy(mapping)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. rl.iterations=20)")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {p!r} is a value, not a section")
        node[parts[-1]] = _parse_value(text.strip())
    return out


def _deep_copy(d):
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist; see configs/ for recipes")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
