"""Scoring: per-token log-probs and entropy of given tokens, and the value model.

The trainer and the sampler both score tokens through `logprobs_from_logits`, so a PPO ratio
starts at 1 up to the rounding of two different forward passes (a KV-cached decode step against a
full-sequence forward): small in f32, larger in bf16. The update step reports that gap every
step (`logp_diff/first_abs_max`) instead of asserting it away.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.models.config import ModelConfig
from rljax.models.transformer import Params, hidden_states, logits_from_hidden


def logprobs_from_logits(logits_btv, targets_bt, temperature: float = 1.0, with_entropy: bool = False):
    """log p(target) = z_target - logsumexp(z), with z = logits / temperature.

    Entropy H = logsumexp(z) - sum_v softmax(z)_v z_v reuses the same logsumexp, so the
    [B, T, V] log-softmax is never materialised (only one [B, T, V] probability array for H).
    """
    z = logits_btv.astype(jnp.float32)
    if temperature != 1.0:
        z = z / temperature
    lse_bt = jax.nn.logsumexp(z, axis=-1)
    target_z_bt = jnp.take_along_axis(z, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logp_bt = target_z_bt - lse_bt
    if not with_entropy:
        return logp_bt, None
    probs = jnp.exp(z - lse_bt[..., None])
    entropy_bt = lse_bt - jnp.sum(probs * z, axis=-1)
    return logp_bt, entropy_bt


# Bytes one time-chunk of the vocabulary projection may hold: its f32 logits and the softmax
# the entropy (or the backward pass) needs, 2 x [B, chunk, V] x 4 bytes.
LOGITS_BUDGET_BYTES = 256 << 20


def auto_chunk_size(batch: int, time: int, vocab: int, budget_bytes: int = LOGITS_BUDGET_BYTES) -> int | None:
    """The time-chunk for `token_logprobs(chunk_size=...)` chosen from the shapes: None when the
    whole [B, T, V] projection (logits and softmax in f32) fits `budget_bytes`, else the largest
    power of two of time steps whose chunk does (at least 1). A 151,936-id vocabulary at B = 64
    rows takes 8 steps per chunk; a 17-symbol one is never chunked."""
    per_step = 2 * 4 * batch * vocab
    if per_step * time <= budget_bytes:
        return None
    steps = max(1, budget_bytes // per_step)
    return 1 << (steps.bit_length() - 1)


def token_logprobs(cfg: ModelConfig, params: Params, tokens_bt, attn_mask_bt=None, positions_bt=None, *,
                   temperature: float = 1.0, with_entropy: bool = False, chunk_size: int | None = None,
                   remat: bool = False, unroll: bool = False):
    """Log-prob of each token given its prefix, aligned with `tokens_bt`.

    Returns (logp_bt, entropy_bt or None), both [B, T] f32. Column t scores tokens[:, t] under the
    distribution predicted at t - 1; column 0 has no prefix and is 0. `chunk_size` computes the
    vocabulary projection in time chunks (with rematerialisation) so a large vocabulary never
    holds a full [B, T, V] array. `remat` and `unroll` go to `hidden_states`.
    """
    h_btd, _ = hidden_states(cfg, params, tokens_bt, positions_bt, attn_mask_bt, remat=remat, unroll=unroll)
    h_btd = h_btd[:, :-1]
    targets_bt = tokens_bt[:, 1:]

    def score(h, tgt):
        return logprobs_from_logits(logits_from_hidden(cfg, params, h), tgt, temperature, with_entropy)

    t = h_btd.shape[1]
    if chunk_size is None or chunk_size >= t:
        logp, ent = score(h_btd, targets_bt)
    else:
        pad = (-t) % chunk_size
        h_p = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0)))
        tg_p = jnp.pad(targets_bt, ((0, 0), (0, pad)))
        n = (t + pad) // chunk_size
        h_c = h_p.reshape(h_p.shape[0], n, chunk_size, -1).swapaxes(0, 1)
        tg_c = tg_p.reshape(tg_p.shape[0], n, chunk_size).swapaxes(0, 1)
        logp, ent = jax.lax.map(lambda xs: jax.checkpoint(score)(*xs), (h_c, tg_c))
        logp = logp.swapaxes(0, 1).reshape(tokens_bt.shape[0], -1)[:, :t]
        ent = None if ent is None else ent.swapaxes(0, 1).reshape(tokens_bt.shape[0], -1)[:, :t]
    zero = jnp.zeros_like(logp[:, :1])
    logp = jnp.concatenate([zero, logp], axis=1)
    if ent is not None:
        ent = jnp.concatenate([zero, ent], axis=1)
    return logp, ent


# ----------------------------------------------------------------------------- value model


def init_value_params(cfg: ModelConfig, policy_params: Params, key: jax.Array, std: float = 0.0) -> Params:
    """A critic on the policy's backbone: a copy of the backbone plus a scalar head [D] and bias.

    The head starts at zero (std=0) so initial values are 0, the common PPO-for-LLM choice.
    """
    backbone = {k: v for k, v in policy_params.items() if k != "lm_head"}
    head = std * jax.random.normal(key, (cfg.hidden_size,), jnp.float32)
    return {**jax.tree.map(jnp.array, backbone),
            "value_head": head.astype(cfg.params_jnp_dtype),
            "value_bias": jnp.zeros((), cfg.params_jnp_dtype)}


def values(cfg: ModelConfig, value_params: Params, tokens_bt, attn_mask_bt=None, positions_bt=None, *,
           remat: bool = False, unroll: bool = False):
    """Per-token values V(s_t) [B, T] f32: a linear head on the final hidden state at t."""
    h_btd, _ = hidden_states(cfg, value_params, tokens_bt, positions_bt, attn_mask_bt, remat=remat,
                             unroll=unroll)
    v = jnp.einsum("btd,d->bt", h_btd.astype(jnp.float32), value_params["value_head"].astype(jnp.float32))
    return v + value_params["value_bias"].astype(jnp.float32)
