"""An FSDP update keeps each row on the devices that hold it (`rljax.models.row_pinning`).

8 simulated devices, `mesh.fsdp=8`, 8 rows (4 prompts x 2 samples) of 8 prompt + 248 new tokens,
a 1-layer model whose activations outweigh its params: the update program the run compiles
(`make_stages`'s split update, and the fused iteration `make_iteration` compiles for a shared
sampler) must not all-gather every row's activations, as both did before the fix.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from rljax.models import init_params
from rljax.models.setup import build_tokenizer, policy_config
from rljax.plan.memory import _Pieces, _key
from rljax.rewards import as_callback
from rljax.rewards.config import build_reward
from rljax.sharding.placement import build_layouts
from rljax.stages.iteration import make_iteration, make_stages
from rljax.train.config import load_config
from rljax.update import init_train_state

FSDP = ["model.hidden_size=256", "model.intermediate_size=512", "model.num_layers=1", "model.num_heads=4",
        "model.num_kv_heads=1", "model.head_dim=64", "rl.prompts_per_iteration=4", "sampling.num_samples=2",
        "sampling.max_new_tokens=248", "data.max_prompt_tokens=8", "mesh.fsdp=8"]


def _rows_gathered(hlo: str, rows_tokens: int) -> int:
    """All-gathers in an HLO text whose result holds every row's activations (a dim of B*T, or
    [B, T, ...] of rank 3 or more, B = 8 rows): the rows replicated onto each device. A gathered
    [B, T] (a per-token log-prob or mask) is not counted: it is small."""
    shapes = re.findall(r"= \w+\[([\d,]+)\][^=]* all-gather\(", hlo)
    dims = [tuple(int(d) for d in s.split(",")) for s in shapes]
    return sum(1 for d in dims if rows_tokens in d or (len(d) >= 3 and d[:2] == (8, rows_tokens // 8)))


@pytest.fixture(scope="module")
def run():
    cfg = load_config("default", FSDP)
    tokenizer = build_tokenizer(cfg.model)
    model_cfg = policy_config(cfg.model, tokenizer)
    trainer, _ = build_layouts(cfg.mesh)
    state = init_train_state(model_cfg, init_params(model_cfg, jax.random.key(0)), cfg.algorithm, cfg.optim,
                             update_cfg=cfg.update, shaping=cfg.shaping)
    state = jax.device_put(state, trainer.tree(state))
    callback = as_callback(build_reward(cfg.reward), tokenizer, [{"answer": "1"}])
    pieces = _Pieces.build(cfg, model_cfg, tokenizer)
    abstract_batch = jax.eval_shape(pieces.sample_program, pieces.params, *pieces.prompts, _key(pieces.trainer))[0]
    return cfg, tokenizer, trainer, state, callback, pieces, abstract_batch


def _split_update(run):
    cfg, tokenizer, trainer, state, callback, _, abstract_batch = run
    stages = make_stages(cfg.sampling.with_tokenizer(tokenizer), callback, state, num_prompts=4, trainer=trainer)
    batch = jax.device_put(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_batch), stages.split.batch_sh)
    return stages.split.update_jit.lower(state, batch, jax.random.key(1)).compile()


def test_the_split_update_keeps_rows_on_their_devices(run):
    """With the pin, the compiled update all-gathers no [8 rows x T] activations, and the plan's
    update program (`rljax plan`) is the run's, byte for byte.
    Catches: the fix undone (`pin_rows` an identity: XLA keeps the embedding table's D sharding
    on the hidden states and all-gathers f32[2048, 256], every row's hidden states, onto every
    device: 16.8 MiB of temporaries a device against 10.4 pinned, measured when this test was
    written), and a plan that compiles its update unpinned (its temporaries differ)."""
    tokens = run[-1].tokens_bt.shape[1]
    pinned = _split_update(run)
    assert _rows_gathered(pinned.as_text(), 8 * tokens) == 0
    assert run[5].update_memory().temp_bytes == pinned.memory_analysis().temp_size_in_bytes


def _row_pins(jaxpr, rows: int, tokens: int, hidden: int) -> int:
    """`sharding_constraint`s in a traced program that put [rows, T, D] hidden states on rows over
    (data, fsdp)."""
    found = re.findall(rf"f32\[{rows},{tokens},{hidden}\] = sharding_constraint\[(.*?)\]", str(jaxpr), re.S)
    return sum(1 for params in found if "spec=P(('data', 'fsdp'),)" in params)


def test_the_fused_iteration_pins_its_update_and_not_its_sampler(run):
    """The one-program iteration of a shared-sampler FSDP run (`make_iteration` with the trainer
    layout, what a multi-device run with `mesh.sampler = "shared"` compiles), traced, not
    compiled: it pins the update's hidden states to the rows, exactly as many times as the split
    update program does, so the rollout in front of it (prefill and scoring) is not pinned.
    Catches: `fuse` calling the unpinned `update` (no pins; compiled, that program all-gathers
    f32[2048, 256], every row's hidden states, five times and holds 34.6 MiB of temporaries a
    device against 10.4 pinned, measured when this test was written), and a pin that leaks
    into the sampler (more pins than the update's)."""
    cfg, tokenizer, trainer, state, callback, pieces, abstract_batch = run
    _, tokens = abstract_batch.tokens_bt.shape
    iteration = make_iteration(cfg.sampling.with_tokenizer(tokenizer), callback, num_groups=4, layout=trainer)
    fused = _row_pins(jax.make_jaxpr(iteration)(state, *pieces.prompts, jax.random.key(1)), 8, tokens, 256)
    stages = make_stages(cfg.sampling.with_tokenizer(tokenizer), callback, state, num_prompts=4, trainer=trainer)
    split = _row_pins(jax.make_jaxpr(stages.split.update_jit)(state, abstract_batch, jax.random.key(1)), 8, tokens, 256)
    assert fused == split >= 1, (fused, split)
