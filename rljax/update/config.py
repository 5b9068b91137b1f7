"""How the update step runs: its batch schedule and its compile switches (the TOML `[update]`
section). What it optimises is `rljax.objectives.AlgorithmConfig`."""

from __future__ import annotations

import dataclasses

from rljax.config_io import bounded
from rljax.errors import ConfigError
from rljax.models import LogprobChunks, auto_chunk_size


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """The update step's schedule and compilation.

    Schedule: `num_epochs` passes over `num_minibatches` shuffled mini-batches (one optimiser step
    each), each split into `num_microbatches` whose gradients are accumulated.
    Compilation: `remat` recomputes layer activations in the backward pass (less memory, more
    compute); `unroll_layers` unrolls the layer scan of the trained forward (XLA can then fuse
    across layer boundaries and schedule each layer's matmuls on their own; compiles take longer;
    see `rljax.models.hidden_states` and BENCHMARKS.md).
    Scoring: `logprob_chunk` is the time-chunk of the vocabulary projection (None: chosen from the
    shapes and the backend by `rljax.models.auto_chunk_size`, so a 150k vocabulary never holds
    [B, T, V]; a chunk is recomputed in the backward pass); `logprob_vocab_chunk` the ids per
    vocabulary chunk (None: automatic; on a CPU split only where one time chunk alone is over
    budget, on an accelerator every token in one chunk and the vocabulary in exact slices). `log_entropy` reports the policy entropy; with it
    off and `entropy_coef = 0` the entropy is not computed at all.
    """

    num_epochs: int = bounded(1, ge=1)
    num_minibatches: int = bounded(1, ge=1)
    num_microbatches: int = bounded(1, ge=1)
    remat: bool = False
    unroll_layers: bool = False
    logprob_chunk: int | None = bounded(None, ge=1)
    logprob_vocab_chunk: int | None = bounded(None, ge=1)
    log_entropy: bool = True

    def __post_init__(self):
        for name in ("num_epochs", "num_minibatches", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"update.{name}={getattr(self, name)} must be >= 1")
        for name in ("logprob_chunk", "logprob_vocab_chunk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"update.{name}={getattr(self, name)} must be >= 1 (or unset: automatic)")

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
        """Row blocks per batch: mini-batches x micro-batches (the batch size must divide by it)."""
        return self.num_minibatches * self.num_microbatches
