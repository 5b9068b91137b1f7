"""`rljax plan`: a recipe's memory per device before launch, on CPU with simulated devices.

    rljax plan --config gsm8k_qwen --model qwen2.5-7b --accelerator v5p-16
    rljax plan --config gsm8k_qwen --model /path/to/hf_dir --devices 8 --mesh data=2,fsdp=4 update.remat=true

The simulated device count must be set before jax starts, so `rljax.cli` calls `prepare(argv)`
first: it sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` and, unless the environment
names a platform, `JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import argparse
import os
import re

from rljax.models.setup import build_tokenizer, policy_config
from rljax.errors import ConfigError

DEFAULT_DEVICES = 8
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-device memory of a recipe before launch (CPU, simulated devices)",
                       description="Plan a recipe's memory per device: params, optimiser state, reference and "
                                   "value model, the compiled update and sampler programs' temporaries, and "
                                   "whether it fits an accelerator. Override any setting as key=value.")
    _add_device_args(p)
    p.add_argument("--config", help="a TOML recipe or a packaged one by name (default: the default job)")
    p.add_argument("--model", help="a named shape (Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-7B, Qwen3-8B, Llama-3.1-8B, "
                                   "Gemma-2-9B) or a HF directory with config.json (default: the recipe's model)")
    p.add_argument("--mesh", help="trainer mesh axis sizes, e.g. data=1,fsdp=8,tensor=1 or fsdp=4,expert=2 "
                   "(default: the recipe's)")
    p.add_argument("--stages-only", action="store_true",
                   help="skip compiling the one-program iteration (faster; the peak is the larger stage's)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.set_defaults(func=_plan)


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, help=f"devices to plan for (default: the slice's, else {DEFAULT_DEVICES})")
    p.add_argument("--accelerator", help="check against one: v5e, v5p, v6e, h100, h200, or a slice: v5e-8, "
                                         "v5p-16 (8 chips), v6e-8, 8xh100, 8xh200 (default: list them all)")


def device_count(devices: int | None, accelerator: str | None) -> int:
    from rljax.plan.accelerators import Slice, find

    if devices is not None:
        if devices < 1:
            raise ConfigError(f"--devices {devices} must be >= 1")
        return devices
    found = find(accelerator) if accelerator else None
    return found.devices if isinstance(found, Slice) else DEFAULT_DEVICES


def prepare(argv: list[str]) -> None:
    """Sets the simulated device count (and the CPU platform) for `rljax plan` before jax starts."""
    pre = argparse.ArgumentParser(add_help=False)
    _add_device_args(pre)
    args, _ = pre.parse_known_args(argv)
    try:
        n = device_count(args.devices, args.accelerator)
    except ConfigError:
        return  # reported by the command itself
    flags = re.sub(rf"{_COUNT_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _mesh_overrides(mesh: str | None) -> list[str]:
    if not mesh:
        return []
    out = []
    for part in mesh.split(","):
        name, _, size = part.partition("=")
        if name.strip() not in ("data", "fsdp", "tensor", "expert") or not size.strip().lstrip("-").isdigit():
            raise ConfigError(f"--mesh {mesh!r}: write axis sizes as data=1,fsdp=8,tensor=1")
        out.append(f"mesh.{name.strip()}={int(size)}")
    return out


def _plan(args: argparse.Namespace) -> int:
    import dataclasses

    import jax

    from rljax.lora import LoraConfig
    from rljax.plan.accelerators import ACCELERATORS, GIB, device_memory
    from rljax.plan.advice import check_fits
    from rljax.plan.memory import plan_memory, prompt_width, state_memory
    from rljax.plan.moe import moe_plan
    from rljax.plan.shapes import model_config
    from rljax.train.config import load_config

    n = device_count(args.devices, args.accelerator)
    if len(jax.devices()) < n:
        raise ConfigError(f"rljax plan: {n} devices wanted but this process has {len(jax.devices())}; run it as a fresh "
                          f"process (it sets XLA_FLAGS={_COUNT_FLAG}={n} before jax starts)")
    cfg = load_config(args.config, [*args.overrides, *_mesh_overrides(args.mesh), f"mesh.devices={n}"])
    tokenizer = None
    if args.model:
        model_cfg = model_config(args.model, param_dtype=cfg.model.param_dtype, compute_dtype=cfg.model.compute_dtype)
    else:
        if cfg.model.checkpoint and not os.path.isdir(cfg.model.checkpoint):
            raise ConfigError(f"model.checkpoint={cfg.model.checkpoint!r} is not a directory here; pass --model with a "
                              "named shape (e.g. --model Qwen2.5-0.5B) or a HF directory")
        tokenizer = build_tokenizer(cfg.model)
        model_cfg = policy_config(cfg.model, tokenizer)
    from rljax.plan.vision import vision_plan

    vision = None if args.model else vision_plan(cfg, model_cfg)
    if vision is not None:  # a vision-language recipe: its counts (rljax.plan.vision)
        print("\n".join(vision.lines()))
        return 0
    named = args.accelerator or cfg.plan.accelerator
    limit = device_memory(named, cfg.plan.device_memory_gib) if (named or cfg.plan.device_memory_gib) else None
    from rljax.plan.remat import choose_remat, needs_choice

    if needs_choice(cfg):  # the mode (and micro-batches) `rljax train` would run (`rljax.plan.remat`), then its plan
        choice = choose_remat(cfg, model_cfg, tokenizer=tokenizer, limit=limit)
        print(choice.line())
        cfg = choice.cfg
    n_params = sum(x.size for x in jax.tree.leaves(_abstract_params(model_cfg)))
    print(f"rljax plan: {args.config or 'default'}, {args.model or model_cfg.model_type} ({n_params / 1e6:,.1f}M "
          f"params, {model_cfg.param_dtype} params, {model_cfg.compute_dtype} compute), {n} devices")
    state = state_memory(cfg, model_cfg, tokenizer=tokenizer)
    print("mesh " + (" ".join(f"{k}={v}" for k, v in state.mesh.items()) or "none (one device)")
          + ("" if state.sampler_mesh is None else
             " | sampler mesh " + " ".join(f"{k}={v}" for k, v in state.sampler_mesh.items())))
    moe = moe_plan(cfg, model_cfg, n, prompt_width(cfg))
    for line in moe.lines() if moe is not None else ():
        print(line)
    if cfg.lora.enabled:  # what LoRA saves: the same recipe's state with every weight trained
        full = state_memory(dataclasses.replace(cfg, lora=LoraConfig()), model_cfg, tokenizer=tokenizer)
        print(f"LoRA: train state {state.total_bytes / GIB:.3f} GiB per device against {full.total_bytes / GIB:.3f} "
              f"GiB for full fine-tuning (saves {(full.total_bytes - state.total_bytes) / GIB:.3f} GiB of optimiser "
              f"state, reference and critic)")
    if limit is not None and state.total_bytes > limit[0]:  # nothing to compile: the state alone does not fit
        _print_rows(_state_rows(state), GIB)
        check_fits(cfg, *limit, model_cfg=model_cfg, tokenizer=tokenizer)
    plan = plan_memory(cfg, model_cfg, tokenizer=tokenizer, one_program=not args.stages_only)
    _print_rows(plan_rows(plan), GIB)
    print("compile seconds: " + ", ".join(f"{name} {p.compile_seconds:.0f}" for name, p in
                                          (("update", plan.update), ("sampler", plan.sampler),
                                           ("iteration", plan.iteration)) if p is not None))
    if limit is not None:
        advice = check_fits(cfg, *limit, model_cfg=model_cfg, tokenizer=tokenizer, plan=plan)
        print(f"fits {advice.device} ({advice.limit_bytes / GIB:.0f} GiB per device): yes")
        return 0
    for acc in ACCELERATORS.values():
        verdict = "yes" if plan.peak_bytes <= acc.memory_bytes else "no"
        print(f"fits {acc.name:5s} ({acc.memory_gib:>5.0f} GiB per device): {verdict}")
    return 0


def _abstract_params(model_cfg):
    import jax

    from rljax.models import init_params

    return jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))


def _state_rows(state) -> list[tuple[str, int | None]]:
    rows = [("params" if not state.adapter_bytes else "params (frozen base)", state.params_bytes),
            ("optimiser state", state.opt_state_bytes),
            ("reference model", state.reference_bytes), ("value model", state.value_bytes)]
    if state.adapter_bytes:
        rows.append(("LoRA adapters", state.adapter_bytes))
    if state.teacher_bytes:
        rows.append(("teacher model (frozen)", state.teacher_bytes))
    if state.reward_model_bytes:
        rows.append(("reward model (frozen)", state.reward_model_bytes))
    if state.sampler_mesh is not None or state.sampler_merged:
        rows.append(("sampler's params copy" + (" (LoRA merged)" if state.sampler_merged else ""),
                     state.sampler_params_bytes))
    return rows + [("train state", state.total_bytes)]


def plan_rows(plan) -> list[tuple[str, int | None]]:
    """The plan as (label, bytes per device) rows, in the order `rljax plan` prints them."""
    rows = _state_rows(plan.state)
    rows += [("update: temporaries", plan.update.temp_bytes),
             ("sampler: temporaries (KV cache, decode)", plan.sampler.temp_bytes),
             ("peak while updating", plan.update_peak_bytes),
             ("peak while sampling", plan.sampler_peak_bytes)]
    if plan.iteration is not None:
        rows += [("one-program iteration: temporaries", plan.iteration.temp_bytes)]
    return rows + [("peak", plan.peak_bytes)]


def _print_rows(rows, gib: int) -> None:
    print(f"  {'per device':42s} {'GiB':>9s}")
    for label, size in rows:
        print(f"  {label:42s} {size / gib:9.3f}")
