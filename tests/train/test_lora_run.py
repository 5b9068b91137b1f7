"""`rljax train` with a `[lora]` section, end to end: the run trains adapters on the warm-started
base, checkpoints them, resumes them, exports a merged HF model (`rljax export --merge`) and a
PEFT adapter with its base (`--adapter`), and a new run continues from that PEFT adapter."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.cli import main
from rljax.lora import attach, load_peft
from rljax.models import forward, load_hf
from rljax.train.config import load_config
from rljax.drivers import DRIVERS
from rljax.train.loop import train
from rljax.train.run import abstract_train_state, build_run, new_train_state
from rljax.train.start import initial_state

from test_loop import TINY

LORA_RUN = TINY + ["lora.rank=4", "lora.alpha=8", "lora.targets=['.*']", "warm_start.steps=10", "rl.iterations=2",
                   "rl.prompts_per_iteration=8", "eval.every=100", "checkpoint.every=2", "mesh.devices=1"]
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 15, (2, 9)), jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params):
    return forward(cfg, params, TOKENS)[0]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-run")
    return train(load_config(None, LORA_RUN + [f"output_dir='{out}'"]), log=lambda *_: None)


def test_a_lora_run_trains_adapters_and_exports_both_forms(lora_run, tmp_path):
    """After warm start + 2 LoRA iterations the state holds adapters (their B moved) on the base;
    `rljax export --merge` writes a HF model whose logits are the adapted policy's (1e-5), and
    `--adapter` writes a PEFT directory plus `base/`, which load back to the state's adapters and
    base bitwise. Catches: a loop that trains the base instead, a checkpoint without the adapters
    (the export would be the base), or an export that drops or mis-merges them."""
    state, run_dir = lora_run.state, lora_run.output_dir
    assert state.lora is not None and state.ref_params is None
    assert float(jnp.abs(state.adapters["layers"]["q"]["lora_b"]).max()) > 0
    want = np.asarray(_logits(state.model_cfg, attach(state.params, state.adapters, state.lora)))
    assert main(["export", str(run_dir), str(tmp_path / "merged"), "--merge", "--step", "latest"]) == 0
    cfg_m, merged = load_hf(tmp_path / "merged")
    assert not cfg_m.tie_embeddings  # the adapted tied embedding leaves the head at the base: untied
    np.testing.assert_allclose(np.asarray(_logits(cfg_m, merged)), want, atol=1e-5, rtol=0)
    assert main(["export", str(run_dir), str(tmp_path / "adapter"), "--adapter", "--step", "latest"]) == 0
    cfg, base = load_hf(tmp_path / "adapter" / "base")
    lora, adapters = load_peft(tmp_path / "adapter", cfg)
    assert (lora.rank, lora.alpha, lora.scale) == (4, 8.0, state.lora.scale)
    for got, ref in zip(jax.tree.leaves((base, adapters)), jax.tree.leaves((state.params, state.adapters)),
                        strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_resume_restores_and_a_peft_adapter_continues(lora_run, tmp_path):
    """Resuming the run restores its adapters and optimiser state bitwise; a new run with
    model.checkpoint = the exported base and lora.adapter = the exported PEFT directory starts from
    those adapters (rank and targets from adapter_config.json) with a fresh optimiser. Catches: a
    restore that reinitialises the adapters, or `lora.adapter` ignored (fresh B = 0)."""
    cfg = load_config(None, LORA_RUN + [f"output_dir='{lora_run.output_dir}'"])
    run = build_run(cfg, resume=True, log=lambda *_: None)
    template = abstract_train_state(run)
    state, start, _ = initial_state(run, DRIVERS[cfg.driver].build(run, template), template, resume=True)
    assert start == 2
    for got, ref in zip(jax.tree.leaves((state.adapters, state.opt_state)),
                        jax.tree.leaves((lora_run.state.adapters, lora_run.state.opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert main(["export", str(lora_run.output_dir), str(tmp_path / "adapter"), "--adapter", "--step", "2"]) == 0
    tokenizer = cfg.model.tokenizer
    cont = load_config(None, LORA_RUN + ["lora.rank=0", f"lora.adapter='{tmp_path / 'adapter'}'",
                                         f"model.checkpoint='{tmp_path / 'adapter' / 'base'}'",
                                         f"model.tokenizer='{tokenizer}'", f"output_dir='{tmp_path / 'cont'}'"])
    run = build_run(cont, resume=False, log=lambda *_: None)
    assert run.lora.rank == 4 and run.lora.targets == ("embed", "q", "k", "v", "o", "gate", "up", "down")
    fresh = new_train_state(run, run.params)
    for got, ref in zip(jax.tree.leaves(fresh.adapters), jax.tree.leaves(lora_run.state.adapters), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
