"""The sampling distribution: temperature, top-k, top-p, min-p and greedy on one row of logits.

The filters compose in the order transformers applies them, each on the distribution the
previous one left (renormalised):

    z      = logits / temperature
    top-k  : keep the k largest z                                   (Fan et al., 2018)
    top-p  : keep the smallest head of the sorted distribution whose mass reaches p;
             a token is kept when the mass strictly before it is < p  (Holtzman et al., 2020)
    min-p  : keep tokens with p(v) >= min_p * max_v p(v)             (Nguyen et al., 2024)

Only top-p needs sorted probabilities. With top-k set, everything after it works on the k
candidates that `lax.top_k` returns already sorted, so a large vocabulary is never fully sorted;
without top-k, top-p sorts the whole row. A token is drawn by inverting the CDF with one uniform
per row, which is exact and costs one cumsum instead of a Gumbel noise draw per vocabulary entry.
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


def filter_logits(z_bk, filters: Filters, top_p, min_p):
    """Applies top-p and min-p to tempered logits `z_bk` (-inf marks removed tokens).

    With `filters.use_top_p`, `z_bk` must be sorted in descending order along the last axis.
    """
    if filters.use_top_p:
        probs = jax.nn.softmax(z_bk, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        z_bk = jnp.where(mass_before < top_p, z_bk, _NEG_INF)
    if filters.use_min_p:
        z_max = jnp.max(z_bk, axis=-1, keepdims=True)
        z_bk = jnp.where(z_bk >= z_max + jnp.log(min_p), z_bk, _NEG_INF)
    return z_bk


def candidates(logits_bv, temperature, filters: Filters):
    """Tempered, filtered logits of the candidate tokens and their vocabulary ids.

    Returns (z_bk, ids_bk or None): with top-k (or top-p) the k = top_k (or V) candidates sorted
    by logit, else the whole vocabulary in order with `ids_bk` None.
    """
    z = logits_bv.astype(jnp.float32) / temperature
    vocab = z.shape[-1]
    k = min(filters.top_k, vocab) if filters.top_k > 0 else (vocab if filters.use_top_p else 0)
    ids = None
    if k:
        z, ids = jax.lax.top_k(z, k)
    return z, ids


def sample_logits(key, logits_bv, temperature=1.0, top_p=1.0, min_p=0.0, *, filters: Filters):
    """Draws one token per row from the filtered distribution.

    Returns (tokens_b int32, sampling_logp_b f32): the token and its log-probability under the
    distribution it was drawn from (tempered and filtered). Greedy takes the arg-max (first on
    ties, as transformers does) and reports log-probability 0, a point mass.
    """
    if filters.greedy:
        tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        return tokens_b, jnp.zeros(tokens_b.shape, jnp.float32)
    z_bk, ids_bk = candidates(logits_bv, temperature, filters)
    z_bk = filter_logits(z_bk, filters, top_p, min_p)
    probs_bk = jax.nn.softmax(z_bk, axis=-1)
    cdf_bk = jnp.cumsum(probs_bk, axis=-1)
    u_b1 = jax.random.uniform(key, (z_bk.shape[0], 1), jnp.float32) * cdf_bk[:, -1:]
    choice_b = jnp.sum(cdf_bk <= u_b1, axis=-1)
    # Rounding can put u at the very top of the CDF: fall back to the last token with mass.
    kk = z_bk.shape[-1]
    last_b = kk - 1 - jnp.argmax(jnp.flip(probs_bk > 0, axis=-1), axis=-1)
    choice_b = jnp.minimum(choice_b, last_b)[:, None]
    z_chosen = jnp.take_along_axis(z_bk, choice_b, axis=-1)[:, 0]
    sampling_logp_b = z_chosen - jax.nn.logsumexp(z_bk, axis=-1)
    tokens_b = choice_b[:, 0] if ids_bk is None else jnp.take_along_axis(ids_bk, choice_b, axis=-1)[:, 0]
    return tokens_b.astype(jnp.int32), sampling_logp_b


def filtered_logprobs(logits_bv, temperature=1.0, top_p=1.0, min_p=0.0, *, filters: Filters):
    """The full [B, V] log-probabilities of the sampling distribution (-inf off the support)."""
    if filters.greedy:
        hot = jax.nn.one_hot(jnp.argmax(logits_bv, axis=-1), logits_bv.shape[-1], dtype=bool)
        return jnp.where(hot, 0.0, _NEG_INF)
    z_bk, ids_bk = candidates(logits_bv, temperature, filters)
    logp_bk = jax.nn.log_softmax(filter_logits(z_bk, filters, top_p, min_p), axis=-1)
    if ids_bk is None:
        return logp_bk
    full = jnp.full(logits_bv.shape, _NEG_INF, jnp.float32)
    return full.at[jnp.arange(logits_bv.shape[0])[:, None], ids_bk].set(logp_bk)
