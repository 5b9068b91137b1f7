"""A stand-in training step shared by the sharding tests, and the worker of the two-process test.

As a script: `python multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR LAYOUT STEPS`
joins a localhost cluster (4 CPU devices per process), runs STEPS sharded training steps on its
own rows of each global batch, saves params + optimiser state collectively with orbax to
OUT_DIR/ckpt and, on process 0 only, writes the losses to OUT_DIR/losses.json.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import numpy as np

LAYOUTS = {"fsdp8": (1, 8, 1), "fsdp4_tp2": (1, 4, 2), "dp2_fsdp2_tp2": (2, 2, 2)}
BATCH, SEQ = 8, 12


def model_config():
    from rljax.models import preset
    return preset("qwen2-test")


def optimizer():
    import optax
    return optax.adamw(1e-3, weight_decay=0.01)


def loss_fn(cfg, params, tokens_bt, mask_bt):
    """Masked mean negative log-likelihood of the tokens (column 0 has no prefix)."""
    from rljax.models import token_logprobs
    logp_bt, _ = token_logprobs(cfg, params, tokens_bt, mask_bt)
    weight_bt = mask_bt.at[:, 0].set(False).astype(logp_bt.dtype)
    return -(logp_bt * weight_bt).sum() / weight_bt.sum()


def train_step(cfg, tx, params, opt_state, tokens_bt, mask_bt):
    """One step: grads by jax.grad, an optax update. The stand-in for rljax.update.update_step."""
    import jax
    import optax
    loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, tokens_bt, mask_bt))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def batch(step: int):
    """Global batch `step` as NumPy (deterministic, left-padded rows)."""
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, model_config().vocab_size, (BATCH, SEQ)).astype(np.int32)
    pad = rng.integers(0, SEQ // 2, (BATCH,))
    mask = np.arange(SEQ)[None, :] >= pad[:, None]
    return tokens, mask


def initial_state(layout=None):
    """Params and optimiser state from key 0, placed by `layout` (None: on the default device)."""
    import jax
    from rljax.models import init_params
    params = init_params(model_config(), jax.random.key(0))
    opt_state = optimizer().init(params)
    if layout is None:
        return params, opt_state
    # Host copies: identical in every process, so each can place its own shards.
    params, opt_state = jax.tree.map(np.asarray, (params, opt_state))
    return (jax.device_put(params, layout.params(params)),
            jax.device_put(opt_state, layout.opt_state(optimizer(), params)))


@functools.lru_cache(maxsize=None)
def sharded_step(layout_name: str):
    """(layout, train step compiled with explicit in/out shardings) on all global devices."""
    from rljax import sharding
    cfg, tx = model_config(), optimizer()
    mesh = sharding.make_mesh(sharding.MeshConfig(*LAYOUTS[layout_name]))
    layout = sharding.trainer_layout(mesh)
    params, _ = initial_state()
    p_sh, o_sh = layout.params(params), layout.opt_state(tx, params)
    tok_sh = layout.batch(np.zeros((BATCH, SEQ)))
    step = sharding.make_sharded(functools.partial(train_step, cfg, tx), mesh,
                                 in_shardings=(p_sh, o_sh, tok_sh, tok_sh),
                                 out_shardings=(p_sh, o_sh, layout.replicated))
    return layout, step


def main(argv):
    process_id, num_processes, port, out_dir, layout_name, steps = argv
    process_id, num_processes, steps = int(process_id), int(num_processes), int(steps)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from rljax import sharding
    sharding.initialize(sharding.DistributedConfig(f"localhost:{port}", num_processes, process_id,
                                                   initialization_timeout=60))
    import orbax.checkpoint as ocp

    layout, step = sharded_step(layout_name)
    params, opt_state = initial_state(layout)
    rows = sharding.process_rows(layout.mesh, BATCH)
    losses = []
    for i in range(steps):
        tokens, mask = batch(i)
        tokens, mask = sharding.global_batch((tokens[rows], mask[rows]), layout.mesh)
        params, opt_state, loss = step(params, opt_state, tokens, mask)
        losses.append(float(loss))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(out_dir, "ckpt"), {"params": params, "opt_state": opt_state})
    checkpointer.wait_until_finished()

    @sharding.main_process_only
    def write_losses():
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
    write_losses()
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
