"""Attention over the paged KV layout (`rljax.sampling.paged`), by backend: the CPU/GPU step
gathers each slot's pages into the slot layout's arrangement and runs the model's cached forward
(`gather_forward`); the TPU step attends over the pages in place with JAX's Pallas paged kernel
(`kernel_forward`, `tpu_paged_attention`). `use_pallas_kernel` picks one; the module docstring of
`rljax.sampling.paged` says when and why."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.models import ModelConfig, cache_slot_axes, forward, to_cache_layout
from rljax.models.fp8 import KV_SCALES, is_fp8_cache
from rljax.sampling.controls import StaticControls
from rljax.sampling.decode import step_forward
from rljax.sampling.paged_table import PageTable


def gather_view(cfg: ModelConfig, kv, pt: PageTable, next_pos_s, prompt_len: int, width: int, page_size: int):
    """The slot layout's cache rebuilt from the pages: per layer keys and values in the cache's
    layout (`rljax.models.to_cache_layout`: k [S, K, H, W] or [S, K, W, H], v [S, K, W, H]) and
    key positions [S, W], with the prompt's real tokens at [P - len, P) and the generated tokens
    from P (positions -1 elsewhere), and each slot's write index P + generated tokens."""
    j = jnp.arange(width)[None, :]
    plen_s = pt.prompt_len_s[:, None]
    logical_sw = jnp.where(j < prompt_len, j - (prompt_len - plen_s), plen_s + j - prompt_len)
    valid_sw = (logical_sw >= 0) & (logical_sw < next_pos_s[:, None])
    logical_sw = jnp.clip(logical_sw, 0, pt.table_sk.shape[1] * page_size - 1)
    page_sw = jnp.take_along_axis(pt.table_sk, logical_sw // page_size, axis=1)
    offset_sw = logical_sw % page_size
    swkh = lambda pages: pages[:, page_sw, offset_sw, :].transpose(1, 2, 0, 3)  # noqa: E731
    # An FP8 pool's scales [K, pages, page, 1] gather like their values ([S, K, 1, W] or [S, K, W, 1]).
    pairs = (("k", "v"),) + ((tuple(KV_SCALES.values()),) if is_fp8_cache(kv[0]) else ())
    layers = tuple({name: x for pair in pairs
                    for name, x in zip(pair, to_cache_layout(cfg, swkh(lkv[pair[0]]), swkh(lkv[pair[1]])))}
                   for lkv in kv)
    index_s = prompt_len + next_pos_s - pt.prompt_len_s
    return {"layers": layers, "pos": jnp.where(valid_sw, logical_sw, -1), "index": index_s}


def use_pallas_kernel(cfg: ModelConfig, spec: StaticControls) -> bool:
    """Whether the decode step attends with the Pallas kernel: on TPU, for models without sliding
    windows (the kernel has none), outside batch-invariant mode (which maps rows one at a time),
    over compute-dtype pages (the TPU kernel reads no scales: FP8 pages take the gather step)."""
    return (jax.default_backend() == "tpu" and not any(cfg.layer_windows()) and not spec.batch_invariant
            and spec.kv_dtype == "model")


def fed_slot(pt: PageTable, positions_s, live_s, page_size: int, num_pages: int):
    """(page, offset) of each fed token; idle slots get page `num_pages`, which writes drop."""
    page_s = jnp.take_along_axis(pt.table_sk, (positions_s // page_size)[:, None], axis=1)[:, 0]
    return jnp.where(live_s, page_s, num_pages), positions_s % page_size


def gather_forward(cfg: ModelConfig, layer_params, tokens_s, positions_s, live_s, kv, pt: PageTable, rope_cos_sin,
                   *, prompt_len: int, width: int, page_size: int, num_pages: int, batch_invariant: bool,
                   record_routes: bool = False):
    """The CPU/GPU decode step: logits [S, V] through the model's cached forward on the gathered
    view (`gather_view`), and the pages with the fed tokens' keys and values written; with
    `record_routes`, also the fed tokens' experts per layer [S, L, k]."""
    view = gather_view(cfg, kv, pt, positions_s, prompt_len, width, page_size)
    logits_sv, new, *routes = step_forward(cfg, layer_params, tokens_s, positions_s, live_s, view, rope_cos_sin,
                                           batch_invariant=batch_invariant, record_routes=record_routes)
    at_s = view["index"]
    page_s, offset_s = fed_slot(pt, positions_s, live_s, page_size, num_pages)

    def write(pages, dense, axis):  # the fed token's [S, K, H] (FP8: values, and [S, K, 1] scales) into its page
        fed = jnp.take_along_axis(dense, jnp.expand_dims(at_s, (1, 2, 3)), axis=axis)
        return pages.at[:, page_s, offset_s, :].set(jnp.squeeze(fed, axis).transpose(1, 0, 2), mode="drop")

    axes = cache_slot_axes(cfg)
    return (logits_sv, tuple({name: write(lkv[name], lnew[name], axes[name]) for name in lkv}
                             for lkv, lnew in zip(kv, new["layers"])), *routes)


def kernel_forward(cfg: ModelConfig, layer_params, tokens_s, positions_s, live_s, kv, pt: PageTable, rope_cos_sin,
                   *, page_size: int, num_pages: int):
    """The TPU decode step: each layer writes the fed token's keys and values into its page and
    attends over the pages in place with `tpu_paged_attention` (keys [0, position] of each row)."""
    page_s, offset_s = fed_slot(pt, positions_s, live_s, page_size, num_pages)
    lengths_s = jnp.where(live_s, positions_s + 1, 0)

    def attend(lkv, window, positions_bt, q, k, v):
        put = lambda pages, x: pages.at[:, page_s, offset_s, :].set(
            x[:, 0].transpose(1, 0, 2).astype(pages.dtype), mode="drop")
        new = {"k": put(lkv["k"], k), "v": put(lkv["v"], v)}
        out_snh = tpu_paged_attention(q[:, 0], new["k"].astype(q.dtype), new["v"].astype(q.dtype), lengths_s,
                                      pt.table_sk, cfg)
        return out_snh[:, None].astype(jnp.float32), new

    logits_s1v, kv = forward(cfg, layer_params, tokens_s[:, None], positions_s[:, None], live_s[:, None], kv,
                             rope_cos_sin=rope_cos_sin, kv_attend=attend)
    return logits_s1v[:, 0], kv


def tpu_paged_attention(q_bnh, k_pages, v_pages, lengths_b, table_bk, cfg: ModelConfig, *,
                        pages_per_block: int = 1):
    """One decode query per row attending over its pages with JAX's Pallas TPU kernel: q [B, N, H]
    (unscaled), pages [K, pages, page, H], lengths [B] valid keys, table [B, pages per row].
    Full attention over the first `length` keys (no sliding window), soft cap as the model's."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    q = (q_bnh.astype(jnp.float32) * cfg.query_scale).astype(q_bnh.dtype)
    return paged_attention(q, k_pages, v_pages, lengths_b.astype(jnp.int32), table_bk.astype(jnp.int32),
                           attn_logits_soft_cap=cfg.attn_logit_softcap, pages_per_compute_block=pages_per_block)
