"""The memory plan (`rljax plan`): right against the run's own arrays and program, scaling the way
the layout says, the named shapes at their published sizes, one line when a recipe does not fit.

Compiles are the cost here, so the programs are those of a 1-layer model on 8 simulated devices
and one plan is shared by the tests that read it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from rljax.rewards.config import build_reward
from rljax.models.setup import build_tokenizer, policy_config
from rljax.sharding.placement import build_layouts
from rljax import cli
from rljax.models import init_params
from rljax.plan.accelerators import GIB, SLICES, find, format_gib
from rljax.plan.advice import advise, candidates
from rljax.plan.memory import plan_memory, state_memory, update_memory
from rljax.plan.shapes import NAMED_SHAPES, model_config
from rljax.rewards import as_callback
from rljax.sharding import device_bytes
from rljax.train.config import load_config
from rljax.stages.iteration import make_iteration
from rljax.update import init_train_state

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=32", "rl.prompts_per_iteration=8", "sampling.num_samples=2",
        "sampling.max_new_tokens=4", "data.max_prompt_tokens=8"]


def tiny(*overrides: str):
    return load_config("default", [*TINY, *overrides])


@pytest.fixture(scope="module")
def planned():
    cfg = tiny()
    tokenizer = build_tokenizer(cfg.model)
    return cfg, tokenizer, plan_memory(cfg, tokenizer=tokenizer)


# ----------------------------------------------------------------------------- the plan is right


def test_plan_equals_the_runs_arrays_and_program(planned):
    """The state bytes equal the live train state's shards on every device (FSDP over 8), the
    one-program temporaries equal those of the iteration the loop compiles (real arrays, the real
    verifier callback), and the peak is within 10% of live arrays + compiled temporaries.
    Catches: counting a sharded leaf whole (or a replicated one once), missing the reference /
    optimiser moments, planning a different program than the loop compiles (other shardings,
    shapes or batch), adding the donated state twice."""
    cfg, tokenizer, plan = planned
    model_cfg = policy_config(cfg.model, tokenizer)
    trainer, _ = build_layouts(cfg.mesh)
    assert dict(trainer.mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1} == plan.state.mesh
    state = init_train_state(model_cfg, init_params(model_cfg, jax.random.key(0)), cfg.algorithm, cfg.optim,
                             update_cfg=cfg.update, shaping=cfg.shaping)
    state = jax.device_put(state, trainer.tree(state))
    for tree, planned_bytes in ((state.params, plan.state.params_bytes), (state.opt_state, plan.state.opt_state_bytes),
                                (state, plan.state.total_bytes)):
        per_device = device_bytes(tree)
        assert len(per_device) == 8 and set(per_device.values()) == {planned_bytes}

    callback = as_callback(build_reward(cfg.reward), tokenizer, [{"answer": "1"}])
    iteration = make_iteration(cfg.sampling.with_tokenizer(tokenizer), callback, num_groups=8, layout=trainer)
    prompts = jax.device_put((np.zeros((8, 8), np.int32), np.ones((8, 8), bool), np.zeros(8, np.int32)),
                             jax.sharding.NamedSharding(trainer.mesh, jax.sharding.PartitionSpec("fsdp")))
    ma = iteration.lower(state, *prompts, jax.random.key(1)).compile().memory_analysis()
    assert plan.iteration.temp_bytes == ma.temp_size_in_bytes
    live = max(device_bytes((state, prompts)).values())
    assert abs(plan.peak_bytes - (live + ma.temp_size_in_bytes)) <= 0.1 * (live + ma.temp_size_in_bytes)


def test_stage_peaks_count_the_state_once(planned):
    """Update peak = its arguments + unaliased outputs + temporaries, with the donated state an
    argument aliased by its output; sampling peak = the resident state plus the sampling program
    (whose policy params are the state's own). Catches: double-counting the donated state or the
    sampler's params, dropping the state that stays resident while sampling."""
    _, _, plan = planned
    u, s, st = plan.update, plan.sampler, plan.state
    assert u.alias_bytes == st.total_bytes  # the whole state is donated and reused
    assert plan.update_peak_bytes == u.argument_bytes + u.output_bytes - st.total_bytes + u.temp_bytes
    assert plan.sampler_peak_bytes == st.total_bytes - st.params_bytes + s.argument_bytes + s.output_bytes \
        + s.temp_bytes
    assert s.argument_bytes >= st.params_bytes  # the sampler reads the trainer's params in place


# ----------------------------------------------------------------------------- it scales


def test_state_scales_with_fsdp_and_objective():
    """Params halve when the FSDP axis doubles (up to the few small replicated norms); the
    reference exists only with a KL term and equals the params; the value model only for PPO
    (the backbone plus a [D] head and a bias), with its own optimiser moments. Shapes only.
    Catches: a reference or critic counted when the objective has none (or missed when it has),
    FSDP not dividing the per-device bytes."""
    base = state_memory(tiny("model.hidden_size=256", "model.intermediate_size=512"))
    half = state_memory(tiny("model.hidden_size=256", "model.intermediate_size=512", "mesh.devices=4"))
    assert base.mesh["fsdp"] == 8 and half.mesh["fsdp"] == 4
    assert 1.95 < half.params_bytes / base.params_bytes <= 2.0
    assert base.reference_bytes == 0 and base.value_bytes == 0
    kl = state_memory(tiny("algorithm.kl_coef=0.05"))
    assert kl.reference_bytes == kl.params_bytes > 0
    ppo = state_memory(load_config("ppo", TINY))
    assert ppo.value_bytes == ppo.params_bytes + (64 + 1) * 4 and ppo.reference_bytes == 0
    assert ppo.opt_state_bytes >= 2 * (ppo.params_bytes + ppo.value_bytes)  # Adam's two moments of both


def test_lora_state_counts_adapters_and_drops_reference_and_moments():
    """With `lora.rank` set, the plan's state is the frozen base (bf16 here: half the bytes), the
    adapters, Adam moments of the adapters only (2x their bytes, plus counters) and no reference
    even with a KL term; the sampler's merged copy is counted apart. Shapes only. Catches: a plan
    that still counts full-model moments or a reference copy under LoRA, or omits the adapters."""
    full = state_memory(tiny("algorithm.kl_coef=0.05", "mesh.devices=1"))
    lora = state_memory(tiny("algorithm.kl_coef=0.05", "mesh.devices=1", "lora.rank=4",
                             "model.param_dtype=bfloat16"))
    in_out = (64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + (64 + 128) + (64 + 128) + (128 + 64)  # q k v o gate up down
    adapters = 1 * 4 * 4 * in_out  # 1 layer x rank 4 x f32 bytes x (A [in, r] + B [r, out])
    assert lora.adapter_bytes == adapters and lora.reference_bytes == 0 < full.reference_bytes
    assert 2 * adapters <= lora.opt_state_bytes < 2 * adapters + 64
    assert lora.params_bytes == full.params_bytes // 2 and lora.sampler_merged
    assert lora.sampler_params_bytes == lora.params_bytes


def test_vocabulary_chunking_shows_in_update_temporaries():
    """At a 151,936-id vocabulary (tiny body, 2 rows x 31 scored steps per device), scoring in
    chunks of 2 time steps needs less update memory than one pass over the whole sequence, by at
    least a quarter of one f32 [rows, T, V] logits array (the compiler fuses part of the unchunked
    softmax, so it never holds all of it). Catches: a plan that does not compile the update's
    scoring, or ignores `update.logprob_chunk`."""
    from rljax.models import ModelConfig

    model_cfg = ModelConfig(vocab_size=151936, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=32, qkv_bias=True)
    lengths = ("sampling.max_new_tokens=16", "data.max_prompt_tokens=16")  # T = 32, 31 scored steps
    logits = (8 * 2 // 8) * 31 * 151936 * 4
    whole = update_memory(tiny(*lengths, "update.logprob_chunk=64"), model_cfg)
    chunked = update_memory(tiny(*lengths, "update.logprob_chunk=2"), model_cfg)
    assert whole.argument_bytes == chunked.argument_bytes  # same state and batch
    assert whole.temp_bytes - chunked.temp_bytes >= logits // 4, (whole, chunked)


# ----------------------------------------------------------------------------- named shapes


@pytest.mark.parametrize("name, count", [
    ("Qwen2.5-0.5B", 494_032_768), ("Qwen2.5-1.5B", 1_543_714_304), ("Qwen2.5-7B", 7_615_616_512),
    ("Qwen3-8B", 8_190_735_360), ("Llama-3.1-8B", 8_030_261_248), ("Gemma-2-9B", 9_241_705_984)])
def test_named_shapes_have_their_published_sizes(name, count):
    """Each named shape parses (Llama 3.1's rope scaling, Gemma 2's soft-caps and windows included)
    and has its published parameter count, embeddings included (0.49B, 1.54B, 7.62B, 8.19B, 8.03B,
    9.24B). Catches: a wrong dimension, tying or head size in a shape."""
    cfg = model_config(name.lower())
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert sum(x.size for x in jax.tree.leaves(params)) == count
    assert name in NAMED_SHAPES


def test_slices_name_their_chips():
    """v5p names count TensorCores, two per chip: v5p-16 is 8 devices of 95 GiB; v5e-8 is 8 of 16.
    Catches: planning v5p-16 as 16 devices."""
    assert (SLICES["v5p-16"].devices, SLICES["v5p-16"].accelerator.memory_gib) == (8, 95.0)
    assert (find("V5E-8").devices, find("v5e").memory_gib, find("8xH100").accelerator.memory_gib) == (8, 16.0, 80.0)


# ----------------------------------------------------------------------------- does not fit


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_plan_and_train_refuse_what_does_not_fit(tmp_path, capsys):
    """A device memory below the train state: `rljax plan` and `rljax train` print ONE line naming
    the memory, the estimate and the setting to change (a larger FSDP axis), exit 2, and train
    returns before building the run (no output directory) with no array allocated.
    Catches: a check after allocation, a multi-line error, advice without the setting."""
    mesh = ["mesh.data=2", "mesh.fsdp=4"]
    state = state_memory(tiny(*mesh))
    limit_gib = 0.9 * state.total_bytes / GIB
    before = len(jax.live_arrays())
    assert cli.main(["plan", "--config", "default", *TINY, *mesh, f"plan.device_memory_gib={limit_gib}"]) == 2
    line = _one_error_line(capsys)
    assert f"needs {format_gib(state.total_bytes)} per device (the train state)" in line
    assert f"has {format_gib(int(limit_gib * GIB))}" in line and "set mesh.data=1 mesh.fsdp=8" in line
    run_dir = tmp_path / "run"
    assert cli.main(["train", "--config", "default", *TINY, *mesh, f"plan.device_memory_gib={limit_gib}",
                     f"output_dir={run_dir}"]) == 2
    assert _one_error_line(capsys).endswith(line.split("error: ", 1)[1])
    assert not run_dir.exists() and len(jax.live_arrays()) == before


def test_advice_names_a_setting_whose_plan_fits(planned):
    """With the device memory just below the plan's peak, the advice names a change, and planning
    the recipe with that change applied (as `key=value` overrides) gives a peak within the limit.
    Catches: advice that does not fit, a setting string that does not parse into the change."""
    cfg, tokenizer, plan = planned
    limit = plan.peak_bytes - 1
    advice = advise(cfg, limit, "test device", tokenizer=tokenizer, plan=plan)
    assert not advice.fits and advice.setting is not None and advice.setting.startswith("update."), advice
    changed = plan_memory(tiny(*advice.setting.split()), tokenizer=tokenizer, sampler=plan.sampler)  # it is unchanged
    assert changed.peak_bytes <= limit, (advice, changed.peak_bytes)
    assert advice.setting in [c.setting for c in candidates(cfg, policy_config(cfg.model, tokenizer))]


# ----------------------------------------------------------------------------- the command


def test_cli_plan_prints_the_table_on_simulated_devices():
    """`rljax plan --devices 4` in a fresh process sets the simulated device count before jax
    starts and prints the per-device table and a fit line per accelerator, with none of the SPMD
    partitioner's rematerialisation notices that compiling this mesh logs. Catches: XLA_FLAGS set
    after jax is imported (one CPU device), a missing table row, the stderr filter left out."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-m", "rljax", "plan", "--config", "default", "--devices", "4",
                          "--stages-only", *TINY], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Involuntary full rematerialization" not in out.stderr  # XLA's notice: dropped unless --verbose
    assert "mesh data=1 fsdp=4 tensor=1" in out.stdout
    for row in ("params", "optimiser state", "update: temporaries", "sampler: temporaries", "peak"):
        assert f"\n  {row} " in out.stdout
    assert out.stdout.count("fits ") == 5 and "fits v5e   (   16 GiB per device): yes" in out.stdout


def test_packed_plan_advice_halves_the_token_budget():
    """With `update.packing` the plan compiles the packed update (micro-batches of
    `max_tokens_per_microbatch` tokens), and the advice halves that budget where the row-count
    advice would be refused by the config: the candidates name no `num_microbatches`, and the
    first, applied, plans a smaller update peak. Catches advice that suggests
    `update.num_microbatches` to a packed run (a ConfigError when applied)."""
    packed = ("update.packing=true", "update.max_tokens_per_microbatch=192")  # 16 buffers of 12 tokens
    cfg = tiny(*packed)
    tokenizer = build_tokenizer(cfg.model)
    model_cfg = policy_config(cfg.model, tokenizer)
    settings = [c.setting for c in candidates(cfg, model_cfg)]
    assert settings[0] == "update.max_tokens_per_microbatch=96" and "num_microbatches" not in " ".join(settings)
    base = plan_memory(cfg, tokenizer=tokenizer, one_program=False)
    halved = plan_memory(tiny(*packed, settings[0]), tokenizer=tokenizer, sampler=base.sampler,
                         one_program=False)
    assert halved.update.temp_bytes < base.update.temp_bytes, (halved.update, base.update)
