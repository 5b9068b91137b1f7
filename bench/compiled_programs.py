"""What a tree compiles, for comparing two trees without a quiet machine (issue 53's CPU check).

Wall times on a shared 2-core host cannot settle a few percent; the compiled programs can. For the
checkout at `--tree`, this lowers and compiles, in this process:
- `update`: `bench/bench_update.py`'s update step (B 32, T 128, dapo, AdamW, unrolled layers) for
  each `--configs` preset;
- `iteration`: the default job's one-program iteration (`configs/default.toml`, one device:
  sampling, verifier callback, update), as `rljax plan` builds it;
and prints, per program, XLA's `cost_analysis` (FLOPs, bytes accessed), `memory_analysis`
(temporaries) and the optimised HLO's opcode histogram, as one JSON line. Run it once per tree,
in separate processes, and compare the lines: identical numbers and histograms mean the same
program. BENCHMARKS.md (issue 53) has the comparison of b2bc166 with this session's tree.

    python bench/compiled_programs.py --tree /path/to/old/checkout > old.json
    python bench/compiled_programs.py --tree . > new.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys


def _describe(compiled) -> dict:
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    ops = collections.Counter(re.findall(r"= \S+ (\w[\w-]*)\(", compiled.as_text()))
    return {"flops": costs.get("flops"), "bytes": costs.get("bytes accessed"),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "instructions": sum(ops.values()),
            "ops": dict(sorted(ops.items()))}


def update_programs(configs) -> dict:
    import jax
    import jax.numpy as jnp

    import bench_update as bu
    from rljax.models import init_params, preset
    from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
    from rljax.optim import OptimConfig
    from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update_step

    out = {}
    for name in configs:
        cfg = preset(name)
        toks, attn, loss, old_logp, rewards = bu.make_batch(cfg)
        batch = RolloutBatch(jnp.asarray(toks), jnp.asarray(attn), jnp.asarray(loss), jnp.asarray(old_logp),
                             jnp.asarray(rewards), prompt_major_group_ids(bu.B, bu.GROUP),
                             completion_len=bu.T - bu.PROMPT)
        state = init_train_state(cfg, init_params(cfg, jax.random.key(0)),
                                 AlgorithmConfig(algorithm="dapo", clip_eps_high=bu.EPS_CLIP),
                                 OptimConfig(learning_rate=bu.LR, max_grad_norm=None),
                                 update_cfg=UpdateConfig(unroll_layers=True))
        out[f"update:{name}"] = _describe(update_step.lower(state, batch, jax.random.key(0)).compile())
    return out


def iteration_program() -> dict:
    from rljax.models.setup import build_tokenizer, policy_config
    from rljax.plan.memory import _Pieces, _key
    from rljax.stages.iteration import make_iteration
    from rljax.train.config import load_config

    cfg = load_config("default", [])
    tokenizer = build_tokenizer(cfg.model)
    pieces = _Pieces.build(cfg, policy_config(cfg.model, tokenizer), tokenizer)
    iteration = make_iteration(pieces.controls, pieces.callback, num_groups=cfg.rl.prompts_per_iteration,
                               dynamic_sampling=cfg.rl.dynamic_sampling, layout=pieces.trainer)
    return {"iteration:default": _describe(iteration.lower(pieces.state, *pieces.prompts,
                                                            _key(pieces.trainer)).compile())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--configs", nargs="+", default=["qwen2-tiny", "qwen2-small"])
    ap.add_argument("--skip-iteration", action="store_true")
    args = ap.parse_args()
    tree = os.path.abspath(args.tree)
    sys.path[:0] = [tree, os.path.join(tree, "bench")]  # that tree's rljax and bench_update, not this one's
    import rljax

    record = {"tree": tree, "rljax": rljax.__file__, **update_programs(args.configs)}
    if not args.skip_iteration:
        record.update(iteration_program())
    print(json.dumps(record))


if __name__ == "__main__":
    main()
