"""Classification heads on the transformer backbone, in Hugging Face's formats: the scores a
learned reward model gives.

- `*ForSequenceClassification` (a Bradley-Terry outcome reward model; Ouyang et al., 2022, as
  TRL's RewardTrainer, OpenRLHF and AReaL train it): the backbone's final hidden state at each
  row's last real token through a bias-free `score` Linear, [B, num_labels]; a reward model has
  one label.
- `*ForTokenClassification` (a process reward model, in the format TRL's PRMTrainer trains: the
  step labels sit at the step-separator tokens): the same head at every position, [B, T, L].

Params are the backbone's (`rljax.models.init_params` without `lm_head`) plus `score` [D, L]
(and `score_bias` [L]: transformers' token-classification head has a bias);
`rljax.models.load_hf(path, num_labels=L)` reads them and `save_hf` writes them back.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from rljax.errors import CheckpointError
from rljax.models.config import ModelConfig
from rljax.models.transformer import Params, hidden_states

HEAD_KINDS = {"ForSequenceClassification": "sequence", "ForTokenClassification": "token"}


def read_head(path: str | Path) -> tuple[str, int]:
    """(kind, num_labels) of a HF classification checkpoint, from its config.json's
    `architectures` and `num_labels` (or `id2label`): kind is "sequence" or "token". One line
    naming the architecture otherwise (e.g. a causal LM given as a reward model)."""
    hf = json.loads((Path(path) / "config.json").read_text())
    arch = (hf.get("architectures") or ["?"])[0]
    kind = next((k for suffix, k in HEAD_KINDS.items() if arch.endswith(suffix)), None)
    if kind is None:
        raise CheckpointError(f"{path} holds a {arch}, not a classification model; a reward model is a "
                              "*ForSequenceClassification (or *ForTokenClassification for process rewards) checkpoint")
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # transformers' default is 2
    return kind, int(labels)


def last_token_index(attn_mask_bt) -> jax.Array:
    """Each row's last real token (left or right padding), [B]; 0 for an empty row."""
    t = attn_mask_bt.shape[-1]
    return jnp.max(jnp.where(attn_mask_bt.astype(bool), jnp.arange(t)[None, :], 0), axis=-1)


def _head(params: Params, h):
    out = jax.lax.dot_general(h, params["score"].astype(h.dtype), (((h.ndim - 1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return out + params["score_bias"].astype(jnp.float32) if "score_bias" in params else out


def token_scores(cfg: ModelConfig, params: Params, tokens_bt, attn_mask_bt=None, *, remat: bool = False):
    """The head at every position, [B, T, L] f32 (a PRM's step logits at its separators)."""
    h_btd, _ = hidden_states(cfg, params, tokens_bt, None, attn_mask_bt, remat=remat)
    return _head(params, h_btd)


def sequence_scores(cfg: ModelConfig, params: Params, tokens_bt, attn_mask_bt, *, remat: bool = False):
    """The head at each row's last real token, [B, L] f32 (a reward model's score is label 0)."""
    h_btd, _ = hidden_states(cfg, params, tokens_bt, None, attn_mask_bt, remat=remat)
    last_b = last_token_index(attn_mask_bt)
    h_bd = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)[:, 0]
    return _head(params, h_bd)
