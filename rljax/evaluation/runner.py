"""Held-out evaluation: greedy accuracy, unbiased pass@k and mean@k over seeds.

Prompts are rendered and tokenised once by `rljax.data.encode_prompts` (a prompt longer than
`max_prompt_len` is dropped and counted in `EvalSetup.num_too_long`, as in training), and padded
to one shape; the eval set is split into equal batches (the last one topped up with repeats that
are not counted), so evaluation compiles once. Correctness is the reward's `correct` part (1.0
means solved). Greedy and sampled evaluation derive their controls from the setup's one
`SampleControls` (`greedy_version`, `replace`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rljax.data.example import Example, verifier_metadata
from rljax.data.templates import PromptFormat, encode_prompts
from rljax.evaluation.metrics import mean_pass_at_k, mean_with_ci
from rljax.rewards import AUDIT_PART, RewardFn
from rljax.sampling import SampleControls
from rljax.sampling.vision import generate_prompts
from rljax.tokenizers import pad_batch


@dataclasses.dataclass(frozen=True)
class EvalSetup:
    """A held-out set ready for the sampler: padded prompt tokens plus what verifiers read.

    `examples` are the problems whose prompts fit; `num_too_long` more were dropped for encoding
    to more than `max_prompt_len` tokens. `controls` has the tokenizer's EOS and pad ids filled.
    `images`: the host step that gives a batch of prompts its pictures
    (`rljax.data.prompt_images.ImagePrompter`; None: text prompts).
    """

    model_cfg: Any
    examples: tuple[Example, ...]
    tokens_bt: np.ndarray
    mask_bt: np.ndarray
    metadata: tuple[dict, ...]
    tokenizer: Any
    reward_fn: RewardFn
    controls: SampleControls
    batch_size: int
    num_too_long: int = 0
    images: Any = None

    @classmethod
    def build(cls, model_cfg, examples: Sequence[Example], tokenizer, fmt: PromptFormat, reward_fn: RewardFn,
              controls: SampleControls, *, max_prompt_len: int, add_bos: bool = True, batch_size: int = 200,
              images=None):
        encoded = encode_prompts(examples, tokenizer, fmt, max_prompt_len=max_prompt_len, add_bos=add_bos)
        tokens, mask = pad_batch(encoded.ids, tokenizer.pad_id, side="left", bucket=16)
        return cls(model_cfg, encoded.examples, tokens, mask, tuple(verifier_metadata(e) for e in encoded.examples),
                   tokenizer, reward_fn, controls.with_tokenizer(tokenizer),
                   min(batch_size, max(len(encoded.examples), 1)), encoded.num_too_long, images)

    def prompts(self, idx) -> tuple[np.ndarray, np.ndarray, Any]:
        """(tokens, mask, their `PromptImages` or None) of problems `idx`."""
        tokens, mask = self.tokens_bt[idx], self.mask_bt[idx]
        if self.images is None:
            return tokens, mask, None
        return self.images([self.examples[i] for i in idx], tokens, mask)

    def batches(self):
        n, b = len(self.examples), self.batch_size
        for start in range(0, n, b):
            idx = np.arange(start, start + b) % n
            yield idx, min(b, n - start)


def _judged(setup: EvalSetup, params, idx, controls: SampleControls, key) -> dict[str, np.ndarray]:
    """``{"correct": [len(idx), n] bool}``: whether each of the n completions of problems `idx` is
    correct, plus ``"audit"``, the stricter check's verdict, when the reward has an audit part."""
    n = controls.num_samples
    tokens, mask, images = setup.prompts(idx)
    out = generate_prompts(setup.model_cfg, params, tokens, mask, key=key, controls=controls, images=images)
    tokens, mask = jax.device_get((out.tokens, out.mask))
    texts = setup.tokenizer.decode_batch([row[m].tolist() for row, m in zip(tokens, mask)])
    rows = np.repeat(idx, n)
    rewards, _ = setup.reward_fn.batch([setup.metadata[i] for i in rows], texts, num_tokens=mask.sum(1))
    parts = {"correct": rewards.parts.get("correct", rewards.total_b)}
    if AUDIT_PART in rewards.parts:
        parts[AUDIT_PART] = rewards.parts[AUDIT_PART]
    return {k: (np.asarray(v) >= 1.0).reshape(len(idx), n) for k, v in parts.items()}


def _correct(setup: EvalSetup, params, idx, controls: SampleControls, key) -> np.ndarray:
    """[len(idx), n] bool: whether each of the n completions of problems `idx` is correct."""
    return _judged(setup, params, idx, controls, key)["correct"]


def greedy_judged(setup: EvalSetup, params) -> dict[str, np.ndarray]:
    """``{"correct": bool [len(setup.examples)]}`` for each held-out problem's greedy completion,
    plus ``"audit"`` (the stricter check) when the reward has one."""
    if not setup.examples:
        return {"correct": np.zeros(0, bool)}
    controls = setup.controls.greedy_version()
    tables = [_judged(setup, params, idx, controls, jax.random.key(0)) for idx, _ in setup.batches()]
    reals = [real for _, real in setup.batches()]
    return {k: np.concatenate([t[k][:real, 0] for t, real in zip(tables, reals)]) for k in tables[0]}


def greedy_solved(setup: EvalSetup, params) -> np.ndarray:
    """bool ``[len(setup.examples)]``: whether each held-out problem's greedy completion is correct."""
    return greedy_judged(setup, params)["correct"]


def greedy_accuracy(setup: EvalSetup, params) -> float:
    """Fraction of held-out problems solved by the greedy completion (NaN for an empty set)."""
    solved = greedy_solved(setup, params)
    return float(np.mean(solved)) if solved.size else float("nan")


def accuracy_by_task(setup: EvalSetup, solved: np.ndarray) -> dict[str, float]:
    """``{task: accuracy}`` over the examples that carry a task name (a mixture's held-out split),
    from `greedy_solved`'s table: ``bincount(task, solved) / bincount(task)``."""
    names = sorted({e.task for e in setup.examples if e.task is not None})
    if not names:
        return {}
    task_b = np.array([names.index(e.task) if e.task is not None else -1 for e in setup.examples])
    have = task_b >= 0
    count = np.bincount(task_b[have], minlength=len(names))
    hits = np.bincount(task_b[have], weights=solved[have].astype(np.float64), minlength=len(names))
    return {name: float(hits[j] / count[j]) for j, name in enumerate(names) if count[j]}


def sampled_eval(setup: EvalSetup, params, *, num_samples: int, ks: Sequence[int], seeds: int,
                 temperature: float = 1.0) -> dict[str, float]:
    """pass@k (Chen et al., 2021) for each k, and mean@n over `seeds` with a 95% interval.

    Each seed draws `num_samples` completions per problem with the setup's controls at
    `temperature`. mean@n is the fraction correct over all of a seed's completions, averaged over
    seeds with a Student-t interval (`mean_with_ci`); pass@k is the unbiased estimate from the n
    completions of each problem, averaged over problems, then over seeds.
    """
    if not setup.examples:
        return {f"mean@{num_samples}": float("nan"), **{f"pass@{k}": float("nan") for k in ks}}
    controls = setup.controls.replace(num_samples=num_samples, temperature=temperature, greedy=False)
    per_seed_acc, per_seed_pass = [], {k: [] for k in ks}
    for seed in range(seeds):
        key = jax.random.key(seed)
        table = np.concatenate([_correct(setup, params, idx, controls, jax.random.fold_in(key, int(idx[0])))[:real]
                                for idx, real in setup.batches()])
        per_seed_acc.append(table.mean())
        for k in ks:
            per_seed_pass[k].append(mean_pass_at_k(table, k))
    out = {}
    mean, lo, hi = mean_with_ci(np.asarray(per_seed_acc))
    out.update({f"mean@{num_samples}": mean, f"mean@{num_samples}/ci_low": lo, f"mean@{num_samples}/ci_high": hi})
    for k in ks:
        out[f"pass@{k}"] = float(np.mean(per_seed_pass[k]))
    return out
