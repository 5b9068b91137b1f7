"""Held-out splits that training never sees, keyed on normalised question text.

A generator or a file can repeat a question under different ids (reasoning-gym draws problems
at random; scraped sets have near-duplicates). Splitting by row would leak those repeats into
training, so both functions here compare `question_key`s instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rljax.data.example import Example, question_key
from rljax.errors import DataError


def drop_overlap(train: Sequence[Example], held_out: Sequence[Example]) -> tuple[tuple[Example, ...], int]:
    """Training examples whose normalised question is not in `held_out`, and how many were dropped.

    Use it when train and eval come from separate sources (two reasoning-gym seeds, a train
    file and a test file): the eval set is kept whole and training loses the overlap.
    """
    banned = {question_key(ex) for ex in held_out}
    kept = tuple(ex for ex in train if question_key(ex) not in banned)
    return kept, len(train) - len(kept)


def heldout_split(examples: Sequence[Example], eval_size: int, seed: int = 0
                  ) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """Split one pool into (train, eval) so that no eval question appears in train.

    The pool is permuted by `seed`; eval takes the first `eval_size` distinct questions in that
    order; train keeps, in the original order, every example whose question is not among them.
    Raises `DataError` if the pool has fewer than `eval_size` distinct questions.
    """
    if eval_size < 0:
        raise DataError(f"eval_size={eval_size} must be >= 0")
    order = np.random.default_rng(seed).permutation(len(examples))
    eval_keys, held = set(), []
    for i in order:
        if len(held) == eval_size:
            break
        key = question_key(examples[i])
        if key not in eval_keys:
            eval_keys.add(key)
            held.append(examples[i])
    if len(held) < eval_size:
        raise DataError(f"only {len(held)} distinct questions for eval_size={eval_size}; "
                        "generate more examples or lower the eval size")
    train = tuple(ex for ex in examples if question_key(ex) not in eval_keys)
    return train, tuple(held)
