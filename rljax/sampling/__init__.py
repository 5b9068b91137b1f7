"""Sampling: jitted, KV-cached generation whose log-probs match the trainer's.

`generate` is the notebook entry point; `stream` yields tokens as they are drawn (the CLI uses
it); `sample` is the traceable form for fused programs. All three take one `SampleControls`.
`sample_logits` and `filtered_logprobs` are the sampling distribution on plain logits.
`sample_episodes` decodes multi-turn episodes with a host environment (`rljax.sampling.multiturn`).
`sample_with_updates` keeps decoding across weight updates (`rljax.sampling.interruptible`).
"""

from rljax.sampling.controls import SampleControls, StaticControls
from rljax.sampling.decode import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    SampleResult,
    bucket_length,
    phase_widths,
)
from rljax.sampling.filters import Filters, filtered_logprobs, make_filters, sample_logits
from rljax.sampling.sampler import generate, rows_sharding, stream
from rljax.sampling.traced import sample
from rljax.sampling.interruptible import PartialRollout, sample_with_updates
from rljax.sampling.multiturn import Episodes, episode_controls, sample_episodes, sample_episodes_host_loop

__all__ = [
    "SampleControls", "StaticControls", "generate", "stream", "sample", "SampleResult", "bucket_length",
    "phase_widths", "rows_sharding", "FINISH_LENGTH", "FINISH_EOS", "FINISH_STOP",
    "sample_logits", "filtered_logprobs", "make_filters", "Filters",
    "sample_episodes", "sample_episodes_host_loop", "Episodes", "episode_controls",
    "PartialRollout", "sample_with_updates",
]
