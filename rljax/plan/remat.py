"""`update.remat = "auto"`: the fastest rematerialisation mode whose memory plan fits the device.

    modes, fastest first     none  ->  selective  ->  full            (`rljax.models.remat`)
    peak(mode)               the plan's per-device peak (`rljax.plan.memory`) with update.remat=mode
    choice                   the first mode with peak(mode) <= device memory; none fits: refused

No remat runs each layer's forward once; selective remat re-runs its elementwise work (norms,
rotary, softmax, activations: a few percent of the FLOPs); full remat re-runs the whole forward
(about a third more FLOPs). Their order by speed holds on every backend, so the plan's bytes
alone decide. The device memory is `plan.device_memory_gib`, else `plan.accelerator`'s, else what
the device reports (`memory_stats()["bytes_limit"]`, `rljax.plan.accelerators.device_memory`).
A CPU reports none: there "auto" is "none", what the run did before "auto" existed.

Cost: only as many plans as modes tried, each the whole plan (`plan_memory`, what `rljax plan`
prints and `rljax train`'s memory check computes), and each cached per configuration, in this
process and in a JSON file (`$RLJAX_PLAN_CACHE`, default `~/.cache/rljax/remat_plans.json`)
keyed by a hash of everything that shapes the programs (model, update schedule, sampling, mesh,
objective, device kind, jax version): a second start with the same recipe compiles nothing to
choose. (Re-planning only the update program and carrying the one-program iteration's excess
over from the first mode, as `rljax.plan.advice` does for its candidates, under-counted selective
remat's peak by 16% on a 4-layer model: the compiler shares buffers between the stages
differently per mode.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rljax.errors import ConfigError
from rljax.models.remat import REMAT_MODES, remat_mode
from rljax.plan.accelerators import device_memory, format_gib

RunConfig = Any  # a `rljax.train.config.TrainConfig`: read here, never imported (plan sits below train)

# settings that never change a program's bytes (left out of the cache key)
_NOT_SHAPING = ("output_dir", "seed", "metrics", "checkpoint", "eval", "plan", "warm_start")
_MEMO: dict[str, dict] = {}


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """What `choose_remat` picked: `mode`, the config with `update.remat = mode`, the plan's peak
    per device for each mode it planned (bytes), the device memory it compared them with, and
    whether `update.remat` was "auto" (False: an explicit setting, kept as it is)."""

    mode: str
    cfg: RunConfig
    peaks: dict[str, int]
    limit_bytes: int | None
    device: str | None
    auto: bool
    cached: bool = False

    def line(self) -> str:
        """One line for the run log: what was chosen and why."""
        if not self.auto:
            return f"update.remat={self.mode} (set explicitly)"
        if self.limit_bytes is None:
            return ("update.remat=auto -> none: no device memory is known (a CPU reports none; set "
                    "plan.accelerator or plan.device_memory_gib to plan against one), so the fastest mode")
        planned = ", ".join(f"{m} {format_gib(b)}" for m, b in self.peaks.items())
        why = "the fastest mode, fits" if self.mode == "none" else "the fastest mode that fits"
        return (f"update.remat=auto -> {self.mode}: {why} {self.device} ({format_gib(self.limit_bytes)} per device); "
                f"plan peaks per device: {planned}" + (" (cached plan)" if self.cached else ""))


def cache_path() -> Path:
    return Path(os.environ.get("RLJAX_PLAN_CACHE") or Path.home() / ".cache" / "rljax" / "remat_plans.json")


def config_key(cfg: RunConfig, model_cfg) -> str:
    """A hash of what shapes `cfg`'s programs, `update.remat` left out."""
    import jax

    d = cfg.to_dict()
    for name in _NOT_SHAPING:
        d.pop(name, None)
    d["update"] = {**d["update"], "remat": None}
    device = jax.local_devices()[0]
    text = json.dumps([d, repr(model_cfg), jax.__version__, device.platform, device.device_kind, len(jax.devices())],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _load(key: str) -> dict:
    if key in _MEMO:
        return _MEMO[key]
    try:
        entry = json.loads(cache_path().read_text()).get(key)
    except (OSError, ValueError):
        entry = None
    _MEMO[key] = dict(entry or {"peak": {}})
    _MEMO[key]["_from_file"] = entry is not None
    return _MEMO[key]


def _store(key: str, entry: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        table[key] = {k: v for k, v in entry.items() if not k.startswith("_")}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: the choice is still made, only not remembered across processes


def _with_remat(cfg: RunConfig, mode: str) -> RunConfig:
    return dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, remat=mode))


def choose_remat(cfg: RunConfig, model_cfg=None, *, tokenizer=None, limit: tuple[int, str] | None = None,
                 one_program: bool = True) -> RematChoice:
    """`cfg` with `update.remat = "auto"` resolved to the fastest mode whose plan fits `limit`
    ((bytes per device, a name); default: the `[plan]` section's or the device's, see the module
    docstring). Any other `update.remat` is returned as it is. Raises `ConfigError`, one line
    naming the settings to change, when not even full remat fits. `one_program=False` plans the
    stages alone (`rljax plan --stages-only`: one compile fewer per mode; what a bench of the
    update step alone needs)."""
    if cfg.update.remat != "auto":
        return RematChoice(remat_mode(cfg.update.remat), cfg, {}, None, None, auto=False)
    if limit is None:
        limit = device_memory(cfg.plan.accelerator, cfg.plan.device_memory_gib)
    if limit is None:
        return RematChoice("none", _with_remat(cfg, "none"), {}, None, None, auto=True)
    limit_bytes, device = limit
    if model_cfg is None:
        from rljax.models.setup import build_tokenizer, policy_config

        tokenizer = tokenizer or build_tokenizer(cfg.model)
        model_cfg = policy_config(cfg.model, tokenizer)
    key = config_key(cfg, model_cfg) + ("" if one_program else "-stages")
    entry = _load(key)
    cached, peaks = True, {}
    for mode in REMAT_MODES:
        if mode not in entry["peak"]:
            cached = False
            _plan_mode(entry, _with_remat(cfg, mode), mode, model_cfg, tokenizer, one_program)
            _store(key, entry)
        peaks[mode] = entry["peak"][mode]
        if peaks[mode] <= limit_bytes:
            return RematChoice(mode, _with_remat(cfg, mode), peaks, limit_bytes, device, auto=True,
                               cached=cached and entry["_from_file"])
    raise ConfigError(refusal(cfg, peaks, entry, limit_bytes, device))


def plan_peaks(cfg: RunConfig, model_cfg=None, *, tokenizer=None) -> dict[str, int]:
    """The plan's peak per device for every remat mode (bytes), from the cache where it has them."""
    if model_cfg is None:
        from rljax.models.setup import build_tokenizer, policy_config

        tokenizer = tokenizer or build_tokenizer(cfg.model)
        model_cfg = policy_config(cfg.model, tokenizer)
    key = config_key(cfg, model_cfg)
    entry = _load(key)
    for mode in REMAT_MODES:
        if mode not in entry["peak"]:
            _plan_mode(entry, _with_remat(cfg, mode), mode, model_cfg, tokenizer)
            _store(key, entry)
    return dict(entry["peak"])


def _plan_mode(entry: dict, cfg: RunConfig, mode: str, model_cfg, tokenizer, one_program: bool = True) -> None:
    """Fills `entry` with `mode`'s plan peak (the whole plan, as `rljax plan` and the run's memory
    check compute it) and the sampling stage's peak, which remat does not change."""
    from rljax.plan.memory import plan_memory

    plan = plan_memory(cfg, model_cfg, tokenizer=tokenizer, one_program=one_program)
    entry["peak"][mode] = plan.peak_bytes
    entry["sampler_peak"] = plan.sampler_peak_bytes


def refusal(cfg: RunConfig, peaks: dict[str, int], entry: dict, limit_bytes: int, device: str) -> str:
    """The one line refusing a size where no remat mode fits: the peaks and the settings to change."""
    planned = ", ".join(f"{m} {format_gib(b)}" for m, b in peaks.items())
    u = cfg.update
    if entry["sampler_peak"] > limit_bytes:
        what = ("sampling binds (remat does not change it): lower rl.prompts_per_iteration, sampling.num_samples or "
                "sampling.max_new_tokens")
    elif u.packing:
        what = f"lower update.max_tokens_per_microbatch (now {u.max_tokens_per_microbatch or 'automatic'})"
    else:
        what = f"raise update.num_microbatches (now {u.num_microbatches})"
    return (f"update.remat=auto: no remat mode fits {device} ({format_gib(limit_bytes)} per device); plan peaks per "
            f"device: {planned}; {what}, put more devices on mesh.fsdp, or set model.param_dtype=bfloat16")
