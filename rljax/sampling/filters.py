"""The sampling distribution: temperature, top-k, top-p, min-p and greedy on one row of logits.

The filters compose in the order transformers applies them, each on the distribution the
previous one left (renormalised):

    z      = logits / temperature
    top-k  : keep the k largest z                                   (Fan et al., 2018)
    top-p  : keep the smallest head of the sorted distribution whose mass reaches p;
             a token is kept when the mass strictly before it is < p  (Holtzman et al., 2020)
    min-p  : keep tokens with p(v) >= min_p * max_v p(v)             (Nguyen et al., 2024)

Nothing sorts the vocabulary. With top-k set, everything after it works on the k candidates that
`lax.top_k` returns sorted; without it, top-p finds its threshold by an exact bisection. A token
is drawn by inverting the CDF with one uniform per row (two short cumsums, see `inverse_cdf`)
rather than a Gumbel noise draw per vocabulary entry. Every step is O(V) and vectorises on CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rljax.errors import ConfigError

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which filters are on: the static half of the sampling controls (a jit static arg).

    `temperature`, `top_p` and `min_p` values stay traced, so changing them never recompiles;
    switching a filter on or off, or changing `top_k`, does.
    """

    top_k: int = 0
    use_top_p: bool = False
    use_min_p: bool = False
    greedy: bool = False


def make_filters(temperature: float, top_k: int, top_p: float, min_p: float, greedy: bool) -> Filters:
    """Validates the user's controls; temperature 0 means greedy."""
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ConfigError(f"top_k must be >= 0 (0 turns it off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1] (1 turns it off), got {top_p}")
    if not 0.0 <= min_p < 1.0:
        raise ConfigError(f"min_p must be in [0, 1) (0 turns it off), got {min_p}")
    greedy = bool(greedy or temperature == 0)
    if greedy:
        return Filters(greedy=True)
    return Filters(top_k=int(top_k), use_top_p=top_p < 1.0, use_min_p=min_p > 0.0)


def _first_true(cond_bk):
    """Index of the first True along the last axis (K where none)."""
    k = cond_bk.shape[-1]
    return jnp.min(jnp.where(cond_bk, jnp.arange(k, dtype=jnp.int32), k), axis=-1)


def _last_true(cond_bk):
    """Index of the last True along the last axis (-1 where none)."""
    return jnp.max(jnp.where(cond_bk, jnp.arange(cond_bk.shape[-1], dtype=jnp.int32), -1), axis=-1)


def argmax_first(x_bv):
    """Arg-max with ties going to the lowest index, as a max and a min reduction (both vectorise
    on CPU, unlike the variadic reduce behind `jnp.argmax`)."""
    return _first_true(x_bv == jnp.max(x_bv, axis=-1, keepdims=True))


def _ordered_key(z):
    """An int32 key with the order of the float32 values (for an exact bisection over floats)."""
    i = jax.lax.bitcast_convert_type(z, jnp.int32)
    return jnp.where(i >= 0, i, jnp.int32(-(2**31)) - i - 1)


def _top_p_mask(z_bv, probs_bv, top_p):
    """Nucleus membership on an unsorted row, without a sort.

    v is kept iff the mass of tokens with a larger logit is < top_p. That set is {z >= tau}, tau
    the smallest logit with mass(z > tau) < top_p, found by a 32-step bisection over the ordered
    integer keys of the float logits (exact, O(32 V) instead of a full sort).
    """
    keys_bv = _ordered_key(z_bv)
    lo = jnp.min(keys_bv, axis=-1) - 1  # mass above lo is 1 >= top_p
    hi = jnp.max(keys_bv, axis=-1)  # mass above hi is 0 < top_p

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        above = jnp.sum(jnp.where(keys_bv > mid[:, None], probs_bv, 0.0), axis=-1)
        small = above < top_p
        return jnp.where(small, lo, mid), jnp.where(small, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return keys_bv >= hi[:, None]


def filter_logits(z_bk, filters: Filters, top_p, min_p, *, sorted_desc: bool):
    """Applies top-p and min-p to tempered logits `z_bk` (-inf marks removed tokens).

    `sorted_desc` says whether rows are sorted (the top-k candidates): top-p is then a cumsum,
    else an exact bisection.
    """
    if filters.use_top_p:
        probs = jax.nn.softmax(z_bk, axis=-1)
        if sorted_desc:
            keep = jnp.cumsum(probs, axis=-1) - probs < top_p
        else:
            keep = _top_p_mask(z_bk, probs, top_p)
        z_bk = jnp.where(keep, z_bk, _NEG_INF)
    if filters.use_min_p:
        z_max = jnp.max(z_bk, axis=-1, keepdims=True)
        z_bk = jnp.where(z_bk >= z_max + jnp.log(min_p), z_bk, _NEG_INF)
    return z_bk


def candidates(logits_bv, temperature, filters: Filters):
    """Tempered, filtered logits of the candidate tokens and their vocabulary ids.

    Returns (z_bk, ids_bk or None): with top-k the k candidates sorted by logit, else the whole
    vocabulary in order with `ids_bk` None.
    """
    z = logits_bv.astype(jnp.float32) / temperature
    ids = None
    if filters.top_k > 0 and filters.top_k < z.shape[-1]:
        z, ids = jax.lax.top_k(z, filters.top_k)
    return z, ids


def inverse_cdf(u_b, probs_bk):
    """Index i with cdf[i-1] <= u < cdf[i], u in [0, sum p), never an index with p == 0.

    Two levels (blocks of ~sqrt(K), then one block) keep every cumsum short. Rounding can only
    move the draw to the nearest index with mass, never onto a removed token.
    """
    b, k = probs_bk.shape
    block = max(16, 1 << (int(k**0.5) - 1).bit_length())
    nb = -(-k // block)
    probs_bnc = jnp.pad(probs_bk, ((0, 0), (0, nb * block - k))).reshape(b, nb, block)
    mass_bn = jnp.sum(probs_bnc, axis=-1)
    cdf_bn = jnp.cumsum(mass_bn, axis=-1)
    j = _first_true((cdf_bn > u_b[:, None]) & (mass_bn > 0))
    j = jnp.where(j == nb, _last_true(mass_bn > 0), j)[:, None]
    u_b = u_b - (jnp.take_along_axis(cdf_bn, j, axis=1) - jnp.take_along_axis(mass_bn, j, axis=1))[:, 0]
    probs_bc = jnp.take_along_axis(probs_bnc, j[:, :, None], axis=1)[:, 0]
    i = _first_true((jnp.cumsum(probs_bc, axis=-1) > u_b[:, None]) & (probs_bc > 0))
    i = jnp.where(i == block, _last_true(probs_bc > 0), i)
    return j[:, 0] * block + i


def sample_logits(key, logits_bv, temperature=1.0, top_p=1.0, min_p=0.0, *, filters: Filters):
    """Draws one token per row from the filtered distribution.

    Returns (tokens_b int32, sampling_logp_b f32): the token and its log-probability under the
    distribution it was drawn from (tempered and filtered). Greedy takes the arg-max (first on
    ties, as transformers does) and reports log-probability 0, a point mass.
    """
    u_b = jax.random.uniform(key, (logits_bv.shape[0],), jnp.float32)
    return sample_logits_from_uniforms(u_b, logits_bv, temperature, top_p, min_p, filters=filters)


def row_uniforms(row_keys_b, step_b):
    """One uniform in [0, 1) per row from that row's own key and its token index:
    uniform(fold_in(row_key, step)). A row's draws then depend on nothing else in the batch, which
    is what lets the continuous scheduler reproduce the static one (`rljax.sampling.continuous`)."""
    draw = lambda key, step: jax.random.uniform(jax.random.fold_in(key, step), (), jnp.float32)
    return jax.vmap(draw)(row_keys_b, step_b)


def sample_logits_from_uniforms(u_b, logits_bv, temperature=1.0, top_p=1.0, min_p=0.0, *, filters: Filters):
    """`sample_logits` with the row uniforms `u_b` in [0, 1) given (see `row_uniforms`)."""
    if filters.greedy:
        tokens_b = argmax_first(logits_bv)
        return tokens_b, jnp.zeros(tokens_b.shape, jnp.float32)
    z_bk, ids_bk = candidates(logits_bv, temperature, filters)
    z_bk = filter_logits(z_bk, filters, top_p, min_p, sorted_desc=ids_bk is not None)
    z_max = jnp.max(z_bk, axis=-1, keepdims=True)
    lse_b1 = z_max + jnp.log(jnp.sum(jnp.exp(z_bk - z_max), axis=-1, keepdims=True))
    probs_bk = jnp.exp(z_bk - lse_b1)
    u_b = u_b * jnp.sum(probs_bk, axis=-1)
    choice_b = inverse_cdf(u_b, probs_bk)[:, None]
    sampling_logp_b = (jnp.take_along_axis(z_bk, choice_b, axis=-1) - lse_b1)[:, 0]
    tokens_b = choice_b if ids_bk is None else jnp.take_along_axis(ids_bk, choice_b, axis=-1)
    return tokens_b[:, 0].astype(jnp.int32), sampling_logp_b


def filtered_logprobs(logits_bv, temperature=1.0, top_p=1.0, min_p=0.0, *, filters: Filters):
    """The full [B, V] log-probabilities of the sampling distribution (-inf off the support)."""
    if filters.greedy:
        hot = jax.nn.one_hot(argmax_first(logits_bv), logits_bv.shape[-1], dtype=bool)
        return jnp.where(hot, 0.0, _NEG_INF)
    z_bk, ids_bk = candidates(logits_bv, temperature, filters)
    z_bk = filter_logits(z_bk, filters, top_p, min_p, sorted_desc=ids_bk is not None)
    logp_bk = jax.nn.log_softmax(z_bk, axis=-1)
    if ids_bk is None:
        return logp_bk
    full = jnp.full(logits_bv.shape, _NEG_INF, jnp.float32)
    return full.at[jnp.arange(logits_bv.shape[0])[:, None], ids_bk].set(logp_bk)
