"""Shared pieces of the MoE parity tests (tests/models/test_moe.py, test_moe_mixed.py): a
transformers MoE model's f32 logits and router logits on left-padded rows, the rows, and the
router initialisation that keeps top-k free of ties."""

from __future__ import annotations

import numpy as np
import torch


def unit_router(name: str, p) -> None:
    """`save_random_model`'s hook: routers at unit scale per logit (transformers' near-zero init
    would leave the top-k to ties)."""
    if name.endswith("mlp.gate.weight"):
        p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5 * 4)


def left_padded(rng, batch: int, length: int, vocab: int):
    """(tokens, mask) [batch, length]: row i left-padded by 3 i zeros."""
    tokens = rng.integers(1, vocab, (batch, length))
    mask = np.ones((batch, length), bool)
    for i in range(batch):
        tokens[i, :i * 3], mask[i, :i * 3] = 0, False
    return tokens, mask


def hf_logits_and_routers(model, tokens, mask):
    """(logits [B, T, V] f32, [router logits [B T, E] f32 per sparse layer]) of a transformers
    MoE model on left-padded rows, positions counted over the real tokens."""
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                    position_ids=torch.tensor(positions), output_router_logits=True)
    return out.logits.float().numpy(), [r.float().numpy() for r in out.router_logits]
