"""Remat modes of the trained forward (`rljax.models.remat`): selective remat changes memory only,
and recomputes no matmul.

One 3-layer f32 model; each mode's loss-and-gradient program is compiled once (jit's cache)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.models import from_hf_dict, init_params, token_logprobs
from rljax.models.remat import remat_mode

HF = dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=True,
          max_position_embeddings=512)


@pytest.fixture(scope="module")
def programs():
    """Per mode: (loss, grads, compiled program text, temporaries bytes) of a scoring loss."""
    cfg = from_hf_dict(HF, compute_dtype="float32", param_dtype="float32", attention="xla")
    params = init_params(cfg, jax.random.key(0))
    tokens_bt = jax.random.randint(jax.random.key(1), (4, 32), 0, 256)
    mask_bt = jnp.ones((4, 32), bool).at[0, :5].set(False)  # one left-padded row
    weights_bt = jax.random.uniform(jax.random.key(2), (4, 32))

    out = {}
    for mode in ("none", "selective", "full"):
        def loss(p, mode=mode):
            logp_bt, _ = token_logprobs(cfg, p, tokens_bt, mask_bt, remat=mode)
            return jnp.sum(logp_bt * weights_bt)

        fn = jax.jit(jax.value_and_grad(loss))
        compiled = fn.lower(params).compile()
        value, grads = fn(params)
        out[mode] = (value, grads, compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes)
    return out


def _dots(hlo: str) -> int:
    return len(re.findall(r"= \S+ dot\(", hlo))


def test_selective_remat_changes_nothing_but_memory(programs):
    """Selective remat's loss and every gradient equal the non-remat step's within 1e-6 (f32); its
    temporaries lie strictly between no remat's and full remat's.
    Catches: a selective mode that is no remat (temporaries equal none's), a policy that saves
    nothing (temporaries equal full's), a mode string that flips to full remat ("none" is truthy)."""
    loss0, grads0, _, temp_none = programs["none"]
    loss1, grads1, _, temp_sel = programs["selective"]
    _, _, _, temp_full = programs["full"]
    np.testing.assert_allclose(loss1, loss0, rtol=0, atol=1e-6)
    for g1, g0 in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0), strict=True):
        np.testing.assert_allclose(g1, g0, rtol=0, atol=1e-6)
    assert temp_full < temp_sel < temp_none, (temp_none, temp_sel, temp_full)


def test_selective_remat_recomputes_no_matmul(programs):
    """The compiled backward of selective remat runs no more dot ops than no remat (every
    projection's product and the attention's matmuls are saved); full remat runs more (it
    re-runs each layer's forward).
    Catches: a policy that saves only un-batched dots (the attention einsums recomputed), or
    misses the projections behind `_matmul`'s custom VJP (`dots_saveable` alone does)."""
    dots = {mode: _dots(hlo) for mode, (_, _, hlo, _) in programs.items()}
    assert dots["selective"] <= dots["none"] < dots["full"], dots


def test_remat_mode_names():
    """true/false are full/none; "auto" must be resolved from the plan first; typos are refused.
    Catches: True read as selective, "auto" silently run as some mode."""
    assert [remat_mode(x) for x in (False, None, True, "none", "selective", "full")] == \
        ["none", "none", "full", "none", "selective", "full"]
    with pytest.raises(ConfigError, match="choose_remat"):
        remat_mode("auto")
    with pytest.raises(ConfigError, match="choose auto, none, selective, full"):
        remat_mode("partial")
