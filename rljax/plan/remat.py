"""`update.remat = "auto"` (and `update.num_microbatches = "auto"`): the fastest update schedule
whose memory plan fits the device.

    modes, fastest first     none  ->  selective  ->  full            (`rljax.models.remat`)
    peak(mode)               the plan's per-device peak (`rljax.plan.memory`) with update.remat=mode
    choice                   the first mode with peak(mode) <= device memory; none fits: refused

With `update.num_microbatches = "auto"` as well (with `update.packing`: `update.max_tokens_per_microbatch
= "auto"`, micro-batches of (rows / m) buffers of the row width each), the candidates are (mode, m)
pairs, m a divisor of the rows per mini-batch (`microbatch_counts`), tried in this order:

    none/1, none/2, none/4, ... , selective/1, selective/2, ... , full/1, full/2, ...

Remat mode first, then fewer micro-batches: remat's recompute grows with every token (selective a
few percent of the FLOPs, full about a third), while one more micro-batch costs one more pass over
the weights and a smaller matmul, which is cheap until the micro-batches get thin (measured on an
H200: BENCHMARKS.md, issue 53, where doubling the micro-batches cost far less than full remat).
So no remat at any micro-batch count comes before selective, and
selective before full; within a mode the fewest micro-batches (the biggest matmuls) that fit win.
Not every candidate is compiled: per mode the plan is compiled at m = 1 and m = 2, and a larger m
is first estimated from the line peak(m) = a + b / m through the two nearest planned counts (the
update's activations scale with the micro-batch rows, the state and gradient buffers do not). A
candidate the estimate rules out is skipped; one it admits is planned (compiled, cached) and kept
only if its plan fits. An explicit `update.num_microbatches` (or `update.remat`) is kept as set.

No remat runs each layer's forward once; selective remat re-runs its elementwise work (norms,
rotary, softmax, activations: a few percent of the FLOPs); full remat re-runs the whole forward
(about a third more FLOPs). Their order by speed holds on every backend, so the plan's bytes
alone decide. The device memory is `plan.device_memory_gib`, else `plan.accelerator`'s, else what
the device reports (`memory_stats()["bytes_limit"]`, `rljax.plan.accelerators.device_memory`).
A CPU reports none: there "auto" is "none" (and one micro-batch), what the run did before "auto"
existed.

Cost: only as many plans as candidates planned (above), each the whole plan (`plan_memory`, what
`rljax plan` prints and `rljax train`'s memory check computes; the sampling program, which the
update's schedule does not change, compiled once per process), and each cached per configuration,
in this process and in a JSON file (`$RLJAX_PLAN_CACHE`, default
`~/.cache/rljax/remat_plans.json`) keyed by a hash of everything that shapes the programs but the
two chosen settings (model, the rest of the update schedule, sampling, mesh, objective, device
kind, jax version): a second start with the same recipe compiles nothing to choose. (Re-planning only the update program and carrying the one-program iteration's excess
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
    """What `choose_remat` picked: `mode` and `microbatches`, the config with both set, the plan's
    peak per device of each candidate it planned or estimated (bytes, by `label`), the device
    memory it compared them with, and which settings were "auto" (`auto`: update.remat,
    `auto_micro`: update.num_microbatches, or a packed update's max_tokens_per_microbatch; both False:
    explicit settings, kept as they are)."""

    mode: str
    cfg: RunConfig
    peaks: dict[str, int]
    limit_bytes: int | None
    device: str | None
    auto: bool
    cached: bool = False
    microbatches: int = 1
    auto_micro: bool = False
    estimated: tuple[str, ...] = ()  # labels in `peaks` that are estimates (ruled out uncompiled)

    def _settings(self) -> str:
        remat = f"update.remat={'auto -> ' if self.auto else ''}{self.mode}"
        if not self.auto_micro:
            return remat
        if self.cfg.update.packing:
            return (f"{remat}, update.max_tokens_per_microbatch=auto -> {self.cfg.update.max_tokens_per_microbatch} "
                    f"({self.microbatches} micro-batches)")
        return f"{remat}, update.num_microbatches=auto -> {self.microbatches}"

    def line(self) -> str:
        """One line for the run log: what was chosen and why."""
        if not (self.auto or self.auto_micro):
            return f"update.remat={self.mode} (set explicitly)"
        if self.limit_bytes is None:
            return (f"{self._settings()}: no device memory is known (a CPU reports none; set "
                    "plan.accelerator or plan.device_memory_gib to plan against one), so the fastest "
                    + ("schedule" if self.auto_micro else "mode"))
        planned = ", ".join(f"{m} {format_gib(b)}" + (" (estimate)" if m in self.estimated else "")
                            for m, b in self.peaks.items())
        what = "schedule" if self.auto_micro else "mode"
        first = next(iter(self.peaks)) == label(self.mode, self.microbatches, self.auto_micro)
        why = f"the fastest {what}, fits" if first else f"the fastest {what} that fits"
        order = " (remat/micro-batches, fastest first)" if self.auto_micro else ""
        return (f"{self._settings()}: {why} {self.device} ({format_gib(self.limit_bytes)} per device); "
                f"plan peaks per device{order}: {planned}" + (" (cached plan)" if self.cached else ""))


def needs_choice(cfg: RunConfig) -> bool:
    """Whether `cfg` leaves the remat mode or the micro-batch count (packed: token budget) to the plan ("auto")."""
    return cfg.update.remat == "auto" or cfg.update.num_microbatches == "auto" or auto_budget(cfg)


def auto_budget(cfg: RunConfig) -> bool:
    """Whether a packed update's token budget is left to the plan (`update.max_tokens_per_microbatch = "auto"`)."""
    return bool(cfg.update.packing) and cfg.update.max_tokens_per_microbatch == "auto"


def label(mode: str, micro: int, auto_micro: bool) -> str:
    """A candidate's name in the log: the mode, with its micro-batch count when that was chosen too."""
    return f"{mode}/{micro}" if auto_micro else mode


def cache_path() -> Path:
    return Path(os.environ.get("RLJAX_PLAN_CACHE") or Path.home() / ".cache" / "rljax" / "remat_plans.json")


def config_key(cfg: RunConfig, model_cfg) -> str:
    """A hash of what shapes `cfg`'s programs, `update.remat` and `update.num_microbatches` left out
    (the cache holds each candidate's peak under "mode@micro-batches")."""
    import jax

    d = cfg.to_dict()
    for name in _NOT_SHAPING:
        d.pop(name, None)
    d["update"] = {**d["update"], "remat": None, "num_microbatches": None}
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


def _with(cfg: RunConfig, mode: str, micro: int) -> RunConfig:
    """`cfg` with the candidate (mode, m): m micro-batches, or with an "auto" packed budget the
    budget that makes m micro-batches of the mini-batch (`packed_budget`)."""
    if auto_budget(cfg):
        return dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, remat=mode,
                                                                   max_tokens_per_microbatch=packed_budget(cfg, micro)))
    return dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, remat=mode, num_microbatches=micro))


def packed_budget(cfg: RunConfig, micro: int) -> int:
    """Tokens of a packed micro-batch that splits the mini-batch into `micro`: (rows / micro)
    buffers of `update.pack_length` (default: the row width, widest prompt bucket + new tokens).
    Packing fills buffers with several short rows, so the run takes at most `micro` such
    micro-batches (fewer when rows are short); the plan sizes the full one."""
    from rljax.plan.memory import prompt_width

    rows = cfg.rl.prompts_per_iteration * cfg.sampling.num_samples // cfg.update.num_minibatches
    width = cfg.update.pack_length or prompt_width(cfg) + cfg.sampling.max_new_tokens
    return rows // micro * width


def microbatch_counts(cfg: RunConfig) -> tuple[int, ...]:
    """The micro-batch counts "auto" may pick, fewest first: the divisors of the rows per mini-batch."""
    rows = cfg.rl.prompts_per_iteration * cfg.sampling.num_samples // cfg.update.num_minibatches
    return tuple(m for m in range(1, rows + 1) if rows % m == 0)


def estimate_peak(planned: dict[int, int], micro: int) -> int | None:
    """peak(micro) on the line a + b / m through the two planned counts nearest below `micro`
    (None with fewer than two): the update's activations scale with the micro-batch rows, the
    state and gradient buffers do not."""
    below = sorted(m for m in planned if m < micro)[-2:]
    if len(below) < 2:
        return None
    (m1, p1), (m2, p2) = ((m, planned[m]) for m in below)
    b = (p1 - p2) / (1 / m1 - 1 / m2)
    return int(round(p2 + b * (1 / micro - 1 / m2)))


def choose_remat(cfg: RunConfig, model_cfg=None, *, tokenizer=None, limit: tuple[int, str] | None = None,
                 one_program: bool = True) -> RematChoice:
    """`cfg` with `update.remat = "auto"` resolved to the fastest mode whose plan fits `limit`
    ((bytes per device, a name); default: the `[plan]` section's or the device's, see the module
    docstring), and `update.num_microbatches = "auto"` to the fewest micro-batches that fit with
    it (the order of the module docstring). Explicit settings are kept as they are. Raises
    `ConfigError`, one line naming the settings to change, when no candidate fits.
    `one_program=False` plans the stages alone (`rljax plan --stages-only`: one compile fewer per
    candidate; what a bench of the update step alone needs)."""
    u = cfg.update
    auto_mode, auto_micro = u.remat == "auto", u.num_microbatches == "auto" or auto_budget(cfg)
    if not (auto_mode or auto_micro):
        return RematChoice(remat_mode(u.remat), cfg, {}, None, None, auto=False, microbatches=u.num_microbatches)
    modes = REMAT_MODES if auto_mode else (remat_mode(u.remat),)
    counts = microbatch_counts(cfg) if auto_micro else (u.num_microbatches,)
    picked = dict(auto=auto_mode, auto_micro=auto_micro)
    if limit is None:
        limit = device_memory(cfg.plan.accelerator, cfg.plan.device_memory_gib)
    if limit is None:
        return RematChoice(modes[0], _with(cfg, modes[0], counts[0]), {}, None, None, microbatches=counts[0], **picked)
    limit_bytes, device = limit
    if model_cfg is None:
        from rljax.models.setup import build_tokenizer, policy_config

        tokenizer = tokenizer or build_tokenizer(cfg.model)
        model_cfg = policy_config(cfg.model, tokenizer)
    key = config_key(cfg, model_cfg) + ("" if one_program else "-stages")
    entry = _load(key)
    cached, peaks, estimated = True, {}, []
    for mode in modes:
        planned: dict[int, int] = {}
        for micro in counts:
            name = label(mode, micro, auto_micro)
            guess = None if f"{mode}@{micro}" in entry["peak"] else estimate_peak(planned, micro)
            if guess is not None and guess > limit_bytes:  # ruled out by the estimate: not compiled
                peaks[name] = guess
                estimated.append(name)
                continue
            if f"{mode}@{micro}" not in entry["peak"]:
                cached = False
                _plan_mode(entry, _with(cfg, mode, micro), f"{mode}@{micro}", model_cfg, tokenizer, one_program)
                _store(key, entry)
            peaks[name] = planned[micro] = entry["peak"][f"{mode}@{micro}"]
            if planned[micro] <= limit_bytes:
                return RematChoice(mode, _with(cfg, mode, micro), peaks, limit_bytes, device,
                                   cached=cached and entry["_from_file"], microbatches=micro,
                                   estimated=tuple(estimated), **picked)
    raise ConfigError(refusal(cfg, peaks, entry, limit_bytes, device))


def plan_peaks(cfg: RunConfig, model_cfg=None, *, tokenizer=None) -> dict[str, int]:
    """The plan's peak per device for every remat mode at `cfg`'s micro-batch count (bytes), from
    the cache where it has them."""
    if model_cfg is None:
        from rljax.models.setup import build_tokenizer, policy_config

        tokenizer = tokenizer or build_tokenizer(cfg.model)
        model_cfg = policy_config(cfg.model, tokenizer)
    key = config_key(cfg, model_cfg)
    entry = _load(key)
    micro = cfg.update.num_microbatches
    for mode in REMAT_MODES:
        if f"{mode}@{micro}" not in entry["peak"]:
            _plan_mode(entry, _with(cfg, mode, micro), f"{mode}@{micro}", model_cfg, tokenizer)
            _store(key, entry)
    return {mode: entry["peak"][f"{mode}@{micro}"] for mode in REMAT_MODES}


def _plan_mode(entry: dict, cfg: RunConfig, name: str, model_cfg, tokenizer, one_program: bool = True) -> None:
    """Fills `entry` with the candidate `name`'s plan peak (the whole plan, as `rljax plan` and the
    run's memory check compute it) and the sampling stage's peak, which the update's schedule
    does not change: its program is compiled once per process and reused for the next candidate."""
    from rljax.plan.memory import plan_memory

    plan = plan_memory(cfg, model_cfg, tokenizer=tokenizer, one_program=one_program, sampler=entry.get("_sampler"))
    entry["peak"][name] = plan.peak_bytes
    entry["sampler_peak"] = plan.sampler_peak_bytes
    entry["_sampler"] = plan.sampler  # "_": kept in this process only


def refusal(cfg: RunConfig, peaks: dict[str, int], entry: dict, limit_bytes: int, device: str) -> str:
    """The one line refusing a size where no candidate fits: the peaks and the settings to change."""
    planned = ", ".join(f"{m} {format_gib(b)}" for m, b in peaks.items())
    u = cfg.update
    auto_micro = u.num_microbatches == "auto" or auto_budget(cfg)
    if entry["sampler_peak"] > limit_bytes:
        what = ("sampling binds (remat does not change it): lower rl.prompts_per_iteration, sampling.num_samples or "
                "sampling.max_new_tokens")
    elif u.packing and not auto_micro:
        what = f"lower update.max_tokens_per_microbatch (now {u.max_tokens_per_microbatch or 'automatic'})"
    elif auto_micro:
        what = ("every micro-batch count up to one row each was tried: shorten the rows (sampling.max_new_tokens, "
                "data.max_prompt_tokens), set lora.enabled=true")
    else:
        what = f"raise update.num_microbatches (now {u.num_microbatches})"
    subject = "update.remat=auto" if u.remat == "auto" else f"update.remat={remat_mode(u.remat)}"
    subject += (", update.max_tokens_per_microbatch=auto" if u.packing else ", update.num_microbatches=auto"
                ) if auto_micro else ""
    nothing = "no schedule" if auto_micro else "no remat mode"
    return (f"{subject}: {nothing} fits {device} ({format_gib(limit_bytes)} per device); plan peaks per "
            f"device: {planned}; {what}, put more devices on mesh.fsdp, or set model.param_dtype=bfloat16")
