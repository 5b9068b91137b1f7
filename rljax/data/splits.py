"""Held-out splits that training never sees, keyed on normalised question text.

A generator or a file can repeat a question under different ids (reasoning-gym draws problems
at random; scraped sets have near-duplicates). Splitting by row would leak those repeats into
training, so the functions here compare `question_key`s instead.
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


def warm_start_split(train_set: Sequence[Example], validation_size: int
                     ) -> tuple[Sequence[Example], tuple[Example, ...]]:
    """(SFT problems, validation problems): the first `validation_size` training problems are
    held out of the warm start's SFT set and validate it; () when it does not validate.

    Why: validated on problems it trains on, a small pool read as skill what was memorisation
    (issue 24: 46% on basic_arithmetic's 2,000-problem pool, repeated ~20 times, against 19.5% on
    held-out problems), so the target stopped the warm start early and `auto_curriculum`
    calibrated on inflated pass rates. A pool too small to spare them (fewer than twice
    `validation_size` problems) trains on all of them and validates on its front, as before.
    Copies of a validation question later in the pool (a small question space: products of two
    1-2 digit numbers has ~10k) are dropped from the SFT set too."""
    if not validation_size or len(train_set) < 2 * validation_size:
        return train_set, ()
    validation = tuple(train_set[:validation_size])
    return drop_overlap(train_set[validation_size:], validation)[0], validation
