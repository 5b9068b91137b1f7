"""Scoring: per-token log-probs and entropy of given tokens, and the value model.

The trainer and the sampler both score tokens with the same formula on logits computed the same
way (`logits_from_hidden`'s matmul, softcap, then z / T): the sampler through
`logprobs_from_logits` on one [B, V] step, the trainer through `fused_logprobs`, which never holds
[B, T, V]. A PPO ratio therefore starts at 1 up to the rounding of two different forward passes
(a KV-cached decode step against a full-sequence forward, and a chunked logsumexp). The update
step reports that gap every step (`update/logp_diff_mean|max`, `update/ratio_first_min|max`)
instead of asserting it away.

Why the two are not bitwise equal, and the bound. Both run the same functions in the same dtypes
with f32 accumulation, but XLA compiles a [B, 1] decode step and a [B, T] forward into different
fusions: a norm's sum of squares is reduced in a row-count-dependent order, and a softmax sums
over a different number of (empty, zero-weight) cache slots. Those differ in the last f32 bits
(about 1e-7, relative), and a GPU's matmul kernels chosen per shape differ the same way. In f32
that is the whole gap (about 1e-6 nats). In bf16 compute the residual stream, norms and matmul
results stay in f32 (`hidden_states`), so a last-bit difference matters only where it straddles
the bf16 rounding of a matmul operand (probability about 2^-16 per element); then it moves that
operand by one bf16 ulp, and the token's log-prob by as much as that ulp moves the rest of the
forward. The stated bound, tested on a 4-layer model (tests/models/test_bf16_agreement.py): mean gap
<= 1e-4 nats, max <= 2e-3 nats, most tokens equal to f32 rounding. A flip moves more in a deeper,
wider model: for 8 layers of width 512 the bound is mean <= 6e-4, max <= 6e-3
(bench/bf16_agreement.py and BENCHMARKS.md hold the measurements); the mean falls 4-10,000x
against an all-bf16 stream, the max less. How far one flip propagates depends on the model, so for
a real checkpoint in bf16 the recipes recompute the old log-probs with the trainer
(`algorithm.recompute_old_logp = true`), which makes the ratio start at 1 by construction.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax.models.config import ModelConfig
from rljax.models.transformer import Params, hidden_states, hidden_states_and_routes, output_embedding


def logprobs_from_logits(logits_btv, targets_bt, temperature: float = 1.0, with_entropy: bool = False):
    """log p(target) = z_target - logsumexp(z), with z = logits / temperature.

    Entropy H = logsumexp(z) - sum_v softmax(z)_v z_v reuses the same logsumexp. This is the
    sampler's form, for logits it already holds ([B, V] per decode step); whole sequences are
    scored by `fused_logprobs`, the same formula in chunks.
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


# ----------------------------------------------------------------------------- chunk sizes

# Bytes one chunk of the vocabulary projection may hold: its f32 logits and the f32 softmax (or
# logit cotangent) computed from them, 2 x [rows, vocab chunk] x 4 bytes. On a CPU: 256 MiB, which
# keeps a chunk in the caches' reach and the step's memory small. On an accelerator: a share of
# the device's memory (`logits_budget_bytes`).
LOGITS_BUDGET_BYTES = 256 << 20
ACCELERATOR_BUDGET_SHARE = 1 / 32
_BYTES_PER_LOGIT = 2 * 4
_MIN_VOCAB_CHUNK = 1024  # below this a vocabulary chunk's matmuls are too thin for an accelerator
ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


class LogprobChunks(NamedTuple):
    """How `fused_logprobs` splits the vocabulary projection: `time` steps (of every row) per
    token chunk and `vocab` ids per vocabulary chunk; a value >= the dimension is one chunk."""

    time: int
    vocab: int


def logits_budget_bytes(platform: str | None = None, device_memory: int | None = None) -> int:
    """The chunk budget of the vocabulary projection: `LOGITS_BUDGET_BYTES` on a CPU; on a GPU or
    TPU, `ACCELERATOR_BUDGET_SHARE` of one device's memory (its `memory_stats()["bytes_limit"]`,
    or `device_memory`): about 4.3 GiB on an H200, 2.4 GiB on an H100, 0.5 GiB on a TPU v5e."""
    platform = platform or jax.default_backend()
    if platform not in ACCELERATORS:
        return LOGITS_BUDGET_BYTES
    if device_memory is None:
        stats = jax.local_devices()[0].memory_stats() or {}
        device_memory = stats.get("bytes_limit", 16 << 30)
    return int(device_memory * ACCELERATOR_BUDGET_SHARE)


def _divisor_pieces(vocab: int, need: float, min_chunk: int) -> int | None:
    """The fewest pieces >= `need` that divide `vocab` exactly with chunks of >= `min_chunk` ids
    (None if there are none): an exact split needs no padded rows of the embedding."""
    for pieces in range(max(1, math.ceil(need)), max(1, vocab // max(1, min_chunk)) + 1):
        if vocab % pieces == 0:
            return pieces
    return None


def auto_chunk_size(batch: int, time: int, vocab: int, budget_bytes: int | None = None, *,
                    time_chunk: int | None = None, platform: str | None = None) -> LogprobChunks:
    """The chunks of a [batch, time] scoring pass chosen from the shapes, so that one chunk's
    f32 logits and softmax, 2 x 4 bytes x rows x vocabulary ids, fit `budget_bytes` (default:
    `logits_budget_bytes(platform)`).

    CPU (time first): the whole sequence if it fits, else the largest power of two of time steps
    that does (at least 1); `time_chunk` overrides that choice (`update.logprob_chunk`). The
    vocabulary is split only where that token chunk still does not fit (B rows x 1 step x V over
    budget, or a large override), into the fewest power-of-two number of chunks that fit: a
    power of two divides real vocabularies (151,936 = 2^7 x 1187) without padding. A 151,936-id
    vocabulary at B = 64 rows takes 2 steps per chunk and the whole vocabulary; a 17-symbol one
    is one chunk.

    Accelerators (vocabulary first): every token of the pass in one chunk and the vocabulary
    split into the fewest exact divisors that fit, each of at least 1,024 ids; the time is halved
    only where even that does not fit. With one token chunk the weight gradient is written once
    per pass (each vocabulary slice once) instead of read, added to and written back per token
    chunk: on an H200 the 128-token chunks of the CPU's budget re-wrote an f32 [151,936, 896] dW
    512 times a step (BENCHMARKS.md). Exact divisors leave no padded embedding rows.
    """
    platform = platform or jax.default_backend()
    budget_bytes = logits_budget_bytes(platform) if budget_bytes is None else budget_bytes
    per_step = _BYTES_PER_LOGIT * batch * vocab
    if platform in ACCELERATORS:
        steps = time if time_chunk is None else max(1, min(time_chunk, time))
        while True:
            pieces = _divisor_pieces(vocab, per_step * steps / budget_bytes,
                                     _MIN_VOCAB_CHUNK if time_chunk is None else 1)
            if pieces is not None or steps == 1 or time_chunk is not None:
                break
            steps = 1 << ((steps - 1).bit_length() - 1)  # the power of two below
        if pieces is not None:
            return LogprobChunks(steps, vocab // pieces)
        time_chunk = steps  # no exact split fits: the CPU's power-of-two rule below
    if time_chunk is None:
        steps = time if per_step * time <= budget_bytes else max(1, budget_bytes // per_step)
        time_chunk = time if steps >= time else 1 << (steps.bit_length() - 1)
    steps = max(1, min(time_chunk, time))
    pieces = 1
    while pieces < vocab and per_step * steps > budget_bytes * pieces:
        pieces *= 2
    return LogprobChunks(steps, -(-vocab // min(pieces, vocab)))


# ----------------------------------------------------------------------------- fused scoring

_NEG = -1e30  # logit of a padded vocabulary row: exp(_NEG - m) = 0, and 0 * _NEG stays finite


@dataclasses.dataclass(frozen=True)
class _Plan:
    temperature: float
    softcap: float | None
    with_entropy: bool
    time_chunk: int  # steps per token chunk (divides the padded time)
    vocab_chunks: int  # number of strided vocabulary chunks (1: the whole vocabulary)


def _to_chunks(x_bt, steps: int):
    """[B, T, ...] -> [n, B, steps, ...], zero-padded in time; B stays whole (its sharding too)."""
    b, t = x_bt.shape[:2]
    x_bt = jnp.pad(x_bt, [(0, 0), (0, (-t) % steps)] + [(0, 0)] * (x_bt.ndim - 2))
    return x_bt.reshape(b, -1, steps, *x_bt.shape[2:]).swapaxes(0, 1)


def _from_chunks(x_nb, t: int):
    """[n, B, steps, ...] -> [B, T, ...]: the inverse of `_to_chunks`."""
    x_nb = x_nb.swapaxes(0, 1)
    return x_nb.reshape(x_nb.shape[0], -1, *x_nb.shape[3:])[:, :t]


def _vocab_view(w_vd, pieces: int):
    """[V, D] -> [V / pieces, pieces, D] (zero rows padded): chunk j is rows j, j + pieces, ...

    Strided, not contiguous: a V-sharded weight splits on the leading (within-chunk) dim of this
    view, so every chunk is itself V-sharded and selecting one is a local slice, where a
    contiguous chunk would live on one device and force a gather of the others' rows. That holds
    when V / pieces divides by the V-shard count (151,936 = 2^7 x 1187: pieces x shards <= 128);
    otherwise XLA all-gathers the weight, as it does for contiguous chunks.
    """
    v, d = w_vd.shape
    rows = -(-v // pieces)
    return jnp.pad(w_vd, ((0, rows * pieces - v), (0, 0))).reshape(rows, pieces, d)


def _block(plan: _Plan, h_rd, w_cd, ids_c, vocab: int):
    """Softcapped logits s and scaled logits z = s / T of rows h against vocabulary rows w,
    [R, C] f32: h @ w^T in the compute dtype accumulated in f32, as `logits_from_hidden`."""
    s = jax.lax.dot_general(h_rd, w_cd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if plan.softcap is not None:
        s = jnp.tanh(s / plan.softcap) * plan.softcap
    z = s / plan.temperature if plan.temperature != 1.0 else s
    if ids_c is not None and plan.vocab_chunks * w_cd.shape[0] > vocab:
        z = jnp.where(ids_c < vocab, z, _NEG)
    return s, z


def _chunk_ids(plan: _Plan, rows: int, j):
    return None if plan.vocab_chunks == 1 else jnp.arange(rows) * plan.vocab_chunks + j


def _forward_rows(plan: _Plan, h_rd, w_view, tgt_r, vocab: int):
    """(log p(target), logsumexp, entropy, whether the target is the argmax) of R rows: an online
    logsumexp over vocabulary chunks (Milakov & Gimelshein, 2018) carrying the running max m,
    sum e = exp(z - m), sum e * z (for H = lse - sum e z / sum e) and the target's logit."""
    def stats(j, carry):
        m, se, sez, zt = carry
        w_cd = w_view if plan.vocab_chunks == 1 else jax.lax.dynamic_index_in_dim(w_view, j, 1, keepdims=False)
        ids = _chunk_ids(plan, w_cd.shape[0], j)
        _, z = _block(plan, h_rd, w_cd, ids, vocab)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        e = jnp.exp(z - m_new[:, None])
        scale = jnp.exp(m - m_new)
        ids = jnp.arange(z.shape[1]) if ids is None else ids
        zt = zt + jnp.sum(jnp.where(ids[None] == tgt_r[:, None], z, 0.0), axis=-1)
        sez = sez * scale + jnp.sum(e * z, axis=-1) if plan.with_entropy else sez
        return m_new, se * scale + jnp.sum(e, axis=-1), sez, zt

    r = h_rd.shape[0]
    init = (jnp.full((r,), _NEG, jnp.float32),) + (jnp.zeros((r,), jnp.float32),) * 3
    if plan.vocab_chunks == 1:
        m, se, sez, zt = stats(0, init)
    else:
        m, se, sez, zt = jax.lax.fori_loop(0, plan.vocab_chunks, stats, init)
    lse = m + jnp.log(se)
    ent = lse - sez / se if plan.with_entropy else jnp.zeros_like(lse)
    return zt - lse, lse, ent, zt >= m  # zt is one of the z the max ran over: equal when it is the top-1


def _backward_rows(plan: _Plan, h_rd, w_view, tgt_r, lse_r, ent_r, g_logp_r, g_ent_r, dw_acc, vocab: int):
    """dh of R rows (f32) and dW accumulated into `dw_acc` (f32, the view's layout), from each
    chunk's recomputed logits:

        dL/dz_v = g_logp (1[v = target] - p_v) - g_H p_v (z_v - lse + H)
        dL/ds_v = dL/dz_v / T,   dL/draw_v = dL/ds_v (1 - (s_v / c)^2)  (softcap s = c tanh(raw / c))
        dh = dL/draw @ W,   dW += dL/draw^T @ h   (operands in the compute dtype, f32 accumulation)
    """
    cdt = h_rd.dtype

    def grads(j, carry):
        dh, dw = carry
        w_cd = w_view if plan.vocab_chunks == 1 else jax.lax.dynamic_index_in_dim(w_view, j, 1, keepdims=False)
        ids = _chunk_ids(plan, w_cd.shape[0], j)
        s, z = _block(plan, h_rd, w_cd, ids, vocab)
        p = jnp.exp(z - lse_r[:, None])
        coef = g_logp_r[:, None]
        if plan.with_entropy:
            coef = coef + g_ent_r[:, None] * (z - (lse_r - ent_r)[:, None])
        ids = jnp.arange(z.shape[1]) if ids is None else ids
        dz = jnp.where(ids[None] == tgt_r[:, None], g_logp_r[:, None], 0.0) - p * coef
        if plan.temperature != 1.0:
            dz = dz / plan.temperature
        if plan.softcap is not None:
            dz = dz * (1.0 - jnp.square(s / plan.softcap))
        dz = dz.astype(cdt)
        dh = dh + jax.lax.dot_general(dz, w_cd, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        dw_c = jax.lax.dot_general(dz, h_rd, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        if plan.vocab_chunks == 1:
            return dh, dw + dw_c
        return dh, jax.lax.dynamic_update_index_in_dim(dw, jax.lax.dynamic_index_in_dim(dw, j, 1) + dw_c[:, None],
                                                       j, 1)

    init = (jnp.zeros(h_rd.shape, jnp.float32), dw_acc)
    if plan.vocab_chunks == 1:
        return grads(0, init)
    return jax.lax.fori_loop(0, plan.vocab_chunks, grads, init)


def _prepare(plan: _Plan, h_btd, w_vd):
    w = w_vd.astype(h_btd.dtype)  # matmul operands in the compute dtype, as logits_from_hidden
    return w if plan.vocab_chunks == 1 else _vocab_view(w, plan.vocab_chunks)


def _rows(x_btk):
    return x_btk.reshape(-1, *x_btk.shape[2:])


def _fused_fwd(h_btd, w_vd, targets_bt, plan: _Plan):
    b, t, _ = h_btd.shape
    w_view = _prepare(plan, h_btd, w_vd)

    def chunk(xs):
        h_c, tgt_c = xs
        outs = _forward_rows(plan, _rows(h_c), w_view, _rows(tgt_c), w_vd.shape[0])[:3]
        return tuple(o.reshape(b, -1) for o in outs)

    # One chunk still runs in the loop: unrolled, XLA kept a third [rows, V] block alive at once.
    xs = (_to_chunks(h_btd, plan.time_chunk), _to_chunks(targets_bt, plan.time_chunk))
    logp, lse, ent = (_from_chunks(o, t) for o in jax.lax.map(chunk, xs))
    out = (logp, ent) if plan.with_entropy else (logp,)
    return out, (h_btd, w_vd, targets_bt, lse, ent if plan.with_entropy else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(h_btd, w_vd, targets_bt, plan: _Plan):
    return _fused_fwd(h_btd, w_vd, targets_bt, plan)[0]


def _fused_bwd(plan: _Plan, residuals, cotangents):
    h_btd, w_vd, targets_bt, lse_bt, ent_bt = residuals
    g_logp_bt = cotangents[0]
    g_ent_bt = cotangents[1] if plan.with_entropy else jnp.zeros_like(g_logp_bt)
    ent_bt = jnp.zeros_like(lse_bt) if ent_bt is None else ent_bt
    b, t, d = h_btd.shape
    w_view = _prepare(plan, h_btd, w_vd)

    def chunk(dw, xs):
        h_c, tgt_c, lse_c, ent_c, gl_c, ge_c = xs
        dh, dw = _backward_rows(plan, _rows(h_c), w_view, *(_rows(x) for x in (tgt_c, lse_c, ent_c, gl_c, ge_c)),
                                dw, w_vd.shape[0])
        return dw, dh.astype(h_btd.dtype).reshape(b, -1, d)

    xs = tuple(_to_chunks(x, plan.time_chunk) for x in (h_btd, targets_bt, lse_bt, ent_bt, g_logp_bt, g_ent_bt))
    dw, dh = jax.lax.scan(chunk, jnp.zeros(w_view.shape, jnp.float32), xs)
    dw = dw.reshape(-1, d)[:w_vd.shape[0]].astype(w_vd.dtype)
    return _from_chunks(dh, t), dw, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_logprobs(h_btd, w_vd, targets_bt, *, temperature: float = 1.0, softcap: float | None = None,
                   with_entropy: bool = False, time_chunk: int | None = None, vocab_chunk: int | None = None):
    """log p(target) and entropy of the softmax of z = c tanh((h @ W^T) / c) / T, never holding
    more than one [B, time_chunk, vocab_chunk] block of logits, forward or backward.

    h_btd: final hidden states [B, T, D] (the compute dtype); w_vd: the output embedding [V, D];
    targets_bt: ids [B, T]. Returns (logp_bt, entropy_bt or None), f32. c is Gemma 2's
    `final_logit_softcap` (None: no cap), T the sampling temperature.

    The approach of fused linear cross-entropy kernels (Liger Kernel, Hsu et al., 2024; Cut
    Cross-Entropy, Wijmans et al., 2024): a custom VJP whose residuals are h, W, the targets,
    logsumexp and entropy (O(B T), never O(B T V)), and whose backward pass recomputes each
    chunk's logits to form dL/dlogits = g (onehot - p) - g_H p (z - lse + H) in place, so
    autodiff never stores the [B, T, V] softmax. Chunks run in `lax.map`/`lax.scan` over time
    (each chunk keeps every row, so a batch-sharded h stays sharded) and, when `vocab_chunk` is
    set, an online logsumexp over strided vocabulary chunks (see `_vocab_view`: a V-sharded W
    stays sharded; a D-sharded W contracts over its sharded dim as the unchunked matmul does).
    dW accumulates in f32 over chunks and is cast to W's dtype once.
    """
    b, t, _ = h_btd.shape
    v = w_vd.shape[0]
    if t == 0:
        empty = jnp.zeros((b, 0), jnp.float32)
        return empty, (empty if with_entropy else None)
    steps = t if time_chunk is None else max(1, min(time_chunk, t))
    pieces = 1 if vocab_chunk is None else -(-v // max(1, min(vocab_chunk, v)))
    plan = _Plan(float(temperature), None if softcap is None else float(softcap), bool(with_entropy), steps, pieces)
    out = _fused(h_btd, w_vd, targets_bt.astype(jnp.int32), plan)
    return (out[0], out[1]) if with_entropy else (out[0], None)


def token_top1(h_btd, w_vd, targets_bt, *, softcap: float | None = None, time_chunk: int | None = None,
               vocab_chunk: int | None = None):
    """(log p(target), whether the target is the distribution's top-1) of hidden states h_btd
    [B, T, D] against the output embedding w_vd [V, D], no gradient: the forward half of
    `fused_logprobs` (the same chunks, the same online logsumexp), whose running max also says
    whether the target's logit is the largest. A teacher's grade of sampled tokens
    (`rljax.update.prepare_batch`) reads both."""
    b, t, _ = h_btd.shape
    v = w_vd.shape[0]
    steps = t if time_chunk is None else max(1, min(time_chunk, t))
    pieces = 1 if vocab_chunk is None else -(-v // max(1, min(vocab_chunk, v)))
    plan = _Plan(1.0, None if softcap is None else float(softcap), False, steps, pieces)
    w_view = _prepare(plan, h_btd, w_vd)

    def chunk(xs):
        h_c, tgt_c = xs
        logp, _, _, top1 = _forward_rows(plan, _rows(h_c), w_view, _rows(tgt_c), v)
        return logp.reshape(b, -1), top1.reshape(b, -1)

    xs = (_to_chunks(h_btd, plan.time_chunk), _to_chunks(targets_bt.astype(jnp.int32), plan.time_chunk))
    logp, top1 = (_from_chunks(o, t) for o in jax.lax.map(chunk, xs))
    return jax.lax.stop_gradient(logp), top1


def token_logprobs(cfg: ModelConfig, params: Params, tokens_bt, attn_mask_bt=None, positions_bt=None, *,
                   temperature: float = 1.0, with_entropy: bool = False, chunk_size: int | None = None,
                   vocab_chunk: int | None = None, remat: bool = False, unroll: bool = False, segment_ids_bt=None,
                   return_hidden: bool = False, rope_cos_sin=None, routes_lbtk=None, return_routing: bool = False):
    """Log-prob of each token given its prefix, aligned with `tokens_bt`.

    Returns (logp_bt, entropy_bt or None), both [B, T] f32, and with `return_hidden` the final
    hidden states [B, T, D] they came from (a full-vocabulary distillation loss reads them). Column t scores tokens[:, t] under the
    distribution predicted at t - 1; column 0 has no prefix and is 0. The vocabulary projection
    is `fused_logprobs`, chunked by `auto_chunk_size` from the shapes; `chunk_size` (time steps)
    and `vocab_chunk` (vocabulary ids) override its choice (a value >= the dimension: one chunk).
    `remat`, `unroll` and `segment_ids_bt` (packed rows) go to `hidden_states`; in a packed row the
    first token of each segment is scored from the previous segment's last token (mask it out).
    `rope_cos_sin` (per-row tables: an image prompt's M-RoPE, `rljax.models.vlm`) goes there too.
    MoE: `routes_lbtk` replays routes; `return_routing` appends the `MoEAux` (`hidden_states_and_routes`).
    """
    h_btd, aux = hidden_states_and_routes(cfg, params, tokens_bt, positions_bt, attn_mask_bt, routes_lbtk=routes_lbtk,
                                          remat=remat, unroll=unroll, segment_ids_bt=segment_ids_bt, rope_cos_sin=rope_cos_sin)
    targets_bt = tokens_bt[:, 1:]
    chunks = auto_chunk_size(*targets_bt.shape, cfg.vocab_size, time_chunk=chunk_size)
    logp, ent = fused_logprobs(h_btd[:, :-1], output_embedding(cfg, params), targets_bt, temperature=temperature,
                               softcap=cfg.final_logit_softcap, with_entropy=with_entropy, time_chunk=chunks.time,
                               vocab_chunk=chunks.vocab if vocab_chunk is None else vocab_chunk)
    zero = jnp.zeros_like(logp[:, :1])
    logp = jnp.concatenate([zero, logp], axis=1)
    if ent is not None:
        ent = jnp.concatenate([zero, ent], axis=1)
    return (logp, ent) + ((h_btd,) if return_hidden else ()) + ((aux,) if return_routing else ())


def teacher_scores(cfg: ModelConfig, params: Params, tokens_bt, attn_mask_bt=None, *, chunk_size: int | None = None,
                   vocab_chunk: int | None = None, return_hidden: bool = False):
    """A frozen model's grade of given tokens, aligned with `tokens_bt` like `token_logprobs`:
    (logp_bt, top1_bt) and with `return_hidden` its final hidden states [B, T, D]. top1_bt is
    True where the token is the model's most likely next token (column 0: False)."""
    h_btd, _ = hidden_states(cfg, params, tokens_bt, None, attn_mask_bt)
    targets_bt = tokens_bt[:, 1:]
    chunks = auto_chunk_size(*targets_bt.shape, cfg.vocab_size, time_chunk=chunk_size)
    logp, top1 = token_top1(h_btd[:, :-1], output_embedding(cfg, params), targets_bt,
                            softcap=cfg.final_logit_softcap, time_chunk=chunks.time,
                            vocab_chunk=chunks.vocab if vocab_chunk is None else vocab_chunk)
    logp = jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp], axis=1)
    top1 = jnp.concatenate([jnp.zeros_like(top1[:, :1]), top1], axis=1)
    return (logp, top1, jax.lax.stop_gradient(h_btd)) if return_hidden else (logp, top1)


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
           remat: bool = False, unroll: bool = False, segment_ids_bt=None):
    """Per-token values V(s_t) [B, T] f32: a linear head on the final hidden state at t."""
    h_btd, _ = hidden_states(cfg, value_params, tokens_bt, positions_bt, attn_mask_bt, remat=remat,
                             unroll=unroll, segment_ids_bt=segment_ids_bt)
    v = jnp.einsum("btd,d->bt", h_btd.astype(jnp.float32), value_params["value_head"].astype(jnp.float32))
    return v + value_params["value_bias"].astype(jnp.float32)
