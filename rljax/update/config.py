"""How the update step runs: its batch schedule and its compile switches (the TOML `[update]`
section). What it optimises is `rljax.objectives.AlgorithmConfig`."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from rljax.config_io import bounded
from rljax.errors import ConfigError
from rljax.models import LogprobChunks, auto_chunk_size
from rljax.models.scoring import ACCELERATORS


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """The update step's schedule and compilation.

    Schedule: `num_epochs` passes over `num_minibatches` shuffled mini-batches (one optimiser step
    each), each split into `num_microbatches` whose gradients are accumulated.
    Compilation: `remat` recomputes layer activations in the backward pass (less memory, more
    compute): "none" (= false), "selective" (matmul outputs saved, elementwise work recomputed),
    "full" (= true), or "auto", which `rljax train` resolves before building the update to the
    fastest of the three that the memory plan fits on the device (`rljax.plan.remat`; on a CPU,
    whose memory is unknown, "none"); see `rljax.models.remat`. `unroll_layers` unrolls the
    layer scan of the trained forward (XLA can then fuse
    across layer boundaries and schedule each layer's matmuls on their own; compiles take longer;
    see `rljax.models.hidden_states` and BENCHMARKS.md). Unset, it is on for GPU and TPU and off
    on a CPU (`layers_unrolled`): a scanned forward saves its residuals as [L, ...] stacks that
    XLA zero-fills and copies whole once per micro-batch (12% of the H200 step in the trace that
    opened issue 35), where an unrolled one keeps each layer's own buffers; on a CPU the scan's
    shorter compile wins and the stacks cost little.
    Scoring: `logprob_chunk` is the time-chunk of the vocabulary projection (None: chosen from the
    shapes and the backend by `rljax.models.auto_chunk_size`, so a 150k vocabulary never holds
    [B, T, V]; a chunk is recomputed in the backward pass); `logprob_vocab_chunk` the ids per
    vocabulary chunk (None: automatic; on a CPU split only where one time chunk alone is over
    budget, on an accelerator every token in one chunk and the vocabulary in exact slices).
    `log_entropy` reports the policy entropy; with it off and `entropy_coef = 0` the entropy is
    not computed at all.
    Padding-free (`rljax.update.packing`): `packing` packs each mini-batch's rows end to end into
    buffers of `pack_length` tokens (default: the row width) and accumulates micro-batches of
    `max_tokens_per_microbatch` tokens, as many as the rows fill; `num_microbatches` stays 1.
    `num_microbatches = "auto"` is chosen with the remat mode before the update is built: the
    fewest micro-batches (a divisor of the mini-batch rows) the memory plan fits with the fastest
    mode (`rljax.plan.remat`; on a CPU, 1). It is "auto" only when set so: the default stays 1,
    and a number set is kept whatever `remat` is. With `packing`, `max_tokens_per_microbatch =
    "auto"` is the same choice in tokens: the largest budget of (mini-batch rows / m) buffers the
    plan fits, m the fewest micro-batches, as above.
    """

    num_epochs: int = bounded(1, ge=1)
    num_minibatches: int = bounded(1, ge=1)
    num_microbatches: int | Literal["auto"] = bounded(1, ge=1)
    remat: Literal["auto", "none", "selective", "full"] | bool = False
    unroll_layers: bool | None = None
    logprob_chunk: int | None = bounded(None, ge=1)
    logprob_vocab_chunk: int | None = bounded(None, ge=1)
    log_entropy: bool = True
    packing: bool = False
    pack_length: int | None = bounded(None, ge=1)
    max_tokens_per_microbatch: int | Literal["auto"] | None = bounded(None, ge=1)

    def __post_init__(self):
        for name in ("num_epochs", "num_minibatches", "num_microbatches"):
            if getattr(self, name) != "auto" and getattr(self, name) < 1:
                raise ConfigError(f"update.{name}={getattr(self, name)} must be >= 1")
        for name in ("logprob_chunk", "logprob_vocab_chunk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"update.{name}={getattr(self, name)} must be >= 1 (or unset: automatic)")
        if self.packing and self.num_microbatches == "auto":
            raise ConfigError("update.num_microbatches='auto' with update.packing: packed micro-batches are sized by "
                              "tokens; set update.max_tokens_per_microbatch='auto' (or a number), or update.packing=false")
        if self.max_tokens_per_microbatch == "auto" and not self.packing:
            raise ConfigError("update.max_tokens_per_microbatch='auto' sizes packed micro-batches; set "
                              "update.packing=true, or update.num_microbatches='auto' for padded ones")
        if self.packing and self.num_microbatches > 1:
            raise ConfigError(f"update.num_microbatches={self.num_microbatches} with update.packing: packed "
                              "micro-batches are sized by tokens; set update.max_tokens_per_microbatch and leave "
                              "update.num_microbatches at 1, or set update.packing=false")

    def layers_unrolled(self, platform: str | None = None) -> bool:
        """Whether the trained forward unrolls its layers: `unroll_layers`, or when unset, on a GPU
        or TPU (see the class docstring)."""
        if self.unroll_layers is not None:
            return self.unroll_layers
        return (platform or jax.default_backend()) in ACCELERATORS

    def packed_shape(self, rows: int, width: int) -> tuple[int, int]:
        """(buffers per micro-batch, pack_length) of a packed mini-batch of `rows` rows `width`
        columns wide: `pack_length` defaults to the width (a row always fits one buffer), and a
        micro-batch holds `max_tokens_per_microbatch` tokens (default: an eighth of the padded
        mini-batch, so the last micro-batch wastes at most that), and never more buffers than
        the mini-batch has rows (each row fills at most one: a budget sized for a larger batch
        would otherwise run empty buffers)."""
        length = self.pack_length or width
        if length < width:
            raise ConfigError(f"update.pack_length={length} is shorter than the rows ({width} columns): a row "
                              f"must fit one buffer; set update.pack_length >= {width} or leave it unset")
        if self.max_tokens_per_microbatch == "auto":
            raise ConfigError("update.max_tokens_per_microbatch='auto' is chosen from the memory plan before the "
                              "update is built: `rljax train` does it; from Python call "
                              "rljax.plan.remat.choose_remat(cfg), or set a number of tokens")
        budget = self.max_tokens_per_microbatch or max(1, rows // 8) * length
        if budget < length:
            raise ConfigError(f"update.max_tokens_per_microbatch={budget} is under one buffer of "
                              f"update.pack_length={length} tokens; raise it to >= {length}")
        return min(budget // length, rows), length

    def chunk_for(self, batch: int, time: int, vocab: int) -> LogprobChunks:
        """The vocabulary-projection chunks (time steps, vocabulary ids) of a [batch, time] scoring
        pass: `logprob_chunk` or the automatic time chunk, then the vocabulary split it needs
        (`logprob_vocab_chunk` ids per chunk when set)."""
        chunks = auto_chunk_size(batch, time, vocab, time_chunk=self.logprob_chunk)
        if self.logprob_vocab_chunk:
            chunks = chunks._replace(vocab=min(self.logprob_vocab_chunk, vocab))
        return chunks

    @property
    def chunks(self) -> int:
        """Row blocks per batch: mini-batches x micro-batches (the batch size must divide by it);
        an unresolved "auto" counts one (it picks a divisor of the mini-batch rows)."""
        return self.num_minibatches * (1 if self.num_microbatches == "auto" else self.num_microbatches)
