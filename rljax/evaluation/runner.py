"""Held-out evaluation: greedy accuracy, unbiased pass@k and mean@k over seeds.

Prompts are tokenised once and padded to one shape; the eval set is split into equal batches
(the last one topped up with repeats that are not counted), so evaluation compiles once.
Correctness is the reward's `correct` part (1.0 means solved).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rljax.data.example import Example
from rljax.data.templates import PromptFormat, render_prompt
from rljax.evaluation.metrics import mean_pass_at_k, mean_with_ci
from rljax.rewards import RewardFn
from rljax.sampling import SampleControls, generate
from rljax.tokenizers import pad_batch


@dataclasses.dataclass(frozen=True)
class EvalSetup:
    """A held-out set ready for the sampler: padded prompt tokens plus what verifiers read."""

    model_cfg: Any
    examples: tuple[Example, ...]
    tokens_bt: np.ndarray
    mask_bt: np.ndarray
    metadata: tuple[dict, ...]
    tokenizer: Any
    reward_fn: RewardFn
    controls: SampleControls
    batch_size: int

    @classmethod
    def build(cls, model_cfg, examples: Sequence[Example], tokenizer, fmt: PromptFormat, reward_fn: RewardFn,
              controls: SampleControls, *, max_prompt_len: int, add_bos: bool = True, batch_size: int = 200):
        from rljax.train.setup import verifier_metadata

        ids = tokenizer.encode_batch([render_prompt(e, fmt, tokenizer) for e in examples], add_bos=add_bos)
        ids = [i[-max_prompt_len:] for i in ids]
        tokens, mask = pad_batch(ids, tokenizer.pad_id, side="left", bucket=16)
        return cls(model_cfg, tuple(examples), tokens, mask, tuple(verifier_metadata(e) for e in examples), tokenizer,
                   reward_fn, controls, min(batch_size, max(len(examples), 1)))

    def batches(self):
        n, b = len(self.examples), self.batch_size
        for start in range(0, n, b):
            idx = np.arange(start, start + b) % n
            yield idx, min(b, n - start)


def _correct(setup: EvalSetup, tokens, mask, idx) -> np.ndarray:
    texts = setup.tokenizer.decode_batch([row[m].tolist() for row, m in zip(tokens, mask)])
    rewards, _ = setup.reward_fn.batch([setup.metadata[i] for i in idx], texts, num_tokens=mask.sum(1))
    part = rewards.parts.get("correct", rewards.total_b)
    return np.asarray(part) >= 1.0


def greedy_accuracy(setup: EvalSetup, params) -> float:
    """Fraction of held-out problems solved by the greedy completion."""
    if not setup.examples:
        return float("nan")
    cfg = setup.controls
    solved = []
    for idx, real in setup.batches():
        out = generate(setup.model_cfg, params, setup.tokens_bt[idx], setup.mask_bt[idx],
                       key=jax.random.key(0), max_new_tokens=cfg.max_new_tokens, greedy=True,
                       eos_ids=cfg.eos_ids, pad_id=cfg.pad_id)
        tokens, mask = jax.device_get((out.tokens, out.mask))
        solved.append(_correct(setup, tokens, mask, idx)[:real])
    return float(np.mean(np.concatenate(solved)))


def sampled_eval(setup: EvalSetup, params, *, num_samples: int, ks: Sequence[int], seeds: int,
                 temperature: float = 1.0) -> dict[str, float]:
    """pass@k (Chen et al., 2021) for each k, and mean@k over `seeds` with a 95% interval."""
    cfg = setup.controls
    per_seed_acc, per_seed_pass = [], {k: [] for k in ks}
    for seed in range(seeds):
        correct = []
        for idx, real in setup.batches():
            out = generate(setup.model_cfg, params, setup.tokens_bt[idx], setup.mask_bt[idx],
                           key=jax.random.fold_in(jax.random.key(seed), int(idx[0])),
                           max_new_tokens=cfg.max_new_tokens, num_samples=num_samples, temperature=temperature,
                           top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p, eos_ids=cfg.eos_ids,
                           pad_id=cfg.pad_id)
            tokens, mask = jax.device_get((out.tokens, out.mask))
            ok = _correct(setup, tokens, mask, np.repeat(idx, num_samples)).reshape(len(idx), num_samples)
            correct.append(ok[:real])
        table = np.concatenate(correct)
        per_seed_acc.append(table.mean())
        for k in ks:
            per_seed_pass[k].append(mean_pass_at_k(table, k))
    out = {}
    mean, lo, hi = mean_with_ci(np.asarray(per_seed_acc))
    out.update({f"mean@{num_samples}": mean, f"mean@{num_samples}/ci_low": lo, f"mean@{num_samples}/ci_high": hi})
    for k in ks:
        out[f"pass@{k}"] = float(np.mean(per_seed_pass[k]))
    return out
