"""Token controls: what the update selects over a whole mini-batch before it splits it.

Clip-Cov and KL-Cov pick tokens by a covariance whose means and top-k run over many tokens, and
the high-entropy mask (`algorithm.top_entropy_quantile`) thresholds at a quantile of the tokens'
entropies (`rljax.objectives.entropy_control`). Computed inside each micro-batch (as verl and TRL
do), the selection would change with `update.num_microbatches`, the packing's token budget or
the device count. Here it does not: once per mini-batch, before micro-batching or packing,

    logp_bt, entropy_bt = the policy (the params this mini-batch's gradient is taken at, no LoRA
                          dropout) on the mini-batch's rows, without gradients
    select_bt           = the policy loss's declared selection (`POLICY_LOSSES.selects`), with a
                          key folded from the mini-batch's key (the update's `rng`)
    entropy_keep_bt     = the valid tokens at or above the (1 - rho) entropy quantile

and every micro-batch reads its rows of them. The scope of every mean, top-k, quantile and draw
is the mini-batch, exactly (`tests/update/test_controls.py` checks that 1, 2 and 4 micro-batches
and packing select the same tokens and give the same gradient). The micro-batches' own forward
passes compute the same log-probs again (with gradients); verl's cov uses those detached, so the
values are the same up to the numerics of a different batch shape.

The scoring pass costs one forward of the mini-batch (about a fifth of a small model's update
step). Two places already hold that forward, and the selection reads them instead:

- the loss's own forward (`controls_in_loss`): when the mini-batch is one unpacked micro-batch
  and the trained forward has no LoRA dropout, `microbatch_loss` sees exactly the mini-batch's
  rows at the same params, so it calls `select_tokens` on its detached log-probs and entropies
  before the policy loss. Same scope, same key, same tokens; the selection depends on no
  gradient, so the loss and its gradient are the reference's;
- else `old_logp_bt` (`fast_logp`): one mini-batch and one epoch with `recompute_old_logp`, where
  the ratio's denominator was scored by the same params (the high-entropy mask needs entropies,
  which that pass does not keep, so it still scores).

Otherwise (several micro-batches, packing, LoRA dropout) `token_controls` scores the mini-batch:
the reference path, which `tests/update/test_controls.py` checks the loss's path against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.models import token_logprobs
from rljax.objectives.entropy_control import entropy_quantile_mask, token_covariance
from rljax.objectives.registry import POLICY_LOSSES
from rljax.update.batch import PreparedBatch, replayed_routes

sg = jax.lax.stop_gradient

SELECTION_STREAM = 0x7FFFFFFF  # folded into the mini-batch key: a stream LoRA dropout never uses


def score_rows(cfg, params, tokens_bt, attn_mask_bt, *, chunks: int, update_cfg, with_entropy: bool,
               routes_btlk=None):
    """(log-probs [B, T], entropies [B, T] or None) of `params` on the rows, in `chunks` row
    blocks (lax.map: one block's activations at a time), without gradients. `routes_btlk`: a
    routing record to replay (routing replay)."""
    b, t = tokens_bt.shape
    lp_chunks = update_cfg.chunk_for(b // chunks, t, cfg.vocab_size)
    rows = (tokens_bt, attn_mask_bt) if routes_btlk is None else (tokens_bt, attn_mask_bt, routes_btlk)

    def one(toks, attn, *routes):
        logp, ent = token_logprobs(cfg, params, toks, attn, with_entropy=with_entropy, chunk_size=lp_chunks.time,
                                   vocab_chunk=lp_chunks.vocab,
                                   routes_lbtk=replayed_routes(*routes) if routes else None)[:2]
        return logp, (jnp.zeros_like(logp) if ent is None else ent)

    if chunks == 1:
        logp, ent = one(*rows)
    else:
        split = lambda x: x.reshape(chunks, b // chunks, *x.shape[1:])  # noqa: E731
        logp, ent = jax.lax.map(lambda xs: one(*xs), tuple(split(x) for x in rows))
        logp, ent = logp.reshape(b, t), ent.reshape(b, t)
    return sg(logp), (sg(ent) if with_entropy else None)


def controls_in_loss(state) -> bool:
    """Whether the loss's own forward serves the token controls (no scoring pass): token controls
    on, one micro-batch, no packing (the loss's forward then runs on exactly the mini-batch's
    rows) and no LoRA dropout (it then runs at exactly the mini-batch's params)."""
    sched, lora = state.update_cfg, state.lora
    return (state.algo.token_controls and sched.num_microbatches == 1 and not sched.packing
            and (lora is None or lora.dropout == 0))


def fast_logp(algo, update_cfg) -> bool:
    """Whether the mini-batch's own log-probs are `old_logp_bt` (no scoring pass needed for a
    covariance selection): one mini-batch, one epoch, old log-probs recomputed by the trainer."""
    return (algo.recompute_old_logp and update_cfg.num_minibatches == 1 and update_cfg.num_epochs == 1
            and algo.top_entropy_quantile >= 1.0)


def select_tokens(algo, mb: PreparedBatch, logp_bt, entropy_bt, mb_key
                  ) -> tuple[PreparedBatch, dict[str, tuple[jax.Array, jax.Array]]]:
    """The mini-batch `mb` with `select_bt` and `entropy_keep_bt` set from the policy's log-probs
    and entropies on its rows (`entropy_bt`: None unless `top_entropy_quantile` < 1), and their
    metrics as (numerator, denominator) pairs: policy/cov_mean (the mean covariance over the valid
    tokens), policy/cov_clipped_share (selected / valid tokens), policy/entropy_masked_share
    (valid tokens without policy loss under the entropy mask). Every mean, top-k, quantile and
    draw runs over all of `mb`; the draw's key is folded from `mb_key`. Pure, no gradient."""
    logp_bt = sg(logp_bt)
    mask = mb.loss_mask_bt
    n = jnp.sum(mask > 0).astype(jnp.float32)
    pairs = {}
    select, keep = None, None
    selects = POLICY_LOSSES.selects(algo.policy_loss)
    if selects is not None:
        key = jax.random.fold_in(mb_key, SELECTION_STREAM)
        select = selects(logp_bt, mb.old_logp_bt, mb.advantages_bt, mask, key, algo).astype(jnp.float32)
        cov = token_covariance(logp_bt, mb.advantages_bt, mask)
        pairs["policy/cov_mean"] = (jnp.sum(cov) / jnp.maximum(n, 1.0), jnp.ones((), jnp.float32))
        pairs["policy/cov_clipped_share"] = (jnp.sum(select), n)
    if algo.top_entropy_quantile < 1.0:
        keep = entropy_quantile_mask(sg(entropy_bt), mask, algo.top_entropy_quantile)
        pairs["policy/entropy_masked_share"] = (n - jnp.sum(keep), n)
    return mb.replace(select_bt=select, entropy_keep_bt=keep), pairs


def token_controls(state, trainable, mb: PreparedBatch, mb_key, *, chunks: int,
                   logp_bt=None) -> tuple[PreparedBatch, dict[str, tuple[jax.Array, jax.Array]]]:
    """`select_tokens` on the mini-batch `mb` scored by the policy of `trainable` in `chunks` row
    blocks, without gradients (the reference path). `logp_bt`: the mini-batch's log-probs when
    known (`fast_logp`); scored only when the entropy mask needs entropies."""
    algo = state.algo
    need_entropy = algo.top_entropy_quantile < 1.0
    ent = None
    if logp_bt is None or need_entropy:
        policy, _ = state.models(trainable)
        logp_bt, ent = score_rows(state.model_cfg, policy, mb.tokens_bt, mb.attn_mask_bt, chunks=chunks,
                                  update_cfg=state.update_cfg, with_entropy=need_entropy, routes_btlk=mb.routes_btlk)
    return select_tokens(algo, mb, logp_bt, ent, mb_key)
