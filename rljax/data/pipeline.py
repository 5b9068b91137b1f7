"""The grain pipeline: seeded shuffling, process sharding, fixed-size batches, exact resume.

    step k -> (epoch e, batch j) -> rows j*B..(j+1)*B of grain's shuffle of epoch e
           -> this process's slice -> PromptBatch

An epoch is a permutation of the N examples (grain's `shuffle` seeds epoch e with seed + e)
cut into floor(N / B) global batches; the N mod B leftovers differ from epoch to epoch, and no
batch holds an example twice. Every process builds the same global batches of example indices
and keeps its own contiguous slice of each, so the processes partition every batch disjointly
and their union is exactly the single-process batch. The iterator's
``get_state()``/``set_state()`` (a small JSON dict) is what goes into the checkpoint; setting
it on a fresh iterator continues with exactly the next batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rljax.data.example import Example
from rljax.data.templates import PromptFormat, PromptTokenizer, encode_prompts, pick_bucket
from rljax.errors import ConfigError, DataError

if TYPE_CHECKING:  # imported where a dataset is built: the compiled stages import this module without grain
    import grain
from rljax.tokenizers import pad_batch


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """One process's prompts for one step.

    tokens_bt: int32 ``[B, T]`` left-padded prompt tokens, ``T`` one of the buckets.
    mask_bt: bool ``[B, T]``, True on real tokens.
    indices_b: int64 ``[B]`` positions of the rows in `PromptData.examples`.
    examples: the `Example` of each row (answers and tests for the verifiers).
    images: the rows' `rljax.data.prompt_images.PromptImages` (their placeholders are in
    ``tokens_bt``), or None for text prompts.
    """

    tokens_bt: np.ndarray
    mask_bt: np.ndarray
    indices_b: np.ndarray
    examples: tuple[Example, ...]
    images: Any = None


@dataclasses.dataclass(frozen=True)
class PromptData:
    """A ready pipeline: `dataset` yields `PromptBatch`es; `iter(dataset)` has get/set_state."""

    dataset: grain.MapDataset
    examples: tuple[Example, ...]
    num_too_long: int
    local_batch_size: int


def shard_rows(global_batch_size: int, process_index: int, process_count: int) -> slice:
    """The contiguous rows of a global batch that belong to one process."""
    if not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} must be in [0, {process_count})")
    if global_batch_size % process_count:
        raise ConfigError(f"batch size {global_batch_size} must be divisible by the "
                          f"{process_count} processes")
    per = global_batch_size // process_count
    return slice(process_index * per, (process_index + 1) * per)


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        return jax.process_index(), jax.process_count()
    return process_index, process_count


def index_batches(num_examples: int, global_batch_size: int, *, seed: int, shuffle: bool = True,
                  num_epochs: int | None = None, process_index: int | None = None,
                  process_count: int | None = None) -> grain.MapDataset:
    """A grain dataset of this process's example indices, int64 ``[global_batch_size // P]``.

    `num_epochs=None` repeats forever. Each epoch drops its N mod B leftovers so every batch has
    the same static shape. Process defaults: `jax.process_index()/process_count()`.
    """
    import grain

    if num_examples < 1:
        raise DataError("the training set is empty; check the data source and its filters")
    if global_batch_size < 1:
        raise ConfigError(f"batch size {global_batch_size} must be >= 1")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"data seed {seed} must be in [0, 2**32)")
    rows = shard_rows(global_batch_size, *_process(process_index, process_count))
    per_epoch = num_examples // global_batch_size
    if per_epoch == 0:
        raise DataError(f"{num_examples} examples cannot fill one batch of {global_batch_size}; "
                        "add data or lower the batch size")
    order = grain.MapDataset.range(num_examples)
    if shuffle:
        order = order.shuffle(seed=seed)  # order[e * N + i] is item i of epoch e's permutation

    def batch_indices(step: int, _) -> np.ndarray:
        epoch, j = divmod(step, per_epoch)
        start = epoch * num_examples + j * global_batch_size
        return np.asarray([order[start + i] for i in range(rows.start, rows.stop)], np.int64)

    return grain.MapDataset.range(per_epoch).repeat(num_epochs).map_with_index(batch_indices)


def prompt_batches(examples: Sequence[Example], *, tokenizer: PromptTokenizer, batch_size: int, seed: int,
                   max_prompt_len: int, fmt: PromptFormat = PromptFormat(), buckets: Sequence[int] | None = None,
                   add_bos: bool = False, shuffle: bool = True, num_epochs: int | None = None,
                   process_index: int | None = None, process_count: int | None = None,
                   images: Callable[[PromptBatch], PromptBatch] | None = None) -> PromptData:
    """Render and tokenise every prompt once (`encode_prompts`: a prompt over `max_prompt_len`
    tokens is dropped, never cut), then batch the rest. `images`: the host step that gives each
    batch its pictures (`rljax.data.prompt_images.ImagePrompter.add_to`; None: text prompts).

    `batch_size` is global (all processes together). Prompts are left-padded to the smallest of
    `buckets` (default: just `max_prompt_len`) that fits the batch's longest prompt. Dropped
    over-long prompts are counted in `PromptData.num_too_long`.
    """
    buckets = tuple(sorted(buckets or (max_prompt_len,)))
    if buckets[-1] > max_prompt_len:
        raise ConfigError(f"bucket {buckets[-1]} exceeds max_prompt_len={max_prompt_len}")
    encoded = encode_prompts(examples, tokenizer, fmt, max_prompt_len=max_prompt_len, add_bos=add_bos)
    kept_examples, kept_ids = encoded.examples, encoded.ids
    index_ds = index_batches(len(kept_examples), batch_size, seed=seed, shuffle=shuffle, num_epochs=num_epochs,
                             process_index=process_index, process_count=process_count)
    pad_id = tokenizer.pad_id

    def to_batch(idx_b: np.ndarray) -> PromptBatch:
        rows = [kept_ids[i] for i in idx_b]
        width = pick_bucket(max(len(r) for r in rows), buckets)
        tokens_bt, mask_bt = pad_batch(rows, pad_id, side="left", length=width)
        batch = PromptBatch(tokens_bt, mask_bt, idx_b, tuple(kept_examples[i] for i in idx_b))
        return batch if images is None else images(batch)

    local = batch_size // _process(process_index, process_count)[1]
    return PromptData(index_ds.map(to_batch), kept_examples, encoded.num_too_long, local)
