"""Verifications per second, pool against serial: 512 math completions and 64 code completions.

Usage: ``python bench/bench_rewards.py [--workers N]``; writes ``bench/results/rewards.json``.
Serial = ``VerifierPool(0)`` (inline, one at a time; code still runs in sandbox processes).
"""

import argparse
import datetime
import json
import os
import platform
import random
import time
from pathlib import Path

import math_verify as mv
import reasoning_gym

import rljax
from rljax import rewards
from rljax.rewards.pool import VerifierPool, default_workers


def math_batch(n: int) -> tuple[list[dict], list[str]]:
    rng = random.Random(0)
    metas, texts = [], []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        gold = f"\\frac{{{a}}}{{{b}}}"
        style = i % 4
        pred = gold if i % 3 else f"{a + 1}/{b}"
        body = f"Reasoning about {a} and {b}... " * 8
        texts.append([f"{body}\\boxed{{{pred}}}", f"<think>{body}</think><answer>{pred}</answer>",
                      f"{body}\n#### {pred}", f"{body}\n${pred}$"][style])
        metas.append({"answer": gold})
    return metas, texts


def code_batch(n: int) -> tuple[list[dict], list[str]]:
    metas, texts = [], []
    for i in range(n):
        if i % 2:
            code = "```python\ndef add(a, b):\n    return a + b\n```"
            tests = [f"assert add({k}, {k}) == {2 * k}" for k in range(5)]
        else:
            code = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
            tests = [{"input": f"{k} 3\n", "output": str(3 * k + (i % 4 == 0))} for k in range(3)]
        texts.append(code)
        metas.append({"tests": tests})
    return metas, texts


def timed(reward, metas, texts, pool, repeats=1):
    reward.batch(metas[:4], texts[:4], pool=pool)  # warm the workers
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, _ = reward.batch(metas, texts, pool=pool)
        best = min(best, time.perf_counter() - t0)
    return len(texts) / best, float(out.total_b.mean()), int(out.failed_b.sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=default_workers())
    args = parser.parse_args()
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "workers": args.workers, "processor": platform.processor()},
               "versions": {"rljax": rljax.__version__, "python": platform.python_version(),
                            "math_verify": getattr(mv, "__version__", "0.9"),
                            "reasoning_gym": getattr(reasoning_gym, "__version__", "?")},
               "note": "shared machine under contention: numbers are noisy", "runs": {}}
    cases = {"math_512": (rewards.compose(rewards.MathAnswer()), *math_batch(512)),
             "code_64": (rewards.compose(rewards.CodeTests()), *code_batch(64))}
    with VerifierPool(args.workers) as pool:
        for name, (reward, metas, texts) in cases.items():
            for label, p in (("serial", VerifierPool(0)), (f"pool_{args.workers}", pool)):
                rate, mean, failed = timed(reward, metas, texts, p)
                results["runs"][f"{name}/{label}"] = {"verifications_per_s": round(rate, 2),
                                                      "mean_score": round(mean, 4),
                                                      "failed": failed}
                print(f"{name:9s} {label:8s} {rate:9.1f} verif/s  mean={mean:.3f} failed={failed}")
    out = Path(__file__).parent / "results" / "rewards.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
