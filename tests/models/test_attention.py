"""Fused attention paths against the einsum reference (rljax.models.attention).

On a CPU, cuDNN cannot run: its path is checked twice over. (1) The wrapper's masks, row
alignment and windows run through JAX's XLA implementation of the same `dot_product_attention`
call (`implementation="xla"`, same arguments), against our einsum reference, forward and
gradients. (2) The update step and the prefill lowered for the `cuda` platform contain cuDNN's
fused-attention custom call and no [B, heads, T, T] f32 buffer. The splash kernel runs in Pallas
interpret mode. Ragged left padding, right padding, grouped heads, windows and soft-capping are
covered."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.models.attention as attn_mod
from rljax.errors import ConfigError
from rljax.models import init_params, preset, token_logprobs
from rljax.models.attention import (align_rows, attention, cudnn_attention, describe_attention, resolve_attention,
                                    roll_rows)
from rljax.models.transformer import hidden_states, init_cache, prefill_cache


def _ragged(b=4, t=24, seed=0):
    """Rows: a left-padded prompt and a right-padded completion, one row with no padding and one
    with a single real token."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, t), bool)
    spans = [(3, 20), (0, t), (7, 8), (1, 15)][:b]
    for i, (lo, hi) in enumerate(spans):
        mask[i, lo:hi] = True
    tokens = rng.integers(0, 128, (b, t))
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)


def _qkv(dtype, b=4, t=24, n=4, k=2, h=16, seed=1):
    rng = np.random.default_rng(seed)
    make = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32).astype(dtype)
    return make(b, t, n, h), make(b, t, k, h), make(b, t, k, h)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_cudnn_call_on_aligned_rows_equals_the_reference(window, dtype, tol):
    """The cuDNN call's form (left-aligned rows, per-row lengths, causal, a left window of
    window - 1 keys), run by JAX's XLA implementation, equals the einsum reference on every real
    query, forward and the gradients of q, k and v, with grouped heads (4 query, 2 kv).

    Catches: a roll in the wrong direction or by the wrong amount, lengths counting padding,
    a window off by one (window instead of window - 1), a missing causal flag. bf16: 2e-2 is the
    bf16 rounding of the outputs (the reference keeps f32 outputs, the call returns bf16)."""
    cfg = preset("qwen2-test", sliding_window=window or None)
    _, mask = _ragged()
    q, k, v = _qkv(dtype)
    pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    kpos = jnp.where(mask, pos, -1)
    shift, lengths = align_rows(mask)
    g = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32) * mask[:, :, None, None]

    def ref(q, k, v):
        return jnp.sum(attention(q, k, v, pos, kpos, window, cfg) * g)

    def fused(q, k, v):
        roll = lambda x: roll_rows(x, shift)
        out = cudnn_attention(roll(q), roll(k), roll(v), lengths, window, cfg, implementation="xla")
        return jnp.sum(roll_rows(out, -shift) * g)

    out_ref = attention(q, k, v, pos, kpos, window, cfg)
    roll = lambda x: roll_rows(x, shift)
    out = roll_rows(cudnn_attention(roll(q), roll(k), roll(v), lengths, window, cfg, implementation="xla"), -shift)
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[m], np.asarray(out_ref)[m], atol=tol, rtol=tol)
    for a, b in zip(jax.grad(fused, argnums=(0, 1, 2))(q, k, v), jax.grad(ref, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a, np.float32)[m], np.asarray(b, np.float32)[m], atol=tol, rtol=tol)


@pytest.fixture
def xla_for_cudnn(monkeypatch):
    """`model.attention = "cudnn"` with the call run by JAX's XLA implementation (a CPU has no cuDNN)."""
    real = attn_mod.cudnn_attention
    monkeypatch.setattr(attn_mod, "cudnn_attention",
                        lambda *a, **kw: real(*a, **{**kw, "implementation": "xla"}))


def _model(attention: str, **kw):
    base = dict(compute_dtype="bfloat16") if attention == "cudnn" else {}
    cfg = preset("qwen2-test", attention=attention, **{**base, **kw})
    return cfg, init_params(cfg.replace(attention="xla"), jax.random.key(0))


@pytest.mark.parametrize("attention,kw", [
    ("cudnn", {}),
    ("splash", {}),
    ("splash", dict(sliding_window=6, sliding_window_pattern=2, attn_logit_softcap=5.0)),  # Gemma 2's layers
])
def test_model_with_a_fused_path_equals_the_reference(attention, kw, xla_for_cudnn):
    """The whole model (scanned layers, rolls, per-layer window switch) with a fused attention path
    gives the log-probs and parameter gradients of `attention="xla"` on ragged rows. f32: 1e-5.
    cuDNN runs bf16 (its only dtypes): compared with the bf16 reference model at 2e-2.

    Catches: outputs not rolled back (log-probs land on the wrong tokens), the window switch
    picking the wrong kernel per layer, soft-capping dropped on the splash path."""
    cfg, params = _model(attention, **kw)
    ref_cfg = cfg.replace(attention="xla")
    tokens, mask = _ragged()
    tol = 2e-2 if cfg.compute_dtype == "bfloat16" else 1e-5

    m = np.zeros(mask.shape, bool)  # tokens scored from a real prefix (what a loss ever reads)
    m[:, 1:] = np.asarray(mask[:, 1:] & mask[:, :-1])

    def loss(params, cfg):
        logp, _ = token_logprobs(cfg, params, tokens, mask)
        return jnp.sum(logp * m), logp

    (_, logp), grads = jax.value_and_grad(loss, has_aux=True)(params, cfg)
    (_, logp_ref), grads_ref = jax.value_and_grad(loss, has_aux=True)(params, ref_cfg)
    np.testing.assert_allclose(np.asarray(logp)[m], np.asarray(logp_ref)[m], atol=tol, rtol=tol)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, atol=tol * scale, rtol=tol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("attention", ["cudnn", "splash"])
def test_prefill_cache_equals_the_cached_forward(attention, xla_for_cudnn):
    """`prefill_cache` (the fused path) returns the hidden states and KV cache of the cached
    forward over an empty P-slot cache, on left-padded prompts: keys, values and positions in
    the cache's own slot order (not rolled). Catches a cache built from the aligned (rolled) rows."""
    cfg, params = _model(attention)
    tokens, mask = _ragged()
    mask = mask.at[:, 20:].set(False)  # prompts: left padding only
    mask = jnp.asarray(np.asarray(mask) | (np.arange(24) >= np.argmax(np.asarray(mask), 1)[:, None]) & (np.arange(24) < 20))
    h, cache = prefill_cache(cfg, params, tokens, mask)
    ref_cfg = cfg.replace(attention="xla")
    h_ref, cache_ref = hidden_states(ref_cfg, params, tokens, None, mask, init_cache(ref_cfg, 4, 24))
    tol = 2e-2 if cfg.compute_dtype == "bfloat16" else 1e-5
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(h, np.float32)[m], np.asarray(h_ref, np.float32)[m], atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(cache["pos"]), np.asarray(cache_ref["pos"]))
    assert int(cache["index"]) == int(cache_ref["index"]) == 24
    # Layer 0's keys and values come before any attention: equal to rounding, in slot order.
    for name in ("k", "v"):
        np.testing.assert_allclose(np.asarray(cache["layers"][0][name], np.float32),
                                   np.asarray(cache_ref["layers"][0][name], np.float32), atol=1e-6, rtol=1e-6)


def test_the_choice_follows_the_backend_and_the_model():
    """"auto" is cuDNN on a GPU for a bf16 model, splash on TPU, XLA on CPU, and XLA on a GPU
    where cuDNN cannot serve (f32 compute, Gemma 2's soft-cap), saying why; an explicit "cudnn"
    the model cannot use is one ConfigError line naming the reason."""
    bf16 = preset("qwen2-test", compute_dtype="bfloat16")
    assert resolve_attention(bf16, "gpu") == "cudnn"
    assert resolve_attention(bf16, "tpu", num_devices=1) == "splash"
    assert resolve_attention(bf16, "tpu", num_devices=8) == "xla"  # not partitioned: whole batch per device
    assert resolve_attention(bf16, "cpu") == "xla"
    assert resolve_attention(preset("qwen2-test"), "gpu") == "xla"
    capped = bf16.replace(attn_logit_softcap=50.0)
    assert resolve_attention(capped, "gpu") == "xla"
    assert "soft-cap" in describe_attention(capped, "gpu")
    with pytest.raises(ConfigError, match="soft-cap"):
        resolve_attention(capped.replace(attention="cudnn"), "gpu")
    with pytest.raises(ConfigError, match="attention="):
        preset("qwen2-test", attention="flash")


# ----------------------------------------------------------------------------- lowering for cuda


@pytest.fixture
def cudnn_lowering(monkeypatch):
    """Lowering for `cuda` on a host without a GPU: jax asks the installed cuDNN for its version
    before emitting the fused call; answer as cuDNN 9.10 would (nothing else is faked)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)


def _cuda_text(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _square_f32(text: str, t: int) -> list[str]:
    """f32 tensor types with two trailing T-sized dims ([..., T, T]): an attention score buffer."""
    return [m for m in re.findall(r"tensor<([0-9x]+)xf32>", text) if m.split("x")[-2:] == [str(t), str(t)]]


def test_update_step_lowered_for_cuda_contains_the_fused_kernel(cudnn_lowering):
    """The update step (forward and backward) lowered for the cuda platform calls cuDNN's
    fused attention forward and backward, and holds no f32 [.., T, T] buffer: what the H200
    trace found (0.88 GiB of f32 scores per layer) is gone. Catches "auto" not resolving to
    cuDNN for a bf16 model on GPU, and any path that still materialises the scores."""
    from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
    from rljax.optim import OptimConfig
    from rljax.update import RolloutBatch, init_train_state, update_step

    t = 80  # no other dimension of the test model is 80
    cfg = preset("qwen2-test", compute_dtype="bfloat16", attention="cudnn")
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(algorithm="grpo"),
                             OptimConfig(learning_rate=1e-3))
    tokens, mask = jnp.zeros((8, t), jnp.int32), jnp.ones((8, t), bool)
    batch = RolloutBatch(tokens_bt=tokens, attn_mask_bt=mask, loss_mask_bt=mask, sampler_logp_bt=jnp.zeros((8, t)),
                         rewards_b=jnp.zeros(8), group_ids_b=prompt_major_group_ids(8, 4), completion_len=t - 8)
    text = _cuda_text(lambda s, b, k: update_step(s, b, k), state, batch, jax.random.key(0))
    assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text
    assert not _square_f32(text, t), _square_f32(text, t)[:3]


def test_prefill_lowered_for_cuda_contains_the_fused_kernel(cudnn_lowering):
    """The sampler's prefill lowered for cuda calls cuDNN's fused attention and holds no f32
    [.., P, P] buffer (P = 80 prompt slots)."""
    from rljax.sampling.decode import prompt_forward

    cfg = preset("qwen2-test", compute_dtype="bfloat16", attention="cudnn")
    params = init_params(cfg, jax.random.key(0))
    tokens, mask = jnp.zeros((4, 80), jnp.int32), jnp.ones((4, 80), bool)
    text = _cuda_text(lambda p, t, m: prompt_forward(cfg, p, t, m), params, tokens, mask)
    assert "__cudnn$fmhaSoftmax" in text
    assert not _square_f32(text, 80)


# ----------------------------------------------------------------------------- packed rows


def _packed_pair(t_total=24):
    """Three sequences of lengths 9, 6 and 5 packed end to end into one row of 24 slots (4 of
    padding), positions restarting at each, and each sequence alone, left-aligned and padded."""
    rng = np.random.default_rng(3)
    lengths = (9, 6, 5)
    seqs = [rng.integers(0, 128, n) for n in lengths]
    tokens = np.zeros((1, t_total), np.int32)
    seg = np.zeros((1, t_total), np.int32)
    pos = np.zeros((1, t_total), np.int32)
    mask = np.zeros((1, t_total), bool)
    at = 0
    for i, s in enumerate(seqs):
        tokens[0, at:at + len(s)], seg[0, at:at + len(s)] = s, i
        pos[0, at:at + len(s)], mask[0, at:at + len(s)] = np.arange(len(s)), True
        at += len(s)
    alone = np.zeros((3, t_total), np.int32)
    alone_mask = np.zeros((3, t_total), bool)
    for i, s in enumerate(seqs):
        alone[i, :len(s)], alone_mask[i, :len(s)] = s, True
    return (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(pos), jnp.asarray(seg),
            jnp.asarray(alone), jnp.asarray(alone_mask), lengths)


@pytest.mark.parametrize("attention,kw", [
    ("xla", {}),
    ("xla", dict(sliding_window=4, sliding_window_pattern=2, attn_logit_softcap=5.0)),
    ("cudnn", {}),
    ("splash", {}),
])
def test_packed_segments_see_only_themselves(attention, kw, xla_for_cudnn):
    """Three sequences packed into one row (segment ids, positions restarting at 0) give each
    sequence the hidden states it has alone in its own padded row: f32 to 1e-5 (cuDNN's form in
    bf16 to 2e-2). Catches cross-talk: without the segment check the second and third sequences
    see the earlier ones' keys (their restarted positions make those keys look causal), and the
    test fails on every attention path; also a RoPE that ignores the restarted positions."""
    cfg, params = _model(attention, **kw)
    tokens, mask, pos, seg, alone, alone_mask, lengths = _packed_pair()
    h, _ = hidden_states(cfg, params, tokens, pos, mask, segment_ids_bt=seg)
    h_alone, _ = hidden_states(cfg.replace(attention="xla"), params, alone, None, alone_mask)
    tol = 2e-2 if cfg.compute_dtype == "bfloat16" else 1e-5
    at = 0
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(h[0, at:at + n], np.float32), np.asarray(h_alone[i, :n], np.float32),
                                   atol=tol, rtol=tol, err_msg=f"segment {i}")
        at += n


# ----------------------------------------------------------------------------- the decode kernel


def _cache_rows(slots: int, dtype, b=4, n=4, k=2, h=16, seed=3):
    """One decode step's operands: q [B, 1, N, H], keys and values [B, K, S, H], and each row's
    valid slots as key positions (-1 outside [start, end)): a full row, a left-padded one, a row
    whose only key is the current token, and one with empty slots after its end."""
    rng = np.random.default_rng(seed)
    make = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32).astype(dtype)
    spans = [(0, slots), (5, slots - 3), (slots - 1, slots), (2, slots // 2)][:b]
    slot = np.arange(slots)
    k_pos = np.stack([np.where((slot >= lo) & (slot < hi), slot - lo, -1) for lo, hi in spans])
    q_pos = np.array([hi - 1 - lo for lo, hi in spans])
    end = np.array([hi for _, hi in spans], np.int32)
    return make(b, 1, n, h), make(b, k, slots, h), make(b, k, slots, h), jnp.asarray(k_pos), jnp.asarray(q_pos), end


@pytest.mark.parametrize("slots", [64, 40])  # 40: not a multiple of the kernel's 16-slot block, padded
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 7.8e-3)])
def test_decode_kernel_equals_cached_attention(slots, dtype, tol):
    """The Pallas GPU decode kernel (interpret mode) over each row's valid range equals
    `cached_attention` over the same cache, on ragged ranges, grouped heads (4 query, 2 kv).

    Catches: a range starting at slot 0 (attends left padding), ending at the write index
    instead of after it (misses the current token), a wrong split of the key axis, the scale
    not applied. bf16: probabilities are rounded to bf16 for the PV product in both; 7.8e-3 is
    one bf16 ulp at the outputs' largest magnitude (2 to 2.6), measured with JAX's stock kernel
    (which also merged its splits in bf16); the project's kernel keeps f32 outputs."""
    cfg = preset("qwen2-test", decode_attention="pallas")
    q, k, v, k_pos, q_pos, end = _cache_rows(slots, dtype)
    start_b, end_b = attn_mod.valid_range(k_pos, end)
    np.testing.assert_array_equal(np.asarray(start_b), [0, 5, slots - 1, 2])
    got = attn_mod.decode_attention(q, k, v, start_b, end_b, cfg)
    want = attn_mod.cached_attention(q, k.transpose(0, 1, 3, 2), v, q_pos[:, None], k_pos, 0, cfg)
    assert got.shape == want.shape == (4, 1, 4, 16) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=0)
    same = attn_mod.cached_attention(q, k, v, q_pos[:, None], k_pos, 0, cfg, "bksh")  # the layout's einsum
    np.testing.assert_allclose(np.asarray(same), np.asarray(want), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scheduler,extra", [
    ("static", {}),
    ("continuous", {}),
    ("continuous", {"kv_layout": "paged", "max_total_tokens": 320, "page_size": 8}),
])
def test_samplers_with_the_decode_kernel_equal_the_reference(scheduler, extra):
    """Every scheduler decodes through the kernel (keys stored [B, K, S, H], the kernel's
    layout; interpret mode) and draws the same tokens as the einsum path, with log-probs within
    1e-5 (f32), on left-padded prompts. The three build their caches differently (static:
    prefill then widen; continuous: prompts copied from a pool into slots; paged: pages gathered
    into a view), so each checks that its valid keys form the one range the kernel reads."""
    from rljax.sampling import SampleControls, generate
    cfg = preset("qwen2-test")
    params = init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(2)
    prompts = rng.integers(1, cfg.vocab_size, (3, 7)).astype(np.int32)
    mask = np.ones((3, 7), bool)
    mask[0, :3] = mask[2, :5] = False
    controls = SampleControls(max_new_tokens=12, num_samples=2, temperature=0.8, top_k=20, scheduler=scheduler,
                              **extra)
    ref = generate(cfg, params, prompts, mask, key=jax.random.key(7), controls=controls)
    got = generate(cfg.replace(decode_attention="pallas"), params, prompts, mask, key=jax.random.key(7),
                   controls=controls)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=1e-5, rtol=0)


def test_the_decode_choice_follows_the_backend_and_the_model():
    """"auto" decodes with the Pallas kernel on one GPU, with XLA on a CPU, on a multi-GPU mesh
    (a Pallas call is not partitioned) and for models the kernel cannot serve (soft-cap, sliding
    windows, head_dim not a power of two), saying why; the key cache's layout follows the
    choice; an explicit "pallas" the model cannot use is one ConfigError line."""
    from rljax.models.transformer import cache_slot_axes
    cfg = preset("qwen2-test")
    assert attn_mod.resolve_decode_attention(cfg, "gpu", num_devices=1) == "pallas"
    assert attn_mod.resolve_decode_attention(cfg, "gpu", num_devices=8) == "xla"
    assert attn_mod.resolve_decode_attention(cfg, "cpu", num_devices=1) == "xla"
    assert attn_mod.resolve_decode_attention(cfg.replace(decode_attention="xla"), "gpu", num_devices=1) == "xla"
    for why, bad in [("soft-cap", dict(attn_logit_softcap=50.0)), ("sliding window", dict(sliding_window=8, sliding_window_pattern=2)),
                     ("power-of-two", dict(head_dim=24))]:
        assert attn_mod.resolve_decode_attention(cfg.replace(**bad), "gpu", num_devices=1) == "xla"
        with pytest.raises(ConfigError, match=why):
            attn_mod.resolve_decode_attention(cfg.replace(decode_attention="pallas", **bad), "gpu")
    assert "decode: xla" in describe_attention(cfg, "cpu")
    pallas = cfg.replace(decode_attention="pallas")
    assert init_cache(pallas, 2, 24)["layers"][0]["k"].shape == (2, 2, 24, 16)
    # an FP8 cache's scales (`rljax.models.fp8`) share their buffer's slot axis
    assert cache_slot_axes(pallas) == {"k": 2, "v": 2, "k_scale": 2, "v_scale": 2}
    assert cache_slot_axes(cfg) == {"k": 3, "v": 2, "k_scale": 3, "v_scale": 2}
    assert init_cache(cfg, 2, 24)["layers"][0]["k"].shape == (2, 2, 16, 24)
    with pytest.raises(ConfigError, match="decode_attention="):
        preset("qwen2-test", decode_attention="flash")


def test_decode_step_lowered_for_cuda_runs_the_kernel(monkeypatch):
    """A decode step lowered for cuda with the kernel calls Triton (Pallas' GPU backend) and holds
    no f32 score row over the cache's S = 80 slots in any layer; the einsum path does. Catches
    the kernel path not taken for a one-token step, or the scores still materialised."""
    monkeypatch.setattr(attn_mod, "_interpret_here", lambda platform: False)
    cache_width = 80  # no other dimension of the test model is 80
    texts = {}
    for impl in ("pallas", "xla"):
        cfg = preset("qwen2-test", compute_dtype="bfloat16", decode_attention=impl)
        params = init_params(cfg, jax.random.key(0))
        cache = init_cache(cfg, 4, cache_width)
        step = lambda p, c, tok: hidden_states(cfg, p, tok, jnp.zeros((4, 1), jnp.int32), None, c)[0]
        try:
            texts[impl] = _cuda_text(step, params, cache, jnp.zeros((4, 1), jnp.int32))
        except RuntimeError as err:  # jax >= 0.11 asks a real GPU for Triton's target when lowering
            if "No supported GPU devices" not in str(err):
                raise
            pytest.skip(f"this jax ({jax.__version__}) lowers Triton kernels only with a GPU present")
    scores = lambda text: [m for m in re.findall(r"tensor<([0-9x]+)xf32>", text) if m.split("x")[-1] == "80"]
    assert "__gpu$xla.gpu.triton" in texts["pallas"]
    assert not scores(texts["pallas"]), scores(texts["pallas"])[:3]  # no layer left on the einsum path
    assert "__gpu$xla.gpu.triton" not in texts["xla"] and scores(texts["xla"])


def test_query_chunked_reference_equals_whole_and_holds_no_t_by_t_scores():
    """Long rows' reference attention (`attention_query_chunked`: query chunks in a lax.map, each
    rematerialised) gives the unchunked reference's outputs and gradients (left padding, packed
    segments, a sliding window), and its compiled gradient's temporaries stay below one f32
    [B, K, G, T, T] score tensor, which the unchunked program holds. Catches: a chunk that drops
    its padded tail wrongly, segment ids not chunked with their queries, [T, T] scores built."""
    cfg = preset("qwen2-test")
    b, t, chunk = 2, 600, 128
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (b, t, cfg.num_heads, cfg.head_dim))
    k = jax.random.normal(ks[1], (b, t, cfg.num_kv_heads, cfg.head_dim))
    v = jax.random.normal(ks[2], (b, t, cfg.num_kv_heads, cfg.head_dim))
    valid = np.arange(t)[None] >= np.array([[0], [37]])
    seg = jnp.asarray((np.arange(t)[None] >= 300).astype(np.int32).repeat(b, 0))
    pos = jnp.asarray(np.where(valid, np.arange(t) - np.array([[0], [37]]), 0))
    k_pos = jnp.where(jnp.asarray(valid), pos, -1)
    whole = lambda q, k, v: attn_mod.attention_recomputed(q, k, v, pos, k_pos, 64, cfg, seg, seg)
    chunked = lambda q, k, v: attn_mod.attention_query_chunked(q, k, v, pos, k_pos, 64, cfg, seg, seg, chunk=chunk)
    np.testing.assert_allclose(np.asarray(chunked(q, k, v)), np.asarray(whole(q, k, v)), atol=1e-6, rtol=0)
    loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))))
    g_whole = jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v)
    g_chunk = jax.grad(loss(chunked), argnums=(0, 1, 2))(q, k, v)
    for a, c in zip(g_chunk, g_whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5, rtol=0)
    scores_bytes = b * cfg.num_heads * t * t * 4
    temp = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2))).lower(q, k, v).compile().memory_analysis() \
        .temp_size_in_bytes
    assert temp(chunked) < scores_bytes <= temp(whole)
