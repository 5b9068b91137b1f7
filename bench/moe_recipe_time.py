"""Paired wall time of an RL iteration: `configs/moe_default.toml` against `configs/default.toml`
(issue 47's "within twice the dense default job's wall time").

Both recipes' runs are built in ONE process (random initial weights: no warm start; the
iteration's program and shapes do not depend on the weights), each compiled once, then their
iterations are timed in alternation, A B A B ..., so whatever else loads the machine hits both.
Reported per variant: median wall and CPU (process) seconds per iteration, and the MoE/dense
ratio of the medians. Variants (`--variants`): `dense` (the dense job), `moe:<moe_impl>` (the MoE
job at `model.moe_impl` auto, grouped or dense; on CPU auto and grouped are the same "blocks"
path), and `moe-noreplay:<moe_impl>` (routing replay and the router loss off, to price them).

`--stages` also times, per variant, the fused iteration's two stages compiled apart on one batch
(as bench/bench_iteration.py does): `sample` (prefill + decode, with the routing record when the
recipe replays) and `update` (`update_step` on the rollout batch), to find where the time goes.

    flock /tmp/rljax_heavy.lock timeout 1200 .venv/bin/python bench/moe_recipe_time.py \
        [--pairs 20] [--stages] [--layer] [--variants dense moe:auto moe:dense moe-noreplay:auto] [--out DIR]

Writes bench/results/moe_recipe_time.json with the date, CPU model, load average, commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_moe import cpu_model  # noqa: E402  (bench/ is the script's directory)

_COMPILES: list[float] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: _COMPILES.append(secs) if name == "/jax/core/compile/backend_compile_duration" else None)


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() + (" (dirty)" if subprocess.run(
                                  ["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--", "rljax"]).returncode else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Variant:
    """One recipe's run, its fused iteration compiled, stepped on the pipeline's batches."""

    def __init__(self, name: str, overrides: list[str], tmp: str):
        from rljax.drivers.sync import build_sync
        from rljax.train.config import load_config
        from rljax.train.run import abstract_train_state, build_run, new_train_state

        recipe, _, impl = name.partition(":")
        path = os.path.join(ROOT, "configs", ("default" if recipe == "dense" else "moe_default") + ".toml")
        ov = [f"output_dir={os.path.join(tmp, name.replace(':', '_'))}", "metrics.progress_bar=false", *overrides]
        if recipe == "moe-noreplay":  # the MoE recipe without routing replay and the router loss
            ov += ["algorithm.routing_replay=off", "algorithm.router_aux_coef=0.0"]
        if impl:
            ov.append(f"model.moe_impl={impl}")
        cfg = load_config(path, ov)
        self.name, self.run = name, build_run(cfg, resume=False, log=lambda *_: None)
        self.driver = build_sync(self.run, abstract_train_state(self.run))
        self.state = new_train_state(self.run, self.run.params)
        self.it = 0
        self.wall, self.cpu, self.compiles = [], [], 0
        self.params_total = int(sum(x.size for x in jax.tree.leaves(self.run.params)))
        self.params_active = int(self.run.model_cfg.num_active_params())

    def step(self, timed: bool = True) -> None:
        w, c, n = time.perf_counter(), _cpu_s(), len(_COMPILES)
        self.state, metrics, _ = self.driver.step(self.state, self.it)
        jax.block_until_ready(metrics)
        if timed:
            self.wall.append(time.perf_counter() - w)
            self.cpu.append(_cpu_s() - c)
            self.compiles += len(_COMPILES) - n  # a timed iteration that compiles is a bug
        self.it += 1

    def flops(self) -> float | None:
        """The fused iteration's FLOPs as XLA counts them in the lowered program (no compile)."""
        from rljax.drivers.base import prompt_arrays

        try:
            prompts = prompt_arrays(next(iter(self.run.data.dataset)), self.run.trainer_layout)
            cost = self.driver.iteration.lower(self.state, *prompts, jax.random.key(0)).cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            return float(cost["flops"])
        except Exception as e:  # noqa: BLE001  (a count this jax cannot give is reported as missing)
            print(f"{self.name}: no FLOP count ({type(e).__name__}: {e})")
            return None

    def stages(self, reps: int) -> dict:
        """The rollout (prefill + decode, the routing record when the recipe replays, the verifier
        callback, the old/reference log-probs it needs) and the update compiled apart
        (`rljax.stages.iteration.make_stages`, the host-steered driver's programs), on one batch:
        median of `reps` calls after a compiling one."""
        from rljax.drivers.base import pipeline_callback, prompt_arrays
        from rljax.stages.iteration import make_stages

        run = self.run
        st = make_stages(run.controls, pipeline_callback(run), self.state, num_prompts=run.cfg.rl.num_prompts,
                         trainer=run.trainer_layout)
        prompts = prompt_arrays(next(iter(run.data.dataset)), run.trainer_layout)
        t_sample, t_update = [], []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            batch, metrics, _ = st.sample(self.state, *prompts, jax.random.key(i))
            jax.block_until_ready((batch, metrics))
            t1 = time.perf_counter()
            self.state, metrics = st.update(self.state, batch, jax.random.key(i))
            jax.block_until_ready(metrics)
            t_sample.append(t1 - t0)
            t_update.append(time.perf_counter() - t1)
        return {"sample_s": float(np.median(t_sample[1:])), "update_s": float(np.median(t_update[1:]))}

    def summary(self) -> dict:
        return {"wall_median_s": float(np.median(self.wall)), "cpu_median_s": float(np.median(self.cpu)),
                "wall_s": self.wall, "cpu_s": self.cpu, "compiles_while_timed": self.compiles,
                "params_total": self.params_total, "params_active": self.params_active}


def layer_times(reps: int = 9) -> dict:
    """One MLP's forward and forward+backward at the recipe's shapes (D 128; 8 experts of width
    128, top-2, against the dense job's SwiGLU of width 256: the same active width), at the
    update's token count (64 prompts x 8 samples x 18 tokens) and a decode step's (512 rows):
    `experts_apply` "blocks" (CPU's grouped path) and "dense" (the all-experts einsum), and the
    dense SwiGLU; the three interleaved, median milliseconds."""
    import jax.numpy as jnp

    from rljax.models.experts import ExpertWeights, experts_apply
    from rljax.models.layers import gated_activation

    e, k, d, f = 8, 2, 128, 128
    r = np.random.default_rng(0)
    out = {}
    for t in (9216, 512):
        x = jnp.asarray(r.standard_normal((t, d)), jnp.float32)
        ids = jnp.asarray(np.argsort(-r.standard_normal((t, e)), 1)[:, :k], jnp.int32)
        gates = jnp.asarray(r.random((t, k)), jnp.float32)
        w = ExpertWeights(*(jnp.asarray(r.standard_normal(s) * 0.05, jnp.float32) for s in
                            ((e, d, f), (e, d, f), (e, f, d))))
        dw = tuple(jnp.asarray(r.standard_normal(s) * 0.05, jnp.float32) for s in ((d, 2 * f), (d, 2 * f), (2 * f, d)))
        fns = {}
        for impl in ("blocks", "dense"):
            loss = (lambda impl: lambda x, w, g, ids: jnp.sum(experts_apply(x, ids, g, w, impl=impl) ** 2))(impl)
            fns[f"moe {impl}"] = (loss, (x, w, gates, ids), (0, 1, 2))  # ids an argument: no constant-folded sort
        fns["swiglu 256"] = (lambda x, w: jnp.sum((gated_activation(x @ w[0], x @ w[1], "silu", jnp.float32)
                                                   @ w[2]) ** 2), (x, dw), (0, 1))
        progs = {}
        for name, (loss, args, diff) in fns.items():
            progs[f"{name} fwd"] = (jax.jit(loss), args)
            progs[f"{name} fwd+bwd"] = (jax.jit(jax.grad(loss, argnums=diff)), args)
        times = {name: [] for name in progs}
        for fn, args in progs.values():
            jax.block_until_ready(fn(*args))
        for _ in range(reps):
            for name, (fn, args) in progs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[name].append(time.perf_counter() - t0)
        out[t] = {name: float(np.median(v)) * 1e3 for name, v in times.items()}
        print(f"T={t} tokens: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in out[t].items()), flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=20, help="timed iterations of each variant, interleaved")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations of each (the first compiles)")
    ap.add_argument("--variants", nargs="+", default=["dense", "moe:auto", "moe:dense", "moe-noreplay:auto"])
    ap.add_argument("--stages", action="store_true", help="also time sampling and the update apart")
    ap.add_argument("--stage-reps", type=int, default=5)
    ap.add_argument("--override", action="append", default=[], help="key=value for every variant's recipe")
    ap.add_argument("--layer", action="store_true", help="also time one MLP alone (`layer_times`)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args(argv)

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        variants = [Variant(v, ["data.size=3000", *args.override], tmp) for v in args.variants]
        compile_s = {}
        for v in variants:
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                v.step(timed=False)
            compile_s[v.name] = time.perf_counter() - t0
        for _ in range(args.pairs):
            for v in variants:
                v.step()
        stages = {v.name: v.stages(args.stage_reps) for v in variants} if args.stages else {}
    rows = {v.name: v.summary() | {"warmup_with_compile_s": compile_s[v.name], "iteration_flops": v.flops(),
                                   **stages.get(v.name, {})} for v in variants}
    layer = layer_times() if args.layer else {}
    base = rows.get("dense")
    head = dict(date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}", cpu=cpu_model(),
                cpus=os.cpu_count(), load_before=load_before[0], load_after=os.getloadavg()[0], commit=commit(),
                jax=jax.__version__, pairs=args.pairs, overrides=args.override)
    print(json.dumps(head))
    print("| variant | params (active) | GFLOP/iter | wall s/iter | CPU s/iter | wall / dense | CPU / dense |"
          + (" sample s | update s |" if stages else ""))
    for name, r in rows.items():
        ratio = (f"{r['wall_median_s'] / base['wall_median_s']:.2f}x | {r['cpu_median_s'] / base['cpu_median_s']:.2f}x"
                 if base else "- | -")
        extra = f" {r['sample_s']:.3f} | {r['update_s']:.3f} |" if stages else ""
        gflop = "-" if r["iteration_flops"] is None else f"{r['iteration_flops'] / 1e9:.2f}"
        print(f"| {name} | {r['params_total']:,} ({r['params_active']:,}) | {gflop} | {r['wall_median_s']:.3f} | "
              f"{r['cpu_median_s']:.3f} | {ratio} |{extra}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "moe_recipe_time.json")
    with open(path, "w") as f:
        json.dump(dict(header=head, rows=rows, layer_ms=layer), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
