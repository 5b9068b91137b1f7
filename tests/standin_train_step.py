"""A stand-in training step (plain NLL + AdamW) shared by the sharding tests: one process on
simulated devices, compiled with explicit shardings for each named layout. The two-process test
(tests/train/test_multihost.py) runs the real `rljax train` instead."""

from __future__ import annotations

import functools

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
