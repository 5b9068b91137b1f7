"""LoRA on the functional model (rljax.lora): fresh adapters change nothing, the unmerged forward
equals the merged weights on the full-sequence and the KV-cached paths, targets resolve by
pattern, dropout runs only with a key, and a PEFT directory that rljax cannot reproduce is one
error line. Parity with peft itself is tests/lora/test_peft_io.py; training, tests/lora/test_weight.py."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from rljax.errors import CheckpointError, ConfigError
from rljax.lora import (LoraConfig, adapter_shapes, attach, init_adapters, load_peft, merge, merged_model,
                        resolve_targets, save_peft)
from rljax.models import forward, init_cache, init_params, preset

TIED = preset("qwen2-test")  # tied embedding: targets embed, never lm_head
UNTIED = preset("qwen2-test", tie_embeddings=False)
ALL = LoraConfig(rank=4, alpha=8.0, targets=(".*",))  # every weight the model has, embedding and head included
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, TIED.vocab_size, (2, 9)), jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, tokens=TOKENS):
    """Full-sequence logits, compiled (op by op, the forward takes several times as long)."""
    return forward(cfg, params, tokens)[0]


@functools.partial(jax.jit, static_argnums=0)
def _decode(cfg, params, tokens):
    """Logits of the KV-cached path, one token per step: the sampler's layer-unstacked forward."""
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
    steps = []
    for t in range(tokens.shape[1]):
        logits, cache = forward(cfg, params, tokens[:, t:t + 1], positions_bt=jnp.full((tokens.shape[0], 1), t),
                                cache=cache)
        steps.append(logits)
    return jnp.concatenate(steps, axis=1)


def _random_adapters(cfg, lora, seed=1, scale=0.2):
    """Adapters with every A and B random (a fresh B = 0 would hide any error in the B branch)."""
    fresh = init_adapters(cfg, lora, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(fresh)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


@pytest.fixture(scope="module")
def untied_params():
    return init_params(UNTIED, jax.random.key(0))


def test_fresh_adapters_leave_every_logit_unchanged():
    """PEFT's init (A random, B = 0; the embedding's A = 0) makes the adapted model the base model,
    bitwise: y + s (x A) 0 = y. Catches: B (or the embedding's A) initialised non-zero, which
    would start RL from a perturbed policy."""
    params = init_params(TIED, jax.random.key(0))
    adapters = init_adapters(TIED, ALL, jax.random.key(3))
    assert float(jnp.abs(adapters["layers"]["q"]["lora_a"]).max()) > 0  # A is random: the branch is live
    base = _logits(TIED, params)
    adapted = _logits(TIED, attach(params, adapters, ALL))
    np.testing.assert_array_equal(np.asarray(adapted), np.asarray(base))


@pytest.mark.parametrize("rslora", [False, True])
def test_unmerged_forward_equals_merged_weights(untied_params, rslora):
    """x W + s (x A) B (the trained forward, never merged) equals x (W + s A B) (the sampler's merged
    copy and the HF export) on every target, embedding and head included, within 2e-5 in f32, and
    both differ from the base by far more. With rsLoRA the scale is alpha / sqrt(r).
    Catches: a transposed or mis-reshaped A or B in either path (o's two contracted head axes,
    the head's [D, r] x [r, V]), a scale of alpha / r under rsLoRA, or a merge that drops a target."""
    lora = ALL.replace(rslora=rslora)
    assert lora.scale == (8.0 / 2.0 if rslora else 8.0 / 4.0)
    adapters = _random_adapters(UNTIED, lora)
    unmerged = _logits(UNTIED, attach(untied_params, adapters, lora))
    cfg_m, merged_params = merged_model(UNTIED, untied_params, adapters, lora)
    merged = _logits(cfg_m, merged_params)
    base = _logits(UNTIED, untied_params)
    np.testing.assert_allclose(np.asarray(unmerged), np.asarray(merged), atol=2e-5, rtol=0)
    assert float(jnp.abs(unmerged - base).max()) > 0.1


def test_cached_decode_and_tied_merge_keep_the_function():
    """On a tied model, the KV-cached path (the sampler's: layers unstacked, one token per step)
    over attached adapters equals the full-sequence forward, and `merge` (the embedding stays
    attached, so the tied head keeps the base weight as in PEFT) and `merged_model` (untied for
    export) compute the same logits. Catches: adapters that the cached path's per-layer split
    drops, or a merged tied embedding that also moves the head."""
    params = init_params(TIED, jax.random.key(0))
    adapters = _random_adapters(TIED, ALL)
    attached = attach(params, adapters, ALL)
    full = _logits(TIED, attached)
    decoded = _decode(TIED, attached, TOKENS[:, :5])  # causal: the first 5 columns of the full forward
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full)[:, :5], atol=2e-5, rtol=0)
    sampler = _logits(TIED, merge(params, adapters, ALL))
    cfg_m, exported = merged_model(TIED, params, adapters, ALL)
    assert not cfg_m.tie_embeddings and TIED.tie_embeddings
    export = _logits(cfg_m, exported)
    np.testing.assert_allclose(np.asarray(sampler), np.asarray(full), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(export), np.asarray(full), atol=2e-5, rtol=0)


def test_dropout_runs_only_with_a_key(untied_params):
    """LoRA dropout (rate 0.5) changes the adapted logits only when a key is given (the trained
    forward), never in the sampler or scoring passes (no key), and rate 0 ignores the key.
    Catches: dropout applied without a key (a stochastic sampler and reference) or never applied."""
    lora = LoraConfig(rank=4, dropout=0.5)
    adapters = _random_adapters(UNTIED, lora)
    plain = _logits(UNTIED, attach(untied_params, adapters, lora))
    dropped = _logits(UNTIED, attach(untied_params, adapters, lora, dropout_key=jax.random.key(0)))
    off = lora.replace(dropout=0.0)
    keyed_off = _logits(UNTIED, attach(untied_params, adapters, off, dropout_key=jax.random.key(0)))
    assert float(jnp.abs(dropped - plain).max()) > 1e-2
    np.testing.assert_array_equal(np.asarray(keyed_off), np.asarray(plain))


def test_targets_resolve_by_name_path_or_peft_module():
    """Targets are regexes over our names, params paths and HF module names; each must match a
    weight of this model. Catches: a PEFT target_modules list that silently adapts nothing, or a
    tied model's lm_head accepted (it has none)."""
    names = lambda lora, cfg=TIED: tuple(t.name for t in resolve_targets(lora, cfg))  # noqa: E731
    assert names(LoraConfig(rank=2)) == ("q", "k", "v", "o", "gate", "up", "down")
    assert names(LoraConfig(rank=2, targets=("v_proj", "layers/q", "embed_tokens"))) == ("embed", "q", "v")
    assert names(LoraConfig(rank=2, targets=(".*",))) == ("embed", "q", "k", "v", "o", "gate", "up", "down")
    assert names(LoraConfig(rank=2, targets=("lm_head",)), UNTIED) == ("lm_head",)
    with pytest.raises(ConfigError, match="matches no weight of this model .*tied"):
        resolve_targets(LoraConfig(rank=2, targets=("lm_head",)), TIED)
    with pytest.raises(ConfigError, match="not a regex"):
        LoraConfig(rank=2, targets=("q(",))
    shapes = adapter_shapes(TIED, LoraConfig(rank=3, targets=("o", "embed")))
    assert shapes == {"embed": ((128, 3), (3, 64)), "o": ((2, 4, 16, 3), (2, 3, 64))}


def test_peft_directories_rljax_cannot_reproduce_are_one_line(tmp_path):
    """A DoRA adapter, one on some layers only, or a tensor of no known target is a CheckpointError
    naming it; a saved adapter loads back bitwise. Catches: silently loading an adapter whose math
    differs (DoRA), or one missing layers (zero-filled, a different model)."""
    lora = LoraConfig(rank=2, targets=("q", "down"))
    adapters = _random_adapters(TIED, lora)
    save_peft(TIED, adapters, lora, tmp_path / "ok")
    loaded_lora, loaded = load_peft(tmp_path / "ok", TIED)
    assert (loaded_lora.rank, loaded_lora.alpha, loaded_lora.targets) == (2, lora.alpha, ("q", "down"))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded, adapters)

    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        load_peft(tmp_path / "dora", TIED)
    from safetensors.numpy import load_file
    tensors = load_file(tmp_path / "ok" / "adapter_model.safetensors")
    for name, drop in (("partial", "layers.1.self_attn.q_proj"), ("unknown", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
        kept = {k: v for k, v in tensors.items() if drop is None or drop not in k}
        if drop is None:
            kept["base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"] = np.zeros((2, 4), np.float32)
        save_file(kept, str(tmp_path / name / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj is adapted in layers \[0\], not in all 2"):
        load_peft(tmp_path / "partial", TIED)
    with pytest.raises(CheckpointError, match="no LoRA weight of a supported target"):
        load_peft(tmp_path / "unknown", TIED)
