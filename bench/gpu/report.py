"""The GPU bench's markdown section (for BENCHMARKS.md) from one run's records.

A phase that did not produce its result shows its status instead (skipped for time, timeout,
failed) in the row it would have filled, so the table always has the same rows.
"""

from __future__ import annotations


def _num(x, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _sig(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _batch(rec: dict) -> str:
    return f"{rec['rows']} x {rec['seq']} / {rec['microbatches']}"


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


class Run:
    """One run's records and phase statuses, looked up by (phase, case)."""

    def __init__(self, run: dict):
        self.run = run
        self.records = run.get("records", [])
        self.status = {(p["phase"], p["case"]): p for p in run.get("phases", [])}

    def find(self, phase: str, case=None, **match) -> dict | None:
        for r in self.records:
            if r["phase"] == phase and (case is None or r["case"] == case) and \
                    all(r.get(k) == v for k, v in match.items()):
                return r
        return None

    def missing(self, phase: str, case) -> str:
        """Why (phase, case) has no result: its status, or 'not run' when it was not selected."""
        p = self.status.get((phase, case))
        if p is None:
            return "not run"
        if p["status"] == "ok":
            return "no result"
        return {"skipped": "skipped (time)"}.get(p["status"], p["status"])


def header(run: dict) -> list[str]:
    v, acc = run.get("versions", {}), run.get("accelerator", {})
    cuda = acc.get("jax_cuda_runtime") or acc.get("torch_cuda")
    cudnn = acc.get("jax_cudnn") or acc.get("torch_cudnn")
    plugin = ", ".join(f"{k} {val}" for k, val in v.items() if k.startswith("jax-cuda") or k.startswith("jax_cuda"))
    lines = [f"## GPU: {run.get('device_kind') or 'unknown device'}, measured {run['date']}", "",
             f"`python bench/bench_gpu.py{' --small' if run['args'].get('small') else ''}` on commit "
             f"{run.get('commit') or 'unknown'}, {run['started_utc']}. Device: {run.get('device_kind')} "
             f"({run.get('nvidia_smi') or 'no nvidia-smi'}). "
             f"jax {v.get('jax')} (jaxlib {v.get('jaxlib')}{', ' + plugin if plugin else ''}), "
             f"CUDA {cuda or '-'}, cuDNN {cudnn or '-'}, flax {v.get('flax')}, optax {v.get('optax')}, "
             f"torch {v.get('torch')}, transformers {v.get('transformers')}, Python {v.get('python')}.", ""]
    if run["args"].get("small"):
        lines += ["**--small: every shape shrunk (a smoke test of the script, not a measurement).**", ""]
    return lines


def ceilings(r: Run) -> list[str]:
    mm, hbm = r.find("ceilings", what="bf16_matmul"), r.find("ceilings", what="hbm")
    missing = r.missing("ceilings", None)
    return ["### Ceilings measured on the card", "",
            f"- bf16 matmul, {mm['n'] if mm else 8192}^3: " + (f"**{_sig(mm['tflops'])}** TFLOP/s." if mm else missing),
            f"- HBM, `z + 1` over {hbm['gib'] if hbm else 4} GiB f32 (bytes read + written): "
            + (f"**{_sig(hbm['tb_s'])}** TB/s." if hbm else missing), ""]


def update(r: Run, update_cases: list[str]) -> list[str]:
    lines = ["### Update step: rljax `update_step` vs a PyTorch eager step", "",
             "f32 params, bf16 compute, dr_grpo, AdamW with grad-norm clip (the same batch, micro-batches and "
             "clipped surrogate in both systems). MFU = model FLOPs (6 N per token plus causal attention counted "
             "as the full square) over the measured bf16 peak. PyTorch: transformers Qwen2, sdpa attention, bf16 "
             "autocast, fused AdamW, no gradient checkpointing.", "",
             _row("system", "shape", "rows x tokens / micro-batches", "attention", "tokens/s", "MFU (measured peak)",
                  "vs PyTorch", "first call s", "programs compiled", "peak memory GiB"),
             _row(*["---"] * 10)]
    for model in ("0.5B", "1.5B", "3B", "7B"):
        torch = r.find("torch_update", model)
        if model in ("3B", "7B") and not torch and not r.find("update", f"{model}-auto", system="rljax"):
            continue  # issue 53's big shapes: only when measured
        base = torch["tokens_per_s"] if torch else None
        if torch:
            label = "PyTorch eager" + (", grad checkpointing" if torch.get("gradient_checkpointing") else "") \
                + (f", peft LoRA r{torch['lora_rank']}" if torch.get("lora_rank") else "")
            lines.append(_row(label, model, _batch(torch), torch["attention"], _num(torch["tokens_per_s"]),
                              _pct(torch["mfu"]),
                              "1.00x", _num(torch["first_call_s"], 1), "-", _num(torch["peak_mem_gib"], 1)))
        else:
            lines.append(_row("PyTorch eager", model, "", "sdpa", r.missing("torch_update", model), "", "", "", "", ""))
        for case in (c for c in update_cases if c.startswith(model)):
            u = r.find("update", case, system="rljax")
            if not u:
                lines.append(_row("rljax", model, "", case.split("-")[1], r.missing("update", case), "", "", "", "", ""))
                continue
            vs = f"{u['tokens_per_s'] / base:.2f}x" if base else "-"
            mode = "full" if u["remat"] is True else u["remat"]
            lines.append(_row("rljax" + (f", remat {mode}" if mode not in (False, None, "none") else "")
                              + (f", LoRA r{u['lora_rank']}" if u.get("lora_rank") else ""), model, _batch(u),
                              f"{u['attention']} ({u['attention_resolved']})", _num(u["tokens_per_s"]), _pct(u["mfu"]),
                              vs, _num(u["first_call_s"], 1), u["programs_compiled"], _num(u["peak_mem_gib"], 1)))
    fused, ref = r.find("update", "0.5B-auto"), r.find("update", "0.5B-xla")
    lines.append("")
    lines += [f"- auto at {a['model']}: {a['line']} (chosen in {a['plan_s']:.1f} s)" for a in r.records
              if a.get("what") == "remat_auto" and a.get("model") in ("3B", "7B")]
    if fused and ref:
        lines += [f"Fused-attention gain at 0.5B (\"auto\" over \"xla\"): **{fused['tokens_per_s'] / ref['tokens_per_s']:.2f}x**. "
                  f"{fused['attention_line']}.", ""]
    return lines


def decode(r: Run, decode_cases: list[str], hf_cases: list[str]) -> list[str]:
    lines = ["### Decode: Qwen2.5-0.5B shapes, bf16 params and compute, no EOS", "",
             "Roofline = every weight read once per step plus each row's KV cache up to its current length, over "
             "the measured HBM bandwidth. Programs compiled: XLA compilations during the first call "
             "(`jax.monitoring` backend-compile events); recompiles: those during the timed calls after it.", "",
             _row("system", "batch", "prompt + new", "tokens/s", "share of HBM roofline", "first call s",
                  "programs compiled (compile s)", "recompiles"),
             _row(*["---"] * 8)]
    for case in decode_cases:
        d = r.find("decode", case)
        name = "rljax " + case.split("-")[0] + (" (slots = batch)" if case.startswith("continuous") else "")
        name += f", decode attention {d['decode_attention']}" if d and "decode_attention" in d else ""
        if not d:
            lines.append(_row(name, case.split("-")[1], "", r.missing("decode", case), "", "", "", ""))
            continue
        lines.append(_row(name, d["batch"], f"{d['prompt']} + {d['new']}", _num(d["tokens_per_s"]),
                          _pct(d["roofline_share"]), _num(d["first_call_s"], 1),
                          f"{d['programs_compiled']} ({_num(d['backend_compile_s'], 1)})", d["recompiles"]))
    for case in hf_cases:
        h = r.find("hf_decode", case)
        name = "transformers `generate` (sdpa, dynamic cache)"
        if not h:
            lines.append(_row(name, case, "", r.missing("hf_decode", case), "", "", "", ""))
            continue
        made = f"{h['prompt']} + {h['new_tokens_made']}" + (" (stopped at max_time)" if h["stopped_by_max_time"] else "")
        lines.append(_row(name, h["batch"], made, _num(h["tokens_per_s"]), _pct(h["roofline_share"]), "-", "-", "-"))
    return lines + [""]


def numerics(r: Run) -> list[str]:
    f32, bf16 = r.find("parity", what="f32_logits_vs_transformers"), r.find("parity", what="bf16_sampler_vs_trainer_logp")
    lines = ["### Numerics on the device", ""]
    if f32:
        lines.append(f"- f32 logits vs transformers (f32, TF32 off), 4-layer width-256 model: max abs "
                     f"{f32['max_abs_default']:.2g} at jax's default matmul precision, {f32['max_abs_highest']:.2g} at "
                     f"`highest` (logits up to {f32['logits_max_abs']:.2g}).")
    if bf16:
        lines.append(f"- bf16 sampler vs trainer log-probs, same model ({bf16['tokens']:,} tokens): max "
                     f"{bf16['max']:.2g}, mean {bf16['mean']:.2g} nats. {bf16['attention_line']}.")
    if not (f32 or bf16):
        lines.append(f"- {r.missing('parity', None)}.")
    return lines + [""]


def phases(r: Run) -> list[str]:
    lines = ["Phases (each a child process under its own time limit):", "",
             _row("phase", "case", "status", "seconds", "limit s"), _row(*["---"] * 5)]
    for p in r.run.get("phases", []):
        lines.append(_row(p["phase"], p["case"] or "-", p["status"], _num(p.get("seconds"), 1), _num(p.get("limit_s"))))
    return lines + [""]


def markdown(run: dict, update_cases: list[str], decode_cases: list[str], hf_cases: list[str]) -> str:
    r = Run(run)
    from gpu.remat_phases import report_lines as remat_lines  # issue 53: remat modes and PyTorch peers

    from gpu.iteration_phases import report_lines as iteration_lines  # issue 53: the whole iteration, TRL's

    out = header(run) + ceilings(r) + update(r, update_cases) + remat_lines(r) + decode(r, decode_cases, hf_cases) \
        + numerics(r) + iteration_lines(r) + phases(r)
    return "\n".join(out)
