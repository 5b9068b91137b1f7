"""The VL update's planned memory at Qwen2.5-VL-3B shapes, compiled on the CPU (issue 49).

    .venv/bin/python bench/vl_update_memory.py                      # the bench's vl:update batch
    .venv/bin/python bench/vl_update_memory.py --prompts 1 --text-layers 1 --new 64 --micro 1 --top 6

`bench/gpu/vl_phases.py`'s "update" case (64 rows of 808 tokens, 1,024 patches a row, 8
micro-batches, remat, f32 params, bf16 compute), lowered with abstract params (`jax.eval_shape`:
nothing of the 15 GB of weights is allocated) and compiled for this host; prints XLA's
`memory_analysis()` (temporaries, arguments) and, with --top, the largest f32 shapes in the
compiled HLO (a tower that saves its [heads, patches, patches] scores shows them there). The
CPU's buffer plan is not the GPU's, but what scales with rows, blocks and patches^2 shows in both.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def plan(prompts: int, samples: int, micro: int, new: int | None, text_layers: int | None, tower_depth: int | None,
         remat, top: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gpu.vl_phases as VP
    from rljax.models.vlm import init_vl_params
    from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
    from rljax.optim import OptimConfig
    from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update_step

    VP.PROMPTS, VP.SAMPLES = prompts, samples
    s = VP.shapes(False)
    if new is not None:
        s["new"] = new
    if text_layers is not None:
        s["text"]["num_hidden_layers"] = text_layers
    if tower_depth is not None:
        s["vision"]["depth"] = tower_depth
        s["vision"]["fullatt_block_indexes"] = [i for i in s["vision"]["fullatt_block_indexes"] if i < tower_depth]
    vl, _, images, _, _, tokens_bt, attn_bt, loss_bt, old_logp, rewards = VP.vl_batch(False)
    rows = tokens_bt.shape[0]
    batch = RolloutBatch(tokens_bt=jnp.asarray(tokens_bt), attn_mask_bt=jnp.asarray(attn_bt),
                         loss_mask_bt=jnp.asarray(loss_bt), sampler_logp_bt=jnp.asarray(old_logp),
                         rewards_b=jnp.asarray(rewards), group_ids_b=prompt_major_group_ids(rows, samples),
                         completion_len=s["new"], vision=images.rows_for(np.arange(prompts), samples, s["new"]))

    def make(key):
        return init_train_state(vl.text, init_vl_params(vl, key), AlgorithmConfig(algorithm="dr_grpo"),
                                OptimConfig(learning_rate=1e-6, max_grad_norm=1.0, weight_decay=0.01),
                                update_cfg=UpdateConfig(num_microbatches=micro, remat=remat))

    state = jax.eval_shape(make, jax.random.key(0))
    t = time.perf_counter()
    compiled = update_step.lower(state, batch, jax.random.key(0)).compile()
    mem = compiled.memory_analysis()
    out = dict(rows=rows, seq=int(tokens_bt.shape[1]), patches=int(batch.vision.pixels_bnp.shape[1]),
               microbatches=micro, remat=remat, tower_depth=vl.vision.depth, text_layers=vl.text.num_layers,
               temp_gib=round(mem.temp_size_in_bytes / 2**30, 2), argument_gib=round(mem.argument_size_in_bytes / 2**30, 2),
               compile_s=round(time.perf_counter() - t, 1))
    if top:
        sizes = {}
        for shape in set(re.findall(r"f32\[([0-9,]+)\]", compiled.as_text())):
            sizes[shape] = 4 * int(np.prod([int(d) for d in shape.split(",")]))
        out["largest_f32"] = [f"[{k}] {v / 2**30:.2f} GiB" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:top]]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--new", type=int, default=None, help="completion tokens (default 512)")
    p.add_argument("--text-layers", type=int, default=None, help="decoder depth (default 36)")
    p.add_argument("--tower-depth", type=int, default=None, help="tower depth (default 32)")
    p.add_argument("--remat", default="full", help="update.remat: none, selective, full")
    p.add_argument("--top", type=int, default=0, help="print the largest f32 shapes of the compiled HLO")
    a = p.parse_args(argv)
    print(plan(a.prompts, a.samples, a.micro, a.new, a.text_layers, a.tower_depth, a.remat, a.top), flush=True)


if __name__ == "__main__":
    main()
