"""The bench's remat phase (issue 53): the 1.5B update with no / selective / full remat at 4 and 8
micro-batches, and the mode `update.remat = "auto"` picks from the memory plan on this device.

case "<none|selective|full>-mb<N>" runs `jax_phases.update` at the 1.5B shape with that remat mode
and micro-batch count (cuDNN attention where it serves); case "auto-mb<N>" first asks
`auto_schedule` (`rljax.plan.remat.choose_remat` on the stages' plan, `--stages-only`, of the same shapes as an
`rljax train` recipe: 64 rows of a 256-token prompt + 768 new tokens, dr_grpo, one device; the
device memory from
`memory_stats()["bytes_limit"]`, or the plan's accelerator table on a CPU smoke run, where it
plans against an H200), records its choice, its line and the plan seconds, then times that mode.
"""

from __future__ import annotations

import time

from gpu import jax_phases
from gpu.shapes import hf_config

REMAT_CASES = ["none-mb4", "selective-mb4", "auto-mb4", "none-mb8", "selective-mb8", "full-mb8", "full-mb4"]


def auto_schedule(args, name: str, micro, remat, record, lora_rank: int = 0) -> tuple[str, int]:
    """(remat mode, micro-batches) for the bench shape `name` on this device, each "auto" one chosen
    by `rljax.plan.remat.choose_remat` (the stages' plan of an `rljax train` recipe of the same
    shapes; `lora_rank`: LoRA on a bf16 base); the choice, its line and the plan seconds are recorded."""
    import jax

    from rljax.models import from_hf_dict
    from rljax.models.remat import remat_mode
    from rljax.plan.accelerators import ACCELERATORS
    from rljax.plan.remat import choose_remat
    from rljax.train.config import load_config

    rows, seq, _, _ = (jax_phases.UPDATE_SHAPES_SMALL if args.small else jax_phases.UPDATE_SHAPES)[name]
    hf = hf_config(name, args.small)
    dtype = "bfloat16" if lora_rank else "float32"
    model_cfg = from_hf_dict(hf, compute_dtype="bfloat16", param_dtype=dtype)
    prompt = seq // 4
    lora = [f"lora.rank={lora_rank}", f"lora.alpha={2.0 * lora_rank}"] if lora_rank else []
    cfg = load_config("default", [f"update.remat={remat if remat == 'auto' else remat_mode(remat)}",
                                  f"update.num_microbatches={micro}", "mesh.devices=1", f"model.param_dtype={dtype}",
                                  f"rl.prompts_per_iteration={rows // jax_phases.GROUP_SIZE}",
                                  f"sampling.num_samples={jax_phases.GROUP_SIZE}", f"sampling.max_new_tokens={seq - prompt}",
                                  f"data.max_prompt_tokens={prompt}", "algorithm.algorithm=dr_grpo",
                                  "optim.learning_rate=1e-6", "optim.max_grad_norm=1.0", "optim.weight_decay=0.01", *lora])
    stats = jax.devices()[0].memory_stats() or {}
    limit = (stats["bytes_limit"], jax.devices()[0].device_kind) if stats.get("bytes_limit") else \
        (ACCELERATORS["h200"].memory_bytes, "h200 (from the plan's table: this device reports no memory)")
    t = time.perf_counter()
    choice = choose_remat(cfg, model_cfg, limit=limit, one_program=False)  # the update is timed alone
    record(what="remat_auto", model=name, microbatches=choice.microbatches, auto_microbatches=choice.auto_micro,
           chosen=choice.mode, line=choice.line(), peaks_gib={m: b / 2**30 for m, b in choice.peaks.items()},
           limit_gib=limit[0] / 2**30, device=limit[1], plan_s=time.perf_counter() - t, cached=choice.cached,
           lora_rank=lora_rank)
    print(choice.line(), flush=True)
    return choice.mode, choice.microbatches


def remat(args, case, record):
    """The 1.5B update at one remat mode and micro-batch count (see the module docstring)."""
    mode, micro = case.split("-mb")
    micro = int(micro)
    if args.small:
        micro = max(1, micro // 2)  # the small batch has 8 rows
    if mode == "auto":
        mode, micro = auto_schedule(args, "1.5B", micro, "auto", record)
    table = jax_phases.UPDATE_SHAPES_SMALL if args.small else jax_phases.UPDATE_SHAPES
    rows, seq, _, _ = table["1.5B"]
    table["1.5B"] = (rows, seq, micro, mode)
    jax_phases.update(args, "1.5B-auto", record)


def report_lines(r) -> list[str]:
    """The markdown of the remat and PyTorch-peer phases (`gpu.report.Run` records)."""
    from gpu.report import _num, _pct, _row

    eager = r.find("torch_update", "1.5B")
    peers = [p for p in (r.find("torch_peer", c) for c in ("1.5B-compile", "1.5B-liger")) if p and not p.get("skipped")]
    best = max([p for p in (eager, *peers) if p], key=lambda p: p["tokens_per_s"], default=None)
    lines = ["### Update at 1.5B: remat modes, and the strongest PyTorch row", "",
             "rljax `update_step` at the 1.5B shape (64 x 1024, f32 params, bf16 compute, dr_grpo, AdamW); remat "
             "none / selective (matmul outputs saved) / full, and what `update.remat = \"auto\"` picks from the "
             "memory plan. Ratios against PyTorch eager and against the best PyTorch row measured.", "",
             _row("system", "remat", "micro-batches", "tokens/s", "MFU", "vs eager", "vs best PyTorch",
                  "peak GiB", "first call s"), _row(*["---"] * 9)]
    for p in (eager, *peers):
        if p:
            lines.append(_row(p["system"], "-", p["microbatches"], _num(p["tokens_per_s"]), _pct(p["mfu"]),
                              f"{p['tokens_per_s'] / eager['tokens_per_s']:.2f}x" if eager else "-", "-",
                              _num(p["peak_mem_gib"], 1), _num(p["first_call_s"], 1)))
    for c in REMAT_CASES:
        u = r.find("remat", c, system="rljax")
        if not u:
            lines.append(_row("rljax", c, "", r.missing("remat", c), "", "", "", "", ""))
            continue
        lines.append(_row("rljax", c.split("-")[0] + (f" -> {u['remat']}" if c.startswith("auto") else ""),
                          u["microbatches"], _num(u["tokens_per_s"]), _pct(u["mfu"]),
                          f"{u['tokens_per_s'] / eager['tokens_per_s']:.2f}x" if eager else "-",
                          f"{u['tokens_per_s'] / best['tokens_per_s']:.2f}x" if best else "-",
                          _num(u["peak_mem_gib"], 1), _num(u["first_call_s"], 1)))
    auto = [a for a in r.records if a.get("what") == "remat_auto" and a.get("model", "1.5B") == "1.5B"]
    skipped = [p for p in (r.find("torch_peer", c) for c in ("1.5B-liger",)) if p and p.get("skipped")]
    lines.append("")
    lines += [f"- auto: {a['line']} (chosen in {a['plan_s']:.1f} s)" for a in auto]
    lines += [f"- {p['system']}: {p['skipped']}" for p in skipped]
    return lines + [""]
