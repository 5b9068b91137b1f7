"""RL from a learned reward on the default job (issue 40): train a Bradley-Terry reward model with
`rljax train-rm` on preference pairs of the default task, then run the default job with the
verifier's weight at 0 and the reward model as the whole reward; held-out greedy accuracy is
still measured by the real verifier.

    .venv/bin/python bench/reward_model_learning.py [--seeds 0 1 2] [--rm-steps 3000]

Pairs: for each training problem of the default task (its training split; held-out questions
never appear), chosen = the reference answer, rejected = a wrong answer near it (the reference
plus a nonzero offset of 1-20, or with one digit changed, or its sign flipped): the mistakes a
policy that has learned the format makes. Held-out pairs come from the held-out split.
Writes bench/results/reward_model_learning.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = os.path.join(ROOT, "runs", "reward_model_learning")


def _wrong(answer: str, rng: random.Random) -> str:
    value = int(answer)
    kind = rng.random()
    if kind < 0.6:
        wrong = value + rng.choice([-1, 1]) * rng.randint(1, 20)
    elif kind < 0.85:
        digits = list(str(abs(value)))
        i = rng.randrange(len(digits))
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
        wrong = int("".join(digits)) * (-1 if value < 0 else 1)
    else:
        wrong = -value if value != 0 else rng.randint(1, 9)
    return str(wrong) if wrong != value else str(value + 1)


def write_pairs(path: str, examples, seed: int) -> int:
    from rljax.data.templates import PromptFormat, render_prompt

    rng = random.Random(seed)
    fmt = PromptFormat(template="{expression} =")
    with open(path, "w") as f:
        for e in examples:
            f.write(json.dumps({"prompt": render_prompt(e, fmt), "chosen": e.answer,
                                "rejected": _wrong(e.answer, rng)}) + "\n")
    return len(examples)


def _cli(args: list[str], log: str) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-m", "rljax.cli", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                       check=True)
    return time.perf_counter() - t0


def _evals(run_dir: str):
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None], rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rm-steps", type=int, default=3000)
    ap.add_argument("--rm-override", nargs="*", default=[])
    ap.add_argument("--override", nargs="*", default=[], help="key=value settings for every RL run")
    ap.add_argument("--runs", default=RUNS)
    ap.add_argument("--results", default=os.path.join(HERE, "results", "reward_model_learning.json"))
    args = ap.parse_args()
    os.makedirs(args.runs, exist_ok=True)
    from rljax.train import setup
    from rljax.train.config import load_config

    cfg = load_config(None)
    train_set, held_out, _ = setup.build_splits(cfg.data)
    pairs, eval_pairs = os.path.join(args.runs, "pairs.jsonl"), os.path.join(args.runs, "eval_pairs.jsonl")
    write_pairs(pairs, train_set, seed=0)
    write_pairs(eval_pairs, held_out, seed=1)
    rm_dir = os.path.join(args.runs, "rm")
    walls = {}
    if not os.path.exists(os.path.join(rm_dir, "summary.json")):
        walls["train_rm"] = _cli(["train-rm", f"pairs={pairs}", f"eval_pairs={eval_pairs}", f"output_dir={rm_dir}",
                                  f"steps={args.rm_steps}", *args.rm_override], os.path.join(args.runs, "train_rm.log"))
    rm = json.load(open(os.path.join(rm_dir, "summary.json")))
    print(f"reward model: held-out pair accuracy {rm['before']['eval/pair_accuracy']:.3f} -> "
          f"{rm['after']['eval/pair_accuracy']:.3f}")
    seeds = {}
    for seed in args.seeds:
        run = os.path.join(args.runs, f"rm_seed{seed}")
        if not os.path.exists(os.path.join(run, "metrics.jsonl")):
            walls[f"rm_seed{seed}"] = _cli(["train", f"seed={seed}", f"output_dir='{run}'", "metrics.progress_bar=false",
                                            "metrics.tensorboard=false", "reward.correct_weight=0",
                                            f"reward.model={{checkpoint = '{rm_dir}', normalize = 'group'}}",
                                            *args.override], os.path.join(args.runs, f"rm_seed{seed}.log"))
        evals, rows = _evals(run)
        agreement = [r["reward_model/pair_agreement"] for r in rows if "reward_model/pair_agreement" in r]
        seeds[str(seed)] = {"start": evals[0][1], "final": evals[-1][1], "gain_points": round(100 * (evals[-1][1] - evals[0][1]), 2),
                            "evals": evals, "pair_agreement_first10": sum(agreement[:10]) / max(len(agreement[:10]), 1),
                            "pair_agreement_last10": sum(agreement[-10:]) / max(len(agreement[-10:]), 1)}
        print(f"seed {seed}: held-out {evals[0][1]:.3f} -> {evals[-1][1]:.3f}")
    import jax

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": cpu, "cpus": os.cpu_count(),
           "load_avg_at_end": os.getloadavg(), "python": platform.python_version(), "jax": jax.__version__,
           "reward_model": {k: rm[k] for k in ("pairs", "held_out_pairs", "steps", "seconds", "before", "after")},
           "rm_overrides": args.rm_override, "overrides": args.override, "walls_s": walls, "seeds": seeds}
    with open(args.results, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
