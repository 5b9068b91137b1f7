"""The memory plan of a context-parallel run (`mesh.context`): the planned update is the program
the run compiles, its bytes are the run's within the plan's stated margin (docs/real_models.md:
treat a plan within ~10% of the device memory as not fitting), and a context mesh set by one
layout does not leak into the next.

One compile each for the plan and the run: a 1-layer model on 8 simulated devices
(context = 2 x fsdp = 4), rows of 8 prompt + 248 new tokens, so the activations (attention scores
most) outweigh the params.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from rljax.models import init_params
from rljax.models.context_parallel import context_mesh
from rljax.models.setup import build_tokenizer, policy_config
from rljax.plan.memory import _Pieces, _key
from rljax.rewards import as_callback
from rljax.rewards.config import build_reward
from rljax.sharding import device_bytes
from rljax.sharding.placement import build_layouts
from rljax.stages.iteration import make_stages
from rljax.train.config import load_config
from rljax.update import init_train_state

CP = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=1", "model.num_heads=4",
      "model.num_kv_heads=1", "model.head_dim=16", "rl.prompts_per_iteration=4", "sampling.num_samples=2",
      "sampling.max_new_tokens=248", "data.max_prompt_tokens=8", "mesh.fsdp=4", "mesh.context=2"]
MARGIN = 0.10  # the plan's stated margin (docs/real_models.md, "How to read a plan")


def test_planned_cp_update_equals_the_runs_program():
    """The plan's update program for context = 2 x fsdp = 4 (`rljax.plan`'s `update_memory`, from
    abstract inputs) has the temporaries, arguments and outputs of the update program the run
    compiles (`make_stages`'s split update, lowered from the real train state and batch placed
    on the trainer's mesh), and the plan's update peak (arguments + unaliased outputs +
    temporaries) is within 10% of what the run holds: the live state and batch on the fullest
    device plus that program's unaliased outputs and temporaries. The forward really is the
    context-parallel one (a context mesh is set while both compile).
    Catches: a plan that compiles its update without the context axis (XLA's own partitioning:
    activations not divided by the CP degree: 1.8x these temporaries, measured by planning
    under `jax.set_mesh(None)`), a plan that shards
    the state or the batch differently from the run, or counts a CP-replicated leaf once."""
    cfg = load_config("default", CP)
    tokenizer = build_tokenizer(cfg.model)
    model_cfg = policy_config(cfg.model, tokenizer)
    pieces = _Pieces.build(cfg, model_cfg, tokenizer)  # build_layouts sets the context mesh, as the run does
    assert context_mesh() is not None and dict(pieces.trainer.mesh.shape)["context"] == 2
    planned = pieces.update_memory()

    trainer, _ = build_layouts(cfg.mesh)
    state = init_train_state(model_cfg, init_params(model_cfg, jax.random.key(0)), cfg.algorithm, cfg.optim,
                             update_cfg=cfg.update, shaping=cfg.shaping)
    state = jax.device_put(state, trainer.tree(state))
    callback = as_callback(build_reward(cfg.reward), tokenizer, [{"answer": "1"}])
    stages = make_stages(cfg.sampling.with_tokenizer(tokenizer), callback, state, num_prompts=4, trainer=trainer)
    abstract_batch = jax.eval_shape(pieces.sample_program, pieces.params, *pieces.prompts, _key(pieces.trainer))[0]
    batch = jax.device_put(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_batch),
                           stages.split.batch_sh)
    ma = stages.split.update_jit.lower(state, batch, jax.random.key(1)).compile().memory_analysis()

    assert (planned.temp_bytes, planned.argument_bytes, planned.output_bytes, planned.alias_bytes) == (
        ma.temp_size_in_bytes, ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes)
    live = max(device_bytes((state, batch)).values())
    held = live + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    assert abs(planned.peak_bytes - held) <= MARGIN * held, (planned, held)
    assert planned.temp_bytes > live  # activations dominate: a plan that does not divide them is off by more


def test_a_layout_without_context_clears_the_context_mesh():
    """`build_layouts` sets a context (or expert) mesh as JAX's global mesh for the run's forward;
    building a layout without one (the plan's next candidate, e.g. `mesh.data=1 mesh.fsdp=8`, or
    a one-device run) unsets it, and a context layout built after sets it again. No compile.
    Catches the sticky global mesh: the advice path traced its next candidate's programs under the
    previous candidate's mesh and failed with JAX's "Mesh for all inputs should be equal"."""
    build_layouts(load_config("default", CP).mesh)
    assert context_mesh() is not None
    build_layouts(load_config("default", ["mesh.fsdp=8"]).mesh)
    assert context_mesh() is None and jax.sharding.get_abstract_mesh().empty
    build_layouts(load_config("default", CP).mesh)
    assert context_mesh() is not None
    build_layouts(load_config("default", ["mesh.devices=1"]).mesh)
    assert context_mesh() is None


@pytest.fixture(autouse=True)
def _no_mesh_left():
    yield
    jax.set_mesh(None)  # the next module starts without this module's context mesh


def test_advice_gives_context_back_to_fsdp_when_the_state_does_not_fit():
    """A recipe with context = 8 x fsdp = 1 replicates the params over context; with the device
    memory at 3/4 of that state, the advice (`rljax.plan.advice`) names the largest CP degree
    whose state fits, context = 4 x fsdp = 2 (half the state), in its one line. Shapes only, no compile. Catches: advice that only raises the CP degree ("no setting
    tried helps", as for Qwen2.5-7B at C = 8 on an H100: 85.1 GiB of f32 state), or that names the
    smallest state (context = 1) instead of the first candidate that fits."""
    from rljax.plan.advice import advise
    from rljax.plan.memory import state_memory

    shape = CP[:8] + ["model.hidden_size=256", "model.intermediate_size=512"]
    cfg = load_config("default", [*shape, "mesh.fsdp=1", "mesh.context=8"])
    state = state_memory(cfg)
    half = state_memory(load_config("default", [*shape, "mesh.fsdp=2", "mesh.context=4"]))
    assert 1.9 < state.total_bytes / half.total_bytes <= 2.0
    limit = int(0.75 * state.total_bytes)
    advice = advise(cfg, limit, "test device")
    assert (advice.stage, advice.setting, advice.setting_bytes) == (
        "the train state", "mesh.context=4 mesh.fsdp=2", half.total_bytes)
    assert not advice.fits and "set mesh.context=4 mesh.fsdp=2 (train state:" in advice.line()
