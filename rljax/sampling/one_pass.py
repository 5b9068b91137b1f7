"""One decode step's draw in two passes over the [B, V] logits instead of six.

Per step the sampler needs three things from a row of logits x (`rljax.sampling.decode.draw`):
the token, drawn from the tempered, filtered distribution; its policy log-prob under the
temperature-1, unfiltered softmax (what the trainer recomputes); and its sampling log-prob. The
reference (`filters.sample_logits_from_uniforms` + `models.logprobs_from_logits`) reads the
vocabulary about six times: a max and a sum for the tempered softmax, the probabilities, the
inverse-CDF's block sums, then a max and a sum again for the policy's log-sum-exp. Here:

    pass 1  m = max_v x                        (so the tempered max is m / T: division by T > 0
                                                is monotone, exactly as the reference rounds it)
    pass 2  per block c of the vocabulary, in one fusion reading x once:
              s1_c = sum_{v in c} exp(x_v - m)             temperature-1 mass
              sT_c = sum_{v in c, kept} exp(x_v / T - m / T)  tempered, filtered mass
    then, on [B, V / block] only:
      u' = u * sum_c sT_c;  c* = first block whose cumulative sT passes u'   (inverse CDF, level 1)
      read block c* (one [B, block] gather), cumsum its weights, pick the token   (level 2)
      policy   log p = x_tok - m - log sum_c s1_c
      sampling log q = x_tok / T - m / T - log sum_c sT_c

One uniform per row, as the reference draws it (`filters.row_uniforms`), so a row's randomness
is still its own; the token law is the reference's (the same two-level inverse CDF of the same
masses, unnormalised), though rounding may put a draw that sits on a CDF boundary on the other
side. A Gumbel-max draw would need V random numbers per row; an online (variadic) log-sum-exp
would fold pass 1 into pass 2, but a variadic reduce does not vectorise on the CPU and XLA's GPU
reduction emitter fuses the two plain reductions well.

Filters cost only when on. min-p is a mask inside pass 2 (top-p keeps the arg-max, so the
filtered maximum is m / T and p_v >= min_p * p_max is x_v / T >= m / T + log min_p). top-p
without top-k runs the reference's exact bisection (`filters.filter_logits`), 32 extra passes.
top-k runs the reference's draw on the k candidates of `lax.top_k`, plus the policy's
log-sum-exp (a max and a sum). Greedy: the arg-max
shares pass 1 with the policy's log-sum-exp. A `logits_processor` changes the sampling logits
apart from the policy's, so it keeps the reference path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.sampling.filters import Filters, filter_logits, sample_logits_from_uniforms

_NEG_INF = -jnp.inf


def vocab_block(v: int) -> int:
    """The inverse CDF's block: a power of two near sqrt(V), at least 16 (as `filters.inverse_cdf`)."""
    return max(16, 1 << (int(v**0.5) - 1).bit_length())


def _first_true(cond_bk):
    k = cond_bk.shape[-1]
    return jnp.min(jnp.where(cond_bk, jnp.arange(k, dtype=jnp.int32), k), axis=-1)


def _last_true(cond_bk):
    return jnp.max(jnp.where(cond_bk, jnp.arange(cond_bk.shape[-1], dtype=jnp.int32), -1), axis=-1)


def _kept(z_bx, zmax_b1, keep_bx, filters: Filters, min_p):
    """Tempered weights exp(z - zmax) of the kept tokens (0 elsewhere): min-p inline, or the
    mask `keep_bx` that top-p's bisection left (-inf there)."""
    w = jnp.exp(z_bx - zmax_b1)
    keep = z_bx > _NEG_INF
    if keep_bx is not None:
        keep &= keep_bx
    if filters.use_min_p:
        keep &= z_bx >= zmax_b1 + jnp.log(min_p)
    return jnp.where(keep, w, 0.0)


def _draw_vocab(u_b, x_bv, temperature, top_p, min_p, filters: Filters):
    """No top-k: the two passes of the module docstring over the whole vocabulary."""
    b, v = x_bv.shape
    block = vocab_block(v)
    nb = -(-v // block)
    m_b1 = jnp.max(x_bv, axis=-1, keepdims=True)  # pass 1
    zmax_b1 = m_b1 / temperature
    keep_bv = None
    if filters.use_top_p:  # the reference's exact bisection over the tempered softmax
        z_bv = x_bv / temperature
        keep_bv = filter_logits(z_bv, Filters(use_top_p=True), top_p, min_p, sorted_desc=False) > _NEG_INF
        keep_bv = jnp.pad(keep_bv, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    x_bnc = jnp.pad(x_bv, ((0, 0), (0, nb * block - v)), constant_values=_NEG_INF).reshape(b, nb, block)
    # pass 2: the policy's mass over the row (summed in the trainer's order, so its log-prob is
    # the trainer's to the bit, not only to rounding) and the tempered mass per block
    s1_b = jnp.sum(jnp.exp(x_bv - m_b1), axis=-1)
    st_bn = jnp.sum(_kept(x_bnc / temperature, zmax_b1[:, :, None], keep_bv, filters, min_p), axis=-1)
    total_b = jnp.sum(st_bn, axis=-1)
    cdf_bn = jnp.cumsum(st_bn, axis=-1)
    u_b = u_b * total_b
    j = _first_true((cdf_bn > u_b[:, None]) & (st_bn > 0))
    j = jnp.where(j == nb, _last_true(st_bn > 0), j)[:, None]  # rounding past the end: the last block with mass
    u_b = u_b - (jnp.take_along_axis(cdf_bn, j, axis=1) - jnp.take_along_axis(st_bn, j, axis=1))[:, 0]
    x_bc = jnp.take_along_axis(x_bnc, j[:, :, None], axis=1)[:, 0]
    keep_bc = None if keep_bv is None else jnp.take_along_axis(keep_bv, j[:, :, None], axis=1)[:, 0]
    w_bc = _kept(x_bc / temperature, zmax_b1, keep_bc, filters, min_p)
    i = _first_true((jnp.cumsum(w_bc, axis=-1) > u_b[:, None]) & (w_bc > 0))
    i = jnp.where(i == block, _last_true(w_bc > 0), i)
    tok_b = (j[:, 0] * block + i).astype(jnp.int32)
    x_tok_b = jnp.take_along_axis(x_bc, i[:, None], axis=1)[:, 0]
    # both in the reference's order of rounding: target - (max + log mass)
    logp_b = x_tok_b - (jnp.log(s1_b) + m_b1[:, 0])
    slp_b = x_tok_b / temperature - (zmax_b1[:, 0] + jnp.log(total_b))
    return tok_b, logp_b, slp_b


def _draw_top_k(u_b, x_bv, temperature, top_p, min_p, filters: Filters):
    """top-k: the reference's draw on the k candidates `lax.top_k` returns, and one log-sum-exp
    for the policy. (Reusing top_k's maximum for that log-sum-exp made XLA:CPU run the program
    about 80x slower, measured on 64 x 151,936 logits, so the max is its own pass here.)"""
    tok_b, slp_b = sample_logits_from_uniforms(u_b, x_bv, temperature, top_p, min_p, filters=filters)
    m_b1 = jnp.max(x_bv, axis=-1, keepdims=True)
    lse1_b = jnp.log(jnp.sum(jnp.exp(x_bv - m_b1), axis=-1)) + m_b1[:, 0]
    return tok_b, jnp.take_along_axis(x_bv, tok_b[:, None], axis=1)[:, 0] - lse1_b, slp_b


def draw_one_pass(u_b, logits_bv, temperature=1.0, top_p=1.0, min_p=0.0, *, filters: Filters):
    """(tokens_b int32, policy logp_b, sampling logp_b) for one uniform per row `u_b` in [0, 1):
    the reference's law and log-probs (see the module docstring), in fewer passes over V."""
    x_bv = logits_bv.astype(jnp.float32)
    if filters.greedy:
        m_b1 = jnp.max(x_bv, axis=-1, keepdims=True)
        tok_b = _first_true(x_bv == m_b1)
        logp_b = -jnp.log(jnp.sum(jnp.exp(x_bv - m_b1), axis=-1))  # x_tok == m
        return tok_b.astype(jnp.int32), logp_b, jnp.zeros(tok_b.shape, jnp.float32)
    if 0 < filters.top_k < x_bv.shape[-1]:
        return _draw_top_k(u_b, x_bv, temperature, top_p, min_p, filters)
    return _draw_vocab(u_b, x_bv, temperature, top_p, min_p, filters)

