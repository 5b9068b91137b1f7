"""`rljax train-rm`: a Bradley-Terry outcome reward model trained on preference pairs.

    pairs.jsonl: {"prompt": "42 - 25 =", "chosen": "17", "rejected": "19", "margin": 1.0?}

Each pair becomes two rows laid out as a rollout lays them out (BOS + prompt, then the response
and EOS, left-padded), scored by the backbone and a `score` head at the row's last real token
(`rljax.models.heads.sequence_scores`). The loss is the Bradley-Terry pairwise logistic loss
(Bradley & Terry, 1952; InstructGPT, Ouyang et al., 2022), with Llama 2's optional margin
(Touvron et al., 2023) read from each pair's `margin` when `margin = true`:

    L = -mean_pairs log sigmoid(r(x, y_chosen) - r(x, y_rejected) - m)

The model starts from a causal LM checkpoint (`base`: its backbone, a fresh head) or a random
Qwen2-style model sized by `[model]`. Held-out pair accuracy (the share of held-out pairs scored
chosen > rejected) is measured every `eval_every` steps, and the result is written as a Hugging
Face `*ForSequenceClassification` directory with the tokenizer, which transformers and
`[reward] model = {checkpoint = ...}` load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax.models.setup import build_policy, build_tokenizer, policy_config
from rljax.config_io import bounded
from rljax.errors import ConfigError
from rljax.models import init_params, save_hf
from rljax.models.heads import sequence_scores
from rljax.models.setup import ModelSection


@dataclasses.dataclass(frozen=True)
class RewardTrainConfig:
    """`rljax train-rm`'s settings (key=value on the command line)."""

    pairs: str | None = None
    eval_pairs: str | None = None  # default: the last `eval_size` pairs of `pairs`
    eval_size: int = bounded(200, ge=0)
    output_dir: str = "runs/reward_model"
    base: str | None = None  # a causal LM checkpoint whose backbone (and tokenizer) start the reward model
    model: ModelSection = ModelSection(tokenizer="chars:0123456789+-= ")  # the from-scratch model and tokenizer
    add_bos: bool = True
    max_tokens: int = bounded(64, ge=2)
    steps: int = bounded(500, ge=1)
    batch_size: int = bounded(64, ge=1)
    learning_rate: float = bounded(1e-3, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    warmup_steps: int = bounded(20, ge=0)
    margin: bool = False
    eval_every: int = bounded(100, ge=1)
    seed: int = bounded(0, ge=0)


@dataclasses.dataclass(frozen=True)
class PairBatch:
    """Pairs as [2N, T] rows, chosen rows first (0..N-1), then rejected; margins [N]."""

    tokens: np.ndarray
    mask: np.ndarray
    margins: np.ndarray

    def take(self, index: np.ndarray) -> PairBatch:
        n = len(self.margins)
        rows = np.concatenate([index, index + n])
        return PairBatch(self.tokens[rows], self.mask[rows], self.margins[index])


def read_pairs(path: str | Path, *, use_margin: bool) -> list[dict[str, Any]]:
    """The JSONL pairs; a row without prompt, chosen and rejected strings is one line naming it."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [k for k in ("prompt", "chosen", "rejected") if not isinstance(row.get(k), str)]
        if missing:
            raise ConfigError(f"{path} line {i + 1}: a preference pair needs string fields prompt, chosen and "
                              f"rejected (missing {', '.join(missing)})")
        if use_margin and not isinstance(row.get("margin"), (int, float)):
            raise ConfigError(f"{path} line {i + 1}: margin=true reads each pair's numeric 'margin'; add it or set "
                              "margin=false")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no preference pairs")
    return rows


def encode_pairs(rows, tokenizer, *, max_tokens: int, add_bos: bool, use_margin: bool) -> PairBatch:
    """BOS + prompt + response + EOS per row, left-padded to the longest row (at most
    `max_tokens`; longer pairs are one error line)."""
    bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    eos = list(tokenizer.eos_ids[:1])
    prompts = tokenizer.encode_batch([r["prompt"] for r in rows])
    seqs = []
    for key in ("chosen", "rejected"):
        for p, r in zip(prompts, tokenizer.encode_batch([r[key] for r in rows])):
            seqs.append(bos + list(p) + list(r) + eos)
    width = max(len(s) for s in seqs)
    if width > max_tokens:
        raise ConfigError(f"a preference pair is {width} tokens long, over max_tokens={max_tokens}; raise max_tokens")
    tokens = np.full((len(seqs), width), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(seqs), width), bool)
    for i, s in enumerate(seqs):
        tokens[i, width - len(s):], mask[i, width - len(s):] = s, True
    margins = np.asarray([float(r.get("margin", 0.0)) if use_margin else 0.0 for r in rows], np.float32)
    return PairBatch(tokens, mask, margins)


def pairwise_loss(chosen_b, rejected_b, margin_b):
    """-mean log sigmoid(r_chosen - r_rejected - margin) and the pair accuracy (r_c > r_r)."""
    diff = chosen_b - rejected_b - margin_b
    return -jnp.mean(jax.nn.log_sigmoid(diff)), jnp.mean((chosen_b > rejected_b).astype(jnp.float32))


def init_reward_params(cfg, backbone: dict | None, key) -> dict:
    """Backbone (a causal LM's, or fresh) plus a `score` head [D, 1] drawn N(0, 1/(D + 1)), the
    scale TRL's reward-model head starts at."""
    params = dict(backbone if backbone is not None else init_params(cfg, key))
    params.pop("lm_head", None)
    std = 1.0 / math.sqrt(cfg.hidden_size + 1)
    params["score"] = (std * jax.random.normal(jax.random.fold_in(key, 1), (cfg.hidden_size, 1))).astype(
        params["embed"].dtype)
    return params


def train_reward_model(cfg: RewardTrainConfig, *, log=print) -> dict[str, Any]:
    """Trains, evaluates and exports the reward model; returns the summary written to
    `output_dir/summary.json` (held-out pair accuracy before and after, loss curve)."""
    from rljax.models import resolve_checkpoint

    if not cfg.pairs:
        raise ConfigError("rljax train-rm needs pairs=PATH (a JSONL of prompt, chosen, rejected)")
    # With a base model its own tokenizer serves; model.tokenizer is the from-scratch model's.
    section = dataclasses.replace(cfg.model, checkpoint=cfg.base, tokenizer=None) if cfg.base else cfg.model
    tokenizer = build_tokenizer(section)
    rows = read_pairs(cfg.pairs, use_margin=cfg.margin)
    held = read_pairs(cfg.eval_pairs, use_margin=cfg.margin) if cfg.eval_pairs else rows[len(rows) - cfg.eval_size:]
    train_rows = rows if cfg.eval_pairs else rows[:len(rows) - cfg.eval_size]
    if not train_rows or not held:
        raise ConfigError(f"{len(rows)} pairs leave none to train on or none held out; set eval_size below "
                          f"{len(rows)} or pass eval_pairs=PATH")
    enc = dict(tokenizer=tokenizer, max_tokens=cfg.max_tokens, add_bos=cfg.add_bos, use_margin=cfg.margin)
    train_set, eval_set = encode_pairs(train_rows, **enc), encode_pairs(held, **enc)
    key = jax.random.key(cfg.seed)
    if cfg.base:
        model_cfg, backbone = build_policy(section, tokenizer, key)
    else:
        model_cfg, backbone = policy_config(cfg.model, tokenizer), None
    params = init_reward_params(model_cfg, backbone, key)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), cfg.steps)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=cfg.weight_decay))
    opt_state = tx.init(params)

    def loss_fn(p, tokens, mask, margins):
        r = sequence_scores(model_cfg, p, tokens, mask)[:, 0]
        n = margins.shape[0]
        return pairwise_loss(r[:n], r[n:], margins)

    @jax.jit
    def step(p, o, tokens, mask, margins):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, tokens, mask, margins)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss, acc

    @jax.jit
    def evaluate(p, tokens, mask, margins):
        return loss_fn(p, tokens, mask, margins)

    def held_out(p):
        loss, acc = evaluate(p, jnp.asarray(eval_set.tokens), jnp.asarray(eval_set.mask), jnp.asarray(eval_set.margins))
        return float(loss), float(acc)

    rng = np.random.default_rng(cfg.seed)
    n = len(train_set.margins)
    batch = min(cfg.batch_size, n)
    loss0, acc0 = held_out(params)  # evaluated once, before training
    history = [{"step": 0, "eval/loss": loss0, "eval/pair_accuracy": acc0}]
    log(f"reward model {model_cfg.model_type}: {len(train_rows)} training pairs, {len(held)} held out | "
        f"held-out pair accuracy before training {history[0]['eval/pair_accuracy']:.3f}")
    t0, order = time.perf_counter(), rng.permutation(n)
    for i in range(cfg.steps):
        start = (i * batch) % n
        if start + batch > n:
            order, start = rng.permutation(n), 0
        b = train_set.take(order[start:start + batch])
        params, opt_state, loss, acc = step(params, opt_state, jnp.asarray(b.tokens), jnp.asarray(b.mask),
                                            jnp.asarray(b.margins))
        if (i + 1) % cfg.eval_every == 0 or i + 1 == cfg.steps:
            ev_loss, ev_acc = held_out(params)
            history.append({"step": i + 1, "train/loss": float(loss), "train/pair_accuracy": float(acc),
                            "eval/loss": ev_loss, "eval/pair_accuracy": ev_acc})
            log(f"step {i + 1}: loss {float(loss):.4f} | held-out loss {ev_loss:.4f}, pair accuracy {ev_acc:.3f}")
    out = Path(cfg.output_dir)
    arch = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
            "qwen3": "Qwen3ForSequenceClassification", "gemma": "GemmaForSequenceClassification",
            "gemma2": "Gemma2ForSequenceClassification"}[model_cfg.model_type]
    save_hf(model_cfg, jax.device_get(params), out, extra_config={"architectures": [arch], "num_labels": 1,
                                                                   "pad_token_id": tokenizer.pad_id})
    tokenizer.save(out)
    summary = {"pairs": len(train_rows), "held_out_pairs": len(held), "steps": cfg.steps,
               "seconds": round(time.perf_counter() - t0, 1), "before": history[0], "after": history[-1],
               "history": history, "base": cfg.base, "resolved_base": resolve_checkpoint(cfg.base) if cfg.base else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    log(f"reward model written to {out} (held-out pair accuracy {history[-1]['eval/pair_accuracy']:.3f})")
    return summary
