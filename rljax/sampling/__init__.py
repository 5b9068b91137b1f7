"""Sampling: jitted, KV-cached generation whose log-probs match the trainer's.

`generate` is the notebook entry point; `stream` yields tokens as they are drawn (the CLI uses
it); `sample_logits` and `filtered_logprobs` are the sampling distribution on plain logits.
"""

from rljax.sampling.filters import Filters, filtered_logprobs, make_filters, sample_logits
from rljax.sampling.sampler import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    SampleResult,
    bucket_length,
    generate,
    phase_widths,
    rows_sharding,
    stream,
)
from rljax.sampling.traced import SampleControls, sample

__all__ = [
    "generate", "stream", "SampleResult", "bucket_length", "phase_widths", "rows_sharding",
    "FINISH_LENGTH", "FINISH_EOS", "FINISH_STOP",
    "sample_logits", "filtered_logprobs", "make_filters", "Filters", "sample", "SampleControls",
]
