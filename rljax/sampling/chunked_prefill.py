"""Chunked prefill: a long prompt's forward pass in chunks of c tokens, each chunk writing its keys
and values into the prompt's KV cache before the next one reads them.

The one-pass prefill (`rljax.sampling.decode.prompt_forward` through `prefill_cache`) runs the
cache-free forward over all P prompt slots at once: every layer holds [B, P, D] activations, its
MLP's [B, P, F] and, where attention is not a fused kernel (the XLA reference on CPU), a
[B, N, P, P] score matrix. Chunked (vLLM's and Sarathi-Serve's chunked prefill, Agrawal et al.,
2024), chunk j = slots [j c, (j + 1) c) runs the model's cached forward
(`rljax.models.hidden_states` with a cache of P slots, write index j c): its queries attend to
the cache's keys at positions <= theirs, which the earlier chunks wrote, so a layer holds [B, c, D]
activations and [B, N, c, P] scores, c / P of the one-pass prefill's. The chunks run in a
`lax.scan` (one compiled chunk) plus, when c does not divide P, one shorter chunk.

What comes out is what `prompt_forward` returns: the P-slot cache (key positions -1 on padding,
index P) and the logits after each prompt's last real token, whose hidden state is kept from the
chunk that holds it. The values are the one-pass prefill's up to float reassociation (the cached
attention sums over P slots in chunks' order, the fused one over the row); the sampled tokens
and log-probs are equal within 1e-5 (f32) in `tests/sampling/test_chunked_prefill.py`.

`sampling.prefill_chunk = c` turns it on for prompts longer than c (0, the default: off).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.models import ModelConfig, default_positions, hidden_states, init_cache, logits_from_hidden


def chunked_prompt_forward(cfg: ModelConfig, params, prompt_bt, mask_bt, chunk: int):
    """(a KV cache of P slots, the logits after the last real token [B, V]) of B prompts [B, P]
    (any padding), computed `chunk` prompt slots at a time (see the module docstring)."""
    mask_bt = mask_bt.astype(bool)
    b, p = prompt_bt.shape
    positions_bt = default_positions(mask_bt)
    last_b = p - 1 - jnp.argmax(jnp.flip(mask_bt, axis=1), axis=1)  # last real token (any padding)

    def run(carry, start, width):
        cache, h_bd = carry
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, width, axis=1)
        h_bcd, cache = hidden_states(cfg, params, cut(prompt_bt), cut(positions_bt), cut(mask_bt), cache=cache)
        here_b = (last_b >= start) & (last_b < start + width)
        at_b = jnp.clip(last_b - start, 0, width - 1)
        h_last = jnp.take_along_axis(h_bcd, at_b[:, None, None], axis=1)[:, 0]
        return cache, jnp.where(here_b[:, None], h_last, h_bd)

    cache = init_cache(cfg, b, p)
    h_bd = jnp.zeros((b, cfg.hidden_size), cfg.compute_jnp_dtype)
    full = p // chunk
    carry, _ = jax.lax.scan(lambda c, j: (run(c, j * chunk, chunk), None), (cache, h_bd),
                            jnp.arange(full, dtype=jnp.int32))
    if p % chunk:
        carry = run(carry, full * chunk, p % chunk)
    cache, h_bd = carry
    return cache, logits_from_hidden(cfg, params, h_bd[:, None])[:, 0]
