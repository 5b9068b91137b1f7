"""Runs every benchmark and writes one table: BENCHMARKS.md and bench/results/summary.json.

    .venv/bin/python bench/run_all.py            # all benchmarks (about 10 minutes on a 2-core CPU, plus
                                                 # ~10 and 17 GiB of RAM for the Qwen2.5-0.5B real shapes)
    .venv/bin/python bench/run_all.py --table    # only rebuild the table from bench/results/*.json

Each script writes its own JSON (date, machine, versions) to bench/results/; this collects them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(HERE)

SCRIPTS = [
    ("sampling", ["bench_sampling.py", "--repeats", "2"]),
    ("update", ["bench_update.py", "--repeats", "3"]),
    ("iteration", ["bench_iteration.py", "--iterations", "6"]),
    ("scaling", ["bench_scaling.py", "--repeats", "2"]),
    ("rewards", ["bench_rewards.py"]),
    ("real_shapes", ["bench_real_shapes.py"]),
]


def _load(name):
    path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def build_table() -> str:
    lines = ["# Benchmarks", "", f"Collected {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by "
             "`bench/run_all.py` from `bench/results/*.json`; each section names the date, machine and "
             "versions of its own run. Re-run with `.venv/bin/python bench/run_all.py`.", ""]
    s = _load("sampling")
    if s:
        lines += ["## Sampler vs transformers `generate` (batch 64, prompt 32, no early stop)", "",
                  f"{s['date']}, {s['machine'].get('cpus')} CPUs ({s['machine'].get('cpu_model') or 'model not recorded'}), "
                  f"jax {s['versions']['jax']}, torch "
                  f"{s['versions'].get('torch')}, transformers {s['versions'].get('transformers')}; measured f32 "
                  f"matmul peak {s['matmul_peak_gflops']} GFLOP/s, read bandwidth "
                  f"{s.get('memory_bandwidth_gbs', 'not measured')} GB/s.", "",
                  _row("config", "new tokens", "rljax new tok/s", "transformers new tok/s", "ratio",
                       "decode share of f32 peak / of bandwidth", "rljax data-parallel new tok/s (ratio)",
                       "ceiling ratio"),
                  _row("---", "---", "---", "---", "---", "---", "---", "---")]
        for r in s["results"]:
            frac = f"{r.get('decode_roofline_fraction', '')} / {r.get('decode_bandwidth_fraction', '-')}"
            dp = (f"{r['rljax_dp_new_tok_s']} ({r['rljax_dp_speedup']}x, {r['rljax_dp_host_devices']} host devices)"
                  if "rljax_dp_new_tok_s" in r else "not run")
            lines.append(_row(r["config"], r.get("new_tokens", 64), r["rljax_new_tok_s"], r["transformers_new_tok_s"],
                              f"{r['speedup']}x", frac, dp, f"{r['ceiling_speedup']}x" if "ceiling_speedup" in r
                              else "not measured"))
        lines += ["", "Data-parallel: one XLA host device per core, params replicated on a data mesh, each "
                  "device decoding its own rows (`generate` on a mesh).", "",
                  "Ceiling ratio: an estimate of the fastest run this sampler's op structure (one unfused "
                  "matmul per weight, one device) could make here, over transformers: prefill at the "
                  "measured f32 peak, then decode steps that are nothing but their weight matmuls "
                  "(`matmul_only_decode_tok_s`: the model's own weights chained in a `fori_loop`, no "
                  "attention, cache or sampling). It leaves attention out, so it is loose for long "
                  "completions.", ""]
    lt = _load("sampling_longtail")
    if lt:
        lines += longtail_section(lt)
    u = _load("update")
    if u:
        lines += ["## Update step vs a PyTorch step (B=32, T=128, one epoch, one mini-batch)", "",
                  f"{u['date']}, {u['machine'].get('cpus')} CPUs, jax {u['versions']['jax']}, torch "
                  f"{u['versions']['torch']}; measured matmul peak f32 {u['matmul_peak_gflops']['float32']} / bf16 "
                  f"{u['matmul_peak_gflops']['bfloat16']} GFLOP/s.", "",
                  _row("config / compute", "rljax tok/s", "PyTorch tok/s", "ratio", "rljax GFLOP/s",
                       "share of f32 peak", "compile s"),
                  _row("---", "---", "---", "---", "---", "---", "---")]
        for name, run in u["runs"].items():
            lines.append(_row(name, run["rljax_tokens_per_s"], run["torch_tokens_per_s"], f"{run['ratio_vs_torch']}x",
                              run["rljax_gflops"], run["rljax_frac_of_f32_peak"], run["rljax_compile_s"]))
        lines.append("")
    it = _load("iteration")
    if it:
        st, fu, co = it["stages_separately_s"], it["fused_iteration_s"], it["compilations"]
        lines += ["## End-to-end RL iteration (the default job's model)", "",
                  f"{it['date']}, {it['machine']['cpus']} CPUs, jax {it['versions']['jax']}; "
                  f"{it['setup']['prompts']} prompts x {it['setup']['samples_per_prompt']} samples, "
                  f"{it['setup']['model_params']:,} params.", "",
                  _row("fused iteration (steady)", "first (with compile)", "sample alone", "verify alone",
                       "update alone", "compilations, first iteration", "recompiles after it"),
                  _row(*["---"] * 7),
                  _row(f"{fu['steady_median']:.3f} s", f"{fu['first_with_compile']:.1f} s", f"{st['sample']:.3f} s",
                       f"{st['verify']:.3f} s", f"{st['update']:.3f} s", co["first_iteration"],
                       co["recompiles_after_first"]), ""]
        gap = it.get("sampler_trainer_logp_gap_nats")
        if gap:  # recorded by runs since the typed rollout -> update contract
            mean, top = gap.get("mean", gap.get("abs_mean")), gap.get("max", gap.get("abs_max"))  # older runs
            lines += [f"Sampler/trainer log-prob gap the update reports (`update/logp_diff_mean` / "
                      f"`update/logp_diff_max`, last iteration): {mean:.1e} / {top:.1e} nats.", ""]
    sc = _load("scaling")
    if sc:
        lines += ["## Scaling on simulated CPU devices (they share the host's cores: overhead, not speed-up)", "",
                  f"{sc['model']}, batch {sc['batch']} x {sc['seq']}, jax {sc['jax']}.", "",
                  _row("devices", "layout", "update s", "sampler s"), _row("---", "---", "---", "---")]
        for r in sc["scaling"]:
            lines.append(_row(r["devices"], r["layout"], r.get("update_s"), r.get("sampler_s")))
        w = sc["weight_sync"]
        lines += ["", f"Weight sync trainer -> sampler layout: {w['param_bytes'] / 1e6:.1f} MB in "
                      f"{w['seconds'] * 1e3:.1f} ms (on device).", ""]
    rw = _load("rewards")
    if rw:
        lines += ["## Verifiers: verifications/s, pool vs serial", "", f"{rw['date']}.", "",
                  _row("workload", "serial /s", "pool /s"), _row("---", "---", "---")]
        for name in sorted({k.split("/")[0] for k in rw["runs"]}):
            pool = next(v for k, v in rw["runs"].items() if k.startswith(name + "/pool"))
            lines.append(_row(name, rw["runs"][f"{name}/serial"]["verifications_per_s"], pool["verifications_per_s"]))
        lines.append("")
    rs = _load("real_shapes")
    if rs:
        lines += real_shapes_section(rs)
    lines += ["No GPU was lent to the session that produced these numbers, so GPU MFU and decode HBM "
              "bandwidth utilisation are not reported here; `bench_scaling.py --peak-tflops` and "
              "`bench_sampling.py` (its decode share of bandwidth, over the HBM bandwidth it measures) "
              "report them when run on an accelerator.", ""]
    return "\n".join(lines)


_LONGTAIL_NAMES = {"transformers_8x64": "transformers `generate`, 8 batches of 64 rows",
                   "rljax_static_8x64": "rljax static, 8 batches of 64 rows",
                   "rljax_static_one_call": "rljax static, all 512 rows in one call"}


def _longtail_name(system: str, row: dict) -> str:
    if system in _LONGTAIL_NAMES:
        return _LONGTAIL_NAMES[system]
    m = re.fullmatch(r"rljax_continuous_s(\d+)_p(\d+)", system)
    if not m:
        return system
    prefill = f"prefill in the loop, {m[2]} prompts at a time" if int(m[2]) else "prompts prefilled up front"
    return f"rljax continuous, {m[1]} slots (drain to {row.get('drain_slots', '-')}), {prefill}"


def longtail_section(lt: dict) -> list[str]:
    """The table of `bench_sampling.py --longtail-only`: the RL-shaped long-tail workload."""
    w, v, m = lt["workload"], lt["versions"], lt["machine"]
    lengths = w["lengths"]
    lines = ["## Long-tail RL sampling: continuous vs static batching vs transformers", "",
             f"{m.get('cpus')} CPUs ({m.get('cpu_model') or 'model not recorded'}), jax {v['jax']}, torch "
             f"{v.get('torch')}, transformers {v.get('transformers')}. Workload (`bench/longtail.py`): "
             f"{w['prompts']} prompts x {w['samples']} samples, prompts of {w['prompt_len']} tokens, completion "
             f"lengths imposed by forcing EOS (lognormal: median {lengths['median']:g}, mean {lengths['mean']:g}, "
             f"{lengths['share_at_cap']:.1%} at the {w['cap']}-token cap, {lengths['total_tokens']:,} useful tokens); "
             "every system's output lengths are asserted equal to the imposed ones. Useful tok/s = the imposed "
             "tokens / net seconds (wall minus JAX's compile time inside the call); occupancy = live row-steps / "
             "computed row-steps. Other CPU-s = CPU seconds other processes used during the run: this is a "
             "shared 2-core machine, so compare systems within a row's run, not across dates. Static batching "
             "decodes 1,023 steps of 64 rows in every one of its 8 batches (each holds a row at the cap), so a "
             "row marked \"first 1 of 8 batches\" ran one batch and reports 8 times its time "
             "(`bench_sampling.py --static-batches 1`).", ""]
    for r in lt["results"]:
        rows = {s["system"]: s for s in r["systems"]}
        ratio = r["ratios"]
        static_s, theirs_s = rows[ratio["static"]]["net_s"], rows[ratio["transformers"]]["net_s"]
        theirs = rows[ratio["transformers"]]["runs"][0]
        lines += [f"**{r['config']}** ({r['date']}, {r['repeats']} repeat(s), median). transformers ran under "
                  f"its faster setting of a first-call calibration (`{theirs.get('setting', '-')}`: KV cache, "
                  f"torch threads).", "",
                  _row("system", "net s", "useful tok/s", "decode steps", "occupancy", "steps on finished rows",
                       "vs rljax static", "vs transformers", "other CPU-s"),
                  _row(*["---"] * 9)]
        for name, s in rows.items():
            other = sum(run.get("other_cpu_s", 0) for run in s["runs"]) / len(s["runs"])
            k = s["runs"][0].get("extrapolated_from_batches")
            label = _longtail_name(name, s) + (f" (first {k} of 8 batches, time x {8 // k})" if k else "")
            lines.append(_row(label, s["net_s"], s["useful_tok_s"], s["decode_steps"],
                              f"{s['occupancy']:.1%}", f"{s['wasted_row_step_share']:.1%}",
                              f"{static_s / s['net_s']:.2f}x", f"{theirs_s / s['net_s']:.2f}x", f"{other:.0f}"))
        lines += ["", f"Continuous at 64 slots over rljax static: **{ratio['continuous_vs_static']}x**; over "
                  f"transformers: **{ratio['continuous_vs_transformers']}x** (fastest continuous variant: "
                  f"{ratio['fastest_continuous_vs_static']}x and {ratio['fastest_continuous_vs_transformers']}x)."
                  + (f" Eight times transformers' fastest one-batch calibration call "
                     f"({ratio['transformers_first_call_x8_s']} s, a full pass free of its neighbours' load) "
                     f"gives {ratio['continuous_vs_transformers_first_call_x8']}x."
                     if "transformers_first_call_x8_s" in ratio else ""), ""]
    for note in lt.get("notes", []):
        lines += [note, ""]
    return lines


def real_shapes_section(rs: dict) -> list[str]:
    """The table of `bench_real_shapes.py`: one GRPO iteration at Qwen2.5-0.5B's shapes."""
    st, t, mem, rss, peer = rs["setup"], rs["times_s"], rs["compiled_mib"], rs["peak_rss_mib"], rs.get("peer")
    v = rs["versions"]
    lines = ["## Real shapes: Qwen2.5-0.5B on CPU", "",
             f"{rs['date']}, {rs['machine']['cpus']} CPUs ({rs['machine'].get('cpu_model') or 'model not recorded'}), "
             f"jax {v['jax']}, torch {v.get('torch')}, transformers {v.get('transformers')}; measured matmul peak "
             f"f32 {rs['matmul_peak_gflops']['float32']} / bf16 {rs['matmul_peak_gflops']['bfloat16']} GFLOP/s. "
             f"{st['model']}: {st['params']:,} params, {st['param_dtype']} params, {st['compute_dtype']} compute, "
             f"{st['algorithm']}, {st['micro_batches']} micro-batches{', remat' if st.get('remat') else ''}; "
             f"{st['prompts']} prompts x "
             f"{st['samples_per_prompt']} samples x {st['new_tokens']} new tokens, prompts "
             f"{st['prompt_tokens_min_max'][0]}-{st['prompt_tokens_min_max'][1]} tokens (chat template) padded to "
             f"{st['prompt_bucket']}: {st['rows']} rows x {st['seq_len']} tokens; the update "
             f"{'rescores the old log-probs, then ' if rs.get('update_rescores_old_logp') else ''}runs forward + "
             f"backward ({rs['update_gflop']:,.0f} GFLOP). Phases compiled and run one by one "
             f"(`bench/bench_real_shapes.py`, rljax at {rs['code']['commit']}).", "",
             _row("phase", "seconds", "rate", "peak RSS after it"), _row("---", "---", "---", "---"),
             _row("random init + train state", t["init"], "", f"{rss['model_and_state']:,.0f} MiB"),
             _row("compile sampler", t["compile_sample"], "", ""),
             _row("sample", t["sample"], f"{rs['sample_new_tok_s']} new tok/s", f"{rss['sample']:,.0f} MiB"),
             _row("verify (math)", t["reward"], f"first call {t.get('reward_first_call', '-')} s (starts the pool)",
                  ""),
             _row("compile update", t["compile_update"], "", ""),
             _row("update", t["update"], f"{rs['update_gflops']} GFLOP/s ({rs['update_frac_of_bf16_peak']:.0%} of "
                                         f"bf16 peak)", f"{rss['update']:,.0f} MiB")]
    if peer:
        lines.append(_row("peer: transformers (scoring pass +) fwd + bwd, torch bf16", peer["total_s"],
                          f"rljax update / peer = {rs['update_over_peer']}x (no optimiser step in the peer)",
                          f"{peer['peak_rss_mib']:,.0f} MiB (own process)"))
    u, un = mem["update"], mem["update_unchunked"]
    lines += ["", _row("update program (per device, MiB)", "arguments", "temporaries", "peak (args + out - aliased "
                       "+ temp)"), _row("---", "---", "---", "---"),
              _row(f"compiled, vocabulary chunks {st['logprob_chunks']['time']} steps x "
                   f"{st['logprob_chunks']['vocab']:,} ids", u["argument"], u["temp"], u["peak"]),
              _row("same update unchunked (abstract inputs)", un["argument"], un["temp"], un["peak"]), "",
              f"Peak RSS of the whole process: {rss['end']:,.0f} MiB ({rss['start']:,.0f} MiB at start); the "
              f"compiled update alone estimates {u['peak']:,.0f} MiB (one device). Unchunked over chunked update "
              f"temporaries: {rs['unchunked_over_chunked_update_temp']}x.", ""]
    for note in rs.get("notes", []):  # the reading notes written with the run (results JSON)
        lines += [note, ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", action="store_true", help="only rebuild BENCHMARKS.md from existing results")
    args = ap.parse_args()
    if not args.table:
        for name, cmd in SCRIPTS:
            t0 = time.perf_counter()
            print(f"== {name}", flush=True)
            subprocess.run([sys.executable, os.path.join(HERE, cmd[0]), *cmd[1:]], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
            print(f"   {time.perf_counter() - t0:.0f} s", flush=True)
    path = os.path.join(ROOT, "BENCHMARKS.md")
    table = build_table()
    kept = hand_written_sections(open(path).read() if os.path.exists(path) else "", table)
    table = "\n".join([table.rstrip("\n"), "", *kept]) if kept else table
    with open(path, "w") as f:
        f.write(table)
    print(table)


def _sections(text: str) -> list[tuple[str, str]]:
    """(title, text) of every "## " section of a markdown file, in order."""
    parts = re.split(r"(?m)^(?=## )", text)
    return [(part.splitlines()[0], part) for part in parts if part.startswith("## ")]


def hand_written_sections(old: str, generated: str) -> list[str]:
    """The sections of the old BENCHMARKS.md that `build_table` does not generate (written by
    hand from scripts run on their own, e.g. the memory plan), kept in their order so that
    rebuilding the table never drops them. A generated section is regenerated, never kept."""
    titles = {title for title, _ in _sections(generated)}
    return [body.rstrip("\n") + "\n" for title, body in _sections(old) if title not in titles]


if __name__ == "__main__":
    main()
