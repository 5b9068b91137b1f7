"""The generalized Jensen-Shannon divergence between a student's and a teacher's next-token
distributions over the whole vocabulary, per position, in bounded memory.

GKD (Agarwal et al., 2024, eq. 1) distils on the student's own samples with, at each sampled
prefix, for student S = softmax(z_S / tau) and teacher T = softmax(z_T / tau):

    GJSD_beta(T || S) = beta KL(T || M) + (1 - beta) KL(S || M),   M = beta T + (1 - beta) S

beta in (0, 1) interpolates; the end points are defined as the two KLs it tends to (scaled), as
TRL's `GKDTrainer.generalized_jsd_loss` defines them: beta = 0 is the forward KL(T || S) (mode
covering, supervised KD on the student's prefixes), beta = 1 the reverse KL(S || T) (mode
seeking, MiniLLM's objective, Gu et al., 2024).

`generalized_jsd` is the formula on logits the caller holds ([..., V]). `fused_generalized_jsd`
computes it from the two models' final hidden states and output embeddings without ever holding
[B, T, V]: time chunks (each recomputed in the backward pass, `jax.checkpoint`) and, within a
chunk, strided vocabulary chunks in two passes, an online logsumexp of both models and then the
sum of the per-entry terms below, the way `rljax.models.scoring.fused_logprobs` chunks one model.
Gradients reach the student's hidden states and embedding; the teacher's inputs are constants.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rljax.models.scoring import _NEG, _block, _chunk_ids, _from_chunks, _Plan, _prepare, _rows, _to_chunks


def _terms(ls, lt, beta: float):
    """The per-entry terms whose sum over the vocabulary is GJSD_beta, from log-probs ls (student)
    and lt (teacher): t (lt - ls) at beta = 0, s (ls - lt) at beta = 1, else
    beta t (lt - lm) + (1 - beta) s (ls - lm) with lm = log((1 - beta) s + beta t)."""
    if beta == 0.0:
        return jnp.exp(lt) * (lt - ls)
    if beta == 1.0:
        return jnp.exp(ls) * (ls - lt)
    lm = jnp.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * jnp.exp(lt) * (lt - lm) + (1.0 - beta) * jnp.exp(ls) * (ls - lm)


def _check_beta(beta: float) -> float:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"GJSD beta={beta} must lie in [0, 1]")
    return float(beta)


def generalized_jsd(student_logits, teacher_logits, *, beta: float = 0.5, temperature: float = 1.0):
    """GJSD_beta(T || S) per position, [...], from logits [..., V] (f32 math)."""
    beta = _check_beta(beta)
    ls = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    lt = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(_terms(ls, lt, beta), axis=-1)


def fused_generalized_jsd(h_s_btd, w_s_vd, h_t_btd, w_t_vd, *, beta: float = 0.5, temperature: float = 1.0,
                          softcap_s: float | None = None, softcap_t: float | None = None,
                          time_chunk: int | None = None, vocab_chunk: int | None = None):
    """GJSD_beta per position [B, T] (f32) of the distributions predicted by the student's hidden
    states h_s_btd [B, T, D_S] through w_s_vd [V, D_S] and the teacher's h_t_btd [B, T, D_T]
    through w_t_vd [V, D_T] (one vocabulary, any widths), holding at most one
    [B, time_chunk, vocab_chunk] block of each model's logits at a time."""
    beta = _check_beta(beta)
    b, t, _ = h_s_btd.shape
    v = w_s_vd.shape[0]
    if w_t_vd.shape[0] != v:
        raise ValueError(f"student and teacher vocabularies differ ({v} vs {w_t_vd.shape[0]} ids)")
    steps = t if time_chunk is None else max(1, min(time_chunk, t))
    pieces = 1 if vocab_chunk is None else -(-v // max(1, min(vocab_chunk, v)))
    plan_s = _Plan(float(temperature), None if softcap_s is None else float(softcap_s), False, steps, pieces)
    plan_t = _Plan(float(temperature), None if softcap_t is None else float(softcap_t), False, steps, pieces)
    ws, wt = _prepare(plan_s, h_s_btd, w_s_vd), _prepare(plan_t, h_t_btd, jax.lax.stop_gradient(w_t_vd))

    def logits(j, hs, ht):
        pick = (lambda w: w) if pieces == 1 else (lambda w: jax.lax.dynamic_index_in_dim(w, j, 1, keepdims=False))
        ws_c, wt_c = pick(ws), pick(wt)
        ids = _chunk_ids(plan_s, ws_c.shape[0], j)
        valid = None if ids is None else ids < v
        return _block(plan_s, hs, ws_c, ids, v)[1], _block(plan_t, ht, wt_c, ids, v)[1], valid

    def loop(body, init):
        return body(0, init) if pieces == 1 else jax.lax.fori_loop(0, pieces, body, init)

    @jax.checkpoint
    def chunk(xs):
        hs, ht = (_rows(x) for x in xs)
        r = hs.shape[0]

        @jax.checkpoint
        def lse_pass(j, carry):  # online logsumexp of both models
            ms, ss, mt, st = carry
            zs, zt, _ = logits(j, hs, ht)
            ms_new, mt_new = jnp.maximum(ms, jnp.max(zs, axis=-1)), jnp.maximum(mt, jnp.max(zt, axis=-1))
            ss = ss * jnp.exp(ms - ms_new) + jnp.sum(jnp.exp(zs - ms_new[:, None]), axis=-1)
            st = st * jnp.exp(mt - mt_new) + jnp.sum(jnp.exp(zt - mt_new[:, None]), axis=-1)
            return ms_new, ss, mt_new, st

        neg, zero = jnp.full((r,), _NEG, jnp.float32), jnp.zeros((r,), jnp.float32)
        ms, ss, mt, st = loop(lse_pass, (neg, zero, neg, zero))
        lse_s, lse_t = ms + jnp.log(ss), jax.lax.stop_gradient(mt + jnp.log(st))

        @jax.checkpoint
        def sum_pass(j, acc):
            zs, zt, valid = logits(j, hs, ht)
            terms = _terms(zs - lse_s[:, None], zt - lse_t[:, None], beta)
            if valid is not None:
                terms = jnp.where(valid[None], terms, 0.0)
            return acc + jnp.sum(terms, axis=-1)

        return loop(sum_pass, zero).reshape(b, -1)

    xs = (_to_chunks(h_s_btd, steps), _to_chunks(jax.lax.stop_gradient(h_t_btd), steps))
    return _from_chunks(jax.lax.map(chunk, xs), t)
