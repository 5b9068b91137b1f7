"""Bounded-memory scoring (`rljax.models.fused_logprobs`): chunked over time and vocabulary with
a custom VJP, it equals the unchunked log-softmax and its autodiff gradients (f32 to 1e-6 of the
scale, bf16 within bf16 rounding), its entropy gradient matches float64 torch, the chunk sizes
follow the memory budget, the update step's compiled temporaries stay bounded at a 151,936-id
vocabulary, and entropy is not computed when nothing uses it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rljax.models import (LOGITS_BUDGET_BYTES, LogprobChunks, auto_chunk_size, forward, fused_logprobs, init_params,
                          logprobs_from_logits, preset, token_logprobs)
from rljax.objectives import AlgorithmConfig
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update

B, T, D, V = 3, 7, 16, 37  # V prime: every vocabulary chunking pads


def _inputs(dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (B, T, D)).astype(dtype)
    w = (0.5 * jax.random.normal(k[1], (V, D))).astype(dtype)
    tgt = jax.random.randint(k[2], (B, T), 0, V)
    # Distinct weights per token for the two outputs, so both cotangents reach every chunk.
    return h, w, tgt, jax.random.normal(k[3], (B, T)), jax.random.normal(k[4], (B, T))


def _reference_logits(h, w, temperature, softcap):
    """Unchunked: the whole [B, T, V] logits as `logits_from_hidden` computes them."""
    raw = jnp.einsum("btd,vd->btv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return raw if softcap is None else jnp.tanh(raw / softcap) * softcap


def _losses(h, w, tgt, c_logp, c_ent, temperature, softcap, **chunks):
    """(fused loss, unchunked autodiff loss) as functions of (h, w): sum c_logp logp + c_ent H."""
    def fused(h, w):
        lp, ent = fused_logprobs(h, w, tgt, temperature=temperature, softcap=softcap, with_entropy=True, **chunks)
        return jnp.sum(c_logp * lp) + jnp.sum(c_ent * ent)

    def reference(h, w):
        lp, ent = logprobs_from_logits(_reference_logits(h, w, temperature, softcap), tgt, temperature, True)
        return jnp.sum(c_logp * lp) + jnp.sum(c_ent * ent)
    return fused, reference


def _close_to_scale(got, want, rel, err_msg=""):
    """|got - want| <= rel * max|want|: `rel` of the largest magnitude, i.e. rounding of the sum."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err, scale = np.max(np.abs(got - want)), np.max(np.abs(want))
    assert err <= rel * scale, f"{err_msg}: max error {err:.3g} > {rel:g} x {scale:.3g}"


@pytest.mark.parametrize("chunks, temperature, softcap", [
    (dict(), 1.0, None), (dict(time_chunk=3), 0.7, 3.0), (dict(time_chunk=2, vocab_chunk=8), 1.0, None),
    (dict(time_chunk=7, vocab_chunk=5), 0.7, 3.0)])
def test_fused_equals_unchunked_values_and_gradients(chunks, temperature, softcap):
    """Every chunking (none; time chunks with a padded tail; time + strided vocabulary chunks with
    padded vocabulary rows), with and without Gemma 2's softcap and temperature != 1, gives the
    unchunked log-probs, entropy and gradients w.r.t. h and W (f32, within 1e-6 of the largest
    magnitude: a few ulps of summation-order rounding, 2^-24 = 6e-8 each).

    Catches: a wrong logit cotangent (the entropy term's sign or its (z - lse + H) factor), a
    missing 1/T or (1 - tanh^2) factor, an online logsumexp that forgets to rescale its sums by
    exp(m_old - m_new), padded vocabulary rows leaking into the softmax, the target logit taken
    from the wrong strided chunk, and dW scattered back to the wrong vocabulary rows."""
    h, w, tgt, c_logp, c_ent = _inputs()
    lp, ent = fused_logprobs(h, w, tgt, temperature=temperature, softcap=softcap, with_entropy=True, **chunks)
    z = _reference_logits(h, w, temperature, softcap) / temperature
    lp_ref, ent_ref = logprobs_from_logits(z * temperature, tgt, temperature, True)
    lse = jax.nn.logsumexp(z, axis=-1)  # the magnitude both outputs are computed from
    np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(lse))))
    np.testing.assert_allclose(ent, ent_ref, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(lse))))
    fused, reference = _losses(h, w, tgt, c_logp, c_ent, temperature, softcap, **chunks)
    grads = [jax.jit(jax.grad(f, (0, 1)))(h, w) for f in (fused, reference)]
    for name, g, g_ref in zip(("dh", "dW"), *grads):
        _close_to_scale(g, g_ref, 1e-6, name)


def test_without_entropy_only_logp_is_scored_and_differentiated():
    """with_entropy=False returns no entropy and the log-prob gradient alone (vocabulary chunks).

    Catches: an entropy cotangent term applied when there is no entropy output."""
    h, w, tgt, c_logp, _ = _inputs(seed=1)
    lp, ent = fused_logprobs(h, w, tgt, with_entropy=False, time_chunk=4, vocab_chunk=10)
    assert ent is None
    lp_ref, _ = logprobs_from_logits(_reference_logits(h, w, 1.0, None), tgt)
    np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=1e-5)
    g = jax.jit(jax.grad(lambda h, w: jnp.sum(c_logp * fused_logprobs(h, w, tgt, time_chunk=4, vocab_chunk=10)[0]),
                         (0, 1)))(h, w)
    g_ref = jax.grad(lambda h, w: jnp.sum(c_logp * logprobs_from_logits(_reference_logits(h, w, 1.0, None),
                                                                         tgt)[0]), (0, 1))(h, w)
    for name, a, b in zip(("dh", "dW"), g, g_ref):
        _close_to_scale(a, b, 1e-6, name)


def test_entropy_gradient_matches_float64_torch():
    """d(sum_t c_t H_t)/d(h, W) of a tiny soft-capped, tempered softmax equals float64 torch
    autograd of H = -sum_v p_v log p_v written from the definition (to 1e-6 of the scale).

    Catches: the entropy cotangent -g_H p_v (z_v - lse + H) with any term wrong (it is checked
    here against an independent autodiff, not the formula the backward pass implements)."""
    h, w, tgt, _, c_ent = _inputs(seed=2)
    temperature, softcap = 0.8, 2.5

    def fused(h, w):
        ent = fused_logprobs(h, w, tgt, temperature=temperature, softcap=softcap, with_entropy=True,
                             time_chunk=3, vocab_chunk=6)[1]
        return jnp.sum(c_ent * ent)

    g_h, g_w = jax.jit(jax.grad(fused, (0, 1)))(h, w)
    th, tw = (torch.tensor(np.asarray(x), dtype=torch.float64, requires_grad=True) for x in (h, w))
    z = softcap * torch.tanh(torch.einsum("btd,vd->btv", th, tw) / softcap) / temperature
    logp = torch.log_softmax(z, -1)
    ent = -(logp.exp() * logp).sum(-1)
    (ent * torch.tensor(np.asarray(c_ent), dtype=torch.float64)).sum().backward()
    _close_to_scale(g_h, th.grad.numpy(), 1e-6, "dh")
    _close_to_scale(g_w, tw.grad.numpy(), 1e-6, "dW")


def test_bf16_within_bf16_rounding():
    """bf16 h and W: log-probs and entropy equal the f32 computation on the same (bf16) values to
    f32 rounding, since the logits are bf16 x bf16 products accumulated in f32 either way. The
    gradients keep the logit cotangent in bf16 (as every projection's VJP does), so each entry of
    dh = dz @ W carries at most one bf16 rounding of every dz_v (8 significant bits: unit roundoff
    2^-8) and one of the result: |dh - dh_exact| <= 2^-8 (|dz| @ |W| + |dh|) <= 2^-7 |dz| @ |W|,
    elementwise (f32 accumulation adds ~2^-24), and likewise for dW with |dz|^T @ |h|.

    Catches: logits or softmax computed in bf16 (errors of ~2^-8 |z| in each log-prob and
    probability, |z| ~ 8 here, beyond the bound in the gradients), a cotangent rounded again
    after a partial sum."""
    h, w, tgt, c_logp, c_ent = _inputs(jnp.bfloat16, seed=3)
    temperature, softcap = 0.9, 4.0
    chunks = dict(time_chunk=3, vocab_chunk=12)
    h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)
    lp, ent = fused_logprobs(h, w, tgt, temperature=temperature, softcap=softcap, with_entropy=True, **chunks)
    lp_ref, ent_ref = logprobs_from_logits(_reference_logits(h32, w32, temperature, softcap), tgt, temperature, True)
    np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ent, ent_ref, rtol=0, atol=1e-5)

    fused, _ = _losses(h, w, tgt, c_logp, c_ent, temperature, softcap, **chunks)
    g_h, g_w = jax.jit(jax.grad(fused, (0, 1)))(h, w)
    assert g_h.dtype == g_w.dtype == jnp.bfloat16

    def from_raw(raw):
        s = jnp.tanh(raw / softcap) * softcap
        lp, e = logprobs_from_logits(s, tgt, temperature, True)
        return jnp.sum(c_logp * lp) + jnp.sum(c_ent * e)

    dz = jax.grad(from_raw)(jnp.einsum("btd,vd->btv", h32, w32))  # dL/draw in f32, on the bf16 values
    g_h_exact, g_w_exact = jnp.einsum("btv,vd->btd", dz, w32), jnp.einsum("btv,btd->vd", dz, h32)
    bound_h = 2.0 ** -7 * jnp.einsum("btv,vd->btd", jnp.abs(dz), jnp.abs(w32)) + 1e-6 * jnp.max(jnp.abs(g_h_exact))
    bound_w = 2.0 ** -7 * jnp.einsum("btv,btd->vd", jnp.abs(dz), jnp.abs(h32)) + 1e-6 * jnp.max(jnp.abs(g_w_exact))
    assert jnp.all(jnp.abs(g_h.astype(jnp.float32) - g_h_exact) <= bound_h)
    assert jnp.all(jnp.abs(g_w.astype(jnp.float32) - g_w_exact) <= bound_w)
    assert float(jnp.max(jnp.abs(g_h.astype(jnp.float32) - g_h_exact))) > 0  # bf16 did round


def test_token_logprobs_gradients_through_the_model_equal_unchunked():
    """token_logprobs with time and vocabulary chunks gives the log-probs, entropy and gradients
    w.r.t. every param (a tied embedding gets both its lookup and its projection gradient) of
    plain autodiff through `forward` + `logprobs_from_logits`, with a final-logit softcap and
    temperature (f32, 1e-6 of each leaf's largest entry; values 1e-6 of the logsumexp).

    Catches: `token_logprobs` projecting against the wrong matrix or misaligning targets, the
    fused gradient not reaching the backbone (dh) or the embedding (dW), and chunk overrides lost."""
    cfg = preset("qwen2-test", num_layers=1, final_logit_softcap=5.0)
    params = init_params(cfg, jax.random.key(5), std=0.3)
    tokens = jax.random.randint(jax.random.key(6), (2, 9), 0, cfg.vocab_size)
    temperature = 0.8
    c = jax.random.normal(jax.random.key(7), (2, 2, 9))

    def fused(p):
        lp, ent = token_logprobs(cfg, p, tokens, temperature=temperature, with_entropy=True, chunk_size=3,
                                 vocab_chunk=40)
        return jnp.sum(c[0] * lp) + jnp.sum(c[1] * ent), (lp, ent)

    def reference(p):
        logits, _ = forward(cfg, p, tokens)
        lp, ent = logprobs_from_logits(logits[:, :-1], tokens[:, 1:], temperature, True)
        lp, ent = (jnp.pad(x, ((0, 0), (1, 0))) for x in (lp, ent))
        return jnp.sum(c[0] * lp) + jnp.sum(c[1] * ent), (lp, ent)

    (_, (lp, ent)), g = jax.jit(jax.value_and_grad(fused, has_aux=True))(params)
    (_, (lp_ref, ent_ref)), g_ref = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    scale = float(jnp.max(jnp.abs(lp_ref))) + float(jnp.max(ent_ref))  # >= the logsumexp
    np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(ent, ent_ref, rtol=0, atol=1e-6 * scale)
    for path, a in jax.tree_util.tree_leaves_with_path(g):
        b = g_ref
        for k in path:
            b = b[k.key]
        _close_to_scale(a, b, 1e-6, jax.tree_util.keystr(path))


def test_vocabulary_chunks_of_a_vocab_sharded_weight_need_no_gather():
    """Under tensor parallelism the [V, D] weight is split on V (`rljax.sharding` rules). Strided
    vocabulary chunks (ids j, j + n, j + 2n, ...) keep every chunk split the same way, so the
    compiled gradient (8 simulated devices, data 2 x tensor 4) has no all-gather: each device
    reduces its own rows and only [rows] statistics and [rows, D] partial dh are all-reduced.

    Catches: contiguous vocabulary chunks, which live on one device each and make XLA all-gather
    the whole weight in the forward and the backward pass (checked when this was written)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rljax import sharding

    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=1, tensor=4))
    s = jax.ShapeDtypeStruct

    def loss(h, w, tgt):
        lp, ent = fused_logprobs(h, w, tgt, with_entropy=True, time_chunk=8, vocab_chunk=1024)
        return jnp.sum(lp) + jnp.sum(ent)

    shardings = tuple(NamedSharding(mesh, spec) for spec in (P("data"), P("tensor", None), P("data")))
    hlo = jax.jit(jax.grad(loss, (0, 1)), in_shardings=shardings).lower(
        s((4, 16, 32), jnp.float32), s((4096, 32), jnp.float32), s((4, 16), jnp.int32)).compile().as_text()
    assert "all-reduce(" in hlo  # it is partitioned
    assert "all-gather(" not in hlo


def test_auto_chunk_size_follows_the_budget():
    """Chunks from the shapes: the whole projection when 2 x 4 B x B x T x V fits 256 MiB, else
    the largest power-of-two time chunk that fits, and a power-of-two vocabulary split only when
    one step of every row does not fit (or a time override is too large).

    Catches: budget arithmetic off by a factor (bytes per logit, rows), a time chunk that is not
    the largest fitting one, a vocabulary split where the time chunk alone would do."""
    assert auto_chunk_size(64, 1024, 17) == LogprobChunks(1024, 17)
    assert auto_chunk_size(64, 768, 151_936) == LogprobChunks(2, 151_936)  # 8 B x 64 x 151,936 x 2 < 256 MiB < x 4
    assert auto_chunk_size(8, 128, 151_936) == LogprobChunks(16, 151_936)
    assert auto_chunk_size(512, 128, 151_936) == LogprobChunks(1, 151_936 // 4)  # one step: 2.3 x the budget
    assert auto_chunk_size(64, 768, 151_936, time_chunk=16) == LogprobChunks(16, 151_936 // 8)
    assert auto_chunk_size(64, 768, 151_936, time_chunk=1000) == LogprobChunks(768, 594)  # 223 x: 256 pieces


def test_accelerator_chunks_keep_every_token_and_split_the_vocabulary_exactly():
    """On a GPU or TPU the budget is 1/32 of one device's memory, every token of the pass stays in
    one chunk, and the vocabulary is split into the fewest exact divisors that fit (>= 1,024 ids
    each); time is halved only when no such split fits. The CPU's choice is unchanged.

    Catches: the CPU's 256 MiB budget (128-token chunks at Qwen2.5-0.5B shapes) reaching a GPU,
    a split that leaves padded rows (V % pieces != 0), chunks under budget that are not the
    fewest, and time chunked where a vocabulary split would do."""
    from rljax.models.scoring import logits_budget_bytes

    assert logits_budget_bytes("cpu") == LOGITS_BUDGET_BYTES == 256 << 20
    assert logits_budget_bytes("gpu", device_memory=128 << 30) == 4 << 30
    gpu = dict(platform="gpu", budget_bytes=4 << 30)
    # the H200 trace's micro-batch, 16 rows x 1024: 19.9 GB of logits over 4 GiB: 8 pieces (5 do not divide)
    assert auto_chunk_size(16, 1024, 151_936, **gpu) == LogprobChunks(1024, 151_936 // 8)
    assert auto_chunk_size(16, 1024, 49_152, **gpu) == LogprobChunks(1024, 49_152 // 2)  # 1.5 x the budget
    assert auto_chunk_size(16, 100, 17, **gpu) == LogprobChunks(100, 17)
    # 1024 rows x 4096: no split of >= 1,024 ids fits all 4096 steps; 256 steps x 1187 ids does
    assert auto_chunk_size(1024, 4096, 151_936, **gpu) == LogprobChunks(256, 1187)
    for b, t, v in [(16, 1024, 151_936), (64, 1024, 151_936), (8, 2048, 128_256), (32, 512, 49_152)]:
        chunks = auto_chunk_size(b, t, v, **gpu)
        assert v % chunks.vocab == 0 and 8 * b * chunks.time * chunks.vocab <= 4 << 30
    assert auto_chunk_size(64, 768, 151_936, platform="cpu") == auto_chunk_size(64, 768, 151_936)


def test_exact_vocabulary_chunks_equal_the_unchunked_scores():
    """Log-probs, entropy and their gradients with an accelerator's chunks (the whole sequence, 4
    exact vocabulary slices of 1,024 ids) equal the unchunked pass: f32 within 1e-6 of the scale.
    Catches a strided slice mapped back to the wrong vocabulary rows, or a slice's dW written
    over another's."""
    cfg = preset("qwen2-test", vocab_size=4096, num_layers=1)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.vocab_size)
    chunks = auto_chunk_size(4, 32, 4096, platform="gpu", budget_bytes=8 * 4 * 32 * 1024)
    assert chunks == LogprobChunks(32, 1024)

    def loss(p, chunks):
        lp, ent = token_logprobs(cfg, p, tokens, with_entropy=True, chunk_size=chunks.time, vocab_chunk=chunks.vocab)
        return jnp.sum(lp * jnp.arange(33)) + jnp.sum(ent), (lp, ent)

    (_, out), g = jax.value_and_grad(loss, has_aux=True)(params, chunks)
    (_, ref), g_ref = jax.value_and_grad(loss, has_aux=True)(params, LogprobChunks(32, 4096))
    for a, b in zip(jax.tree.leaves((out, g)), jax.tree.leaves((ref, g_ref))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6 * max(1.0, float(np.abs(b).max())),
                                   rtol=1e-5)


def test_update_config_keys_override_the_chunks():
    """`update.logprob_chunk` sets the time chunk (the vocabulary split follows from it) and
    `update.logprob_vocab_chunk` the ids per vocabulary chunk; unset, both are automatic; a
    non-positive value is one ConfigError line. Catches: a key that is read but not applied, the
    vocabulary key dropping the time override, a zero chunk reaching the scan."""
    from rljax.errors import ConfigError
    assert UpdateConfig().chunk_for(64, 768, 151_936) == auto_chunk_size(64, 768, 151_936)
    assert UpdateConfig(logprob_chunk=16).chunk_for(64, 768, 151_936) == LogprobChunks(16, 151_936 // 8)
    assert UpdateConfig(logprob_chunk=4, logprob_vocab_chunk=4096).chunk_for(64, 768, 151_936) == \
        LogprobChunks(4, 4096)
    assert UpdateConfig(logprob_vocab_chunk=10**6).chunk_for(8, 16, 17) == LogprobChunks(16, 17)
    with pytest.raises(ConfigError, match="logprob_vocab_chunk=0 must be >= 1"):
        UpdateConfig(logprob_vocab_chunk=0)


def _abstract_update_memory(cfg, b, t, monkeypatch, whole: bool = False) -> int:
    """Compiled temporary bytes of `update` on abstract inputs (nothing allocated); `whole`
    scores the whole [B, T, V] as one chunk instead of the update's own choice."""
    update_cfg = UpdateConfig()
    if whole:  # its own UpdateConfig, so the traced program is not the cached automatic one
        update_cfg = UpdateConfig(logprob_chunk=t)
        monkeypatch.setattr(UpdateConfig, "chunk_for", lambda self, b_, t_, v_: LogprobChunks(t_, v_))
    s = jax.ShapeDtypeStruct
    batch = RolloutBatch(tokens_bt=s((b, t), jnp.int32), attn_mask_bt=s((b, t), bool), loss_mask_bt=s((b, t), bool),
                         sampler_logp_bt=s((b, t), jnp.float32), rewards_b=s((b,), jnp.float32),
                         group_ids_b=s((b,), jnp.int32), completion_len=t // 2)
    state = jax.eval_shape(lambda: init_train_state(
        cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(algorithm="grpo", entropy_coef=0.01), OptimConfig(),
        update_cfg=update_cfg))
    temp = jax.jit(update).lower(state, batch, jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes
    monkeypatch.undo()
    return temp


def test_update_memory_is_bounded_at_a_151936_vocabulary(monkeypatch):
    """The update step of a 1-layer, D = 64 model with Qwen's 151,936-id vocabulary at B x T =
    8 x 128, compiled on abstract inputs (`memory_analysis`, nothing allocated): with the
    automatic chunks its temporaries are at most a quarter of the same update scoring the whole
    [B, T, V] as one chunk, and within the chunk budget plus two f32 [V, D] buffers.

    Catches: a [B, T, V] residual (the softmax plain autodiff stores) or logits materialised
    outside the chunk loop, and automatic chunks that do not follow the budget."""
    b, t = 8, 128
    cfg = preset("qwen2-test", vocab_size=151_936, num_layers=1)
    auto = _abstract_update_memory(cfg, b, t, monkeypatch)
    whole = _abstract_update_memory(cfg, b, t, monkeypatch, whole=True)
    assert auto * 4 <= whole, (auto, whole)
    assert auto <= LOGITS_BUDGET_BYTES + 2 * 4 * cfg.vocab_size * cfg.hidden_size, auto


@pytest.mark.parametrize("budget_mib", [32, 4])  # time chunks; then one step over budget: vocabulary chunks
def test_scoring_memory_is_one_chunk_plus_one_weight_sized_buffer(budget_mib):
    """Gradient of token_logprobs (with entropy) at vocabularies V and 2V, chunked by
    `auto_chunk_size` for a small budget: the temporaries stay within the budget plus one f32
    [V, D] buffer (the weight gradient being accumulated) plus 8 MiB (the rest of this tiny
    body), and doubling V adds at most one f32 [V, D] buffer: nothing that scales with B x T x V
    (a [B, T, V] f32 array is 593 MiB at V = 151,936; a chunk here is 2.3 or 18.5 MiB).

    Catches: a chunk loop that keeps per-chunk logits alive (stacked residuals), a backward pass
    that is not chunked, vocabulary chunks that gather the whole weight per chunk."""
    b, t, budget = 8, 128, budget_mib << 20
    temps = []
    for v in (151_936, 2 * 151_936):
        cfg = preset("qwen2-test", vocab_size=v, num_layers=1)
        chunks = auto_chunk_size(b, t - 1, v, budget)
        assert (chunks.vocab < v) == (budget_mib == 4)

        def loss(p, cfg=cfg, chunks=chunks):
            lp, ent = token_logprobs(cfg, p, jnp.zeros((b, t), jnp.int32), with_entropy=True,
                                     chunk_size=chunks.time, vocab_chunk=chunks.vocab)
            return jnp.sum(lp) + jnp.sum(ent)

        params = jax.eval_shape(lambda cfg=cfg: init_params(cfg, jax.random.key(0)))
        temps.append(jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes)
        weight = 4 * v * cfg.hidden_size
        assert temps[-1] <= budget + weight + (8 << 20), (v, temps)
    assert temps[1] - temps[0] <= 4 * 151_936 * 64, temps


def test_entropy_is_not_computed_when_unused(monkeypatch):
    """The update scores without entropy exactly when `entropy_coef = 0` and `update.log_entropy`
    is off (traced only: `jax.eval_shape`); with either on it asks for it.

    Catches: entropy (a second output, a second reduction over the vocabulary and its backward
    term) computed and then dropped."""
    import rljax.update.loss as loss_module

    asked = []

    def spy(*args, with_entropy=False, **kwargs):
        asked.append(with_entropy)
        return token_logprobs(*args, with_entropy=with_entropy, **kwargs)

    monkeypatch.setattr(loss_module, "token_logprobs", spy)
    cfg = preset("qwen2-test", num_layers=1)
    b, t = 4, 6
    s = jax.ShapeDtypeStruct
    batch = RolloutBatch(tokens_bt=s((b, t), jnp.int32), attn_mask_bt=s((b, t), bool), loss_mask_bt=s((b, t), bool),
                         sampler_logp_bt=s((b, t), jnp.float32), rewards_b=s((b,), jnp.float32),
                         group_ids_b=s((b,), jnp.int32), completion_len=3)
    for coef, log_entropy, expected in ((0.0, False, False), (0.0, True, True), (0.01, False, True)):
        asked.clear()
        state = jax.eval_shape(lambda: init_train_state(
            cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(algorithm="grpo", entropy_coef=coef),
            OptimConfig(), update_cfg=UpdateConfig(log_entropy=log_entropy)))
        jax.eval_shape(update, state, batch, jax.random.key(0))
        assert asked and set(asked) == {expected}, (coef, log_entropy, asked)
