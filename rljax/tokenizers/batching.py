"""Pad ragged id lists into static-shape arrays for jitted samplers and losses."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rljax.errors import ConfigError, DataError


def bucket_length(longest: int, bucket: int) -> int:
    """The padded length for `longest` tokens: the next power of two >= longest, at least `bucket`.

    Powers of two keep the set of shapes (and so of XLA compilations) logarithmic in the
    longest prompt; `bucket` is the smallest shape used.
    """
    if bucket < 1:
        raise ConfigError(f"bucket must be a positive length, got {bucket}")
    return max(bucket, 1 << max(longest - 1, 0).bit_length())


def pad_batch(
    batch_ids: Sequence[Sequence[int]],
    pad_id: int,
    *,
    side: str = "left",
    length: int | None = None,
    bucket: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Stack id lists into `(tokens_bt int32, mask_bt bool)`, padding with `pad_id`.

    T is `length` when given (an error if a row is longer), else `bucket_length(longest, bucket)`
    when `bucket` is given, else the longest row. `side="left"` puts padding first, so prompts end
    together and generation appends at one column (what `rljax.sampling.generate` expects);
    `side="right"` puts it last. mask_bt is True on real tokens.
    """
    if side not in ("left", "right"):
        raise ConfigError(f"pad side must be 'left' or 'right', got {side!r}")
    if length is not None and bucket is not None:
        raise ConfigError("pass either length= or bucket= to pad_batch, not both")
    rows = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in batch_ids]
    longest = max((len(r) for r in rows), default=0)
    if length is not None:
        if longest > length:
            raise DataError(
                f"a sequence of {longest} tokens does not fit length={length}; raise it or truncate"
            )
        t = length
    elif bucket is not None:
        t = bucket_length(longest, bucket)
    else:
        t = longest
    tokens_bt = np.full((len(rows), t), pad_id, dtype=np.int32)
    mask_bt = np.zeros((len(rows), t), dtype=bool)
    for b, row in enumerate(rows):
        n = len(row)
        cols = slice(t - n, t) if side == "left" else slice(0, n)
        tokens_bt[b, cols] = row
        mask_bt[b, cols] = True
    return tokens_bt, mask_bt
