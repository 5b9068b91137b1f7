"""Task data: sources, held-out splits, prompt rendering, the grain pipeline, group filtering,
task selection (`selection`; the level-ordered policies in `curriculum`), DAPO resampling rounds
and replay.

    source = load_task("reasoning_gym", name="chain_sum", size=2000, seed=0)
    train, held_out = heldout_split(source.examples, eval_size=400, seed=0)
    data = prompt_batches(train, tokenizer=tok, batch_size=64, seed=0, max_prompt_len=64)
    it = iter(data.dataset); batch = next(it); state = it.get_state()   # -> checkpoint
"""

from rljax.data import curriculum  # noqa: F401  (registers `schedule`, `auto_curriculum` in POLICIES)
from rljax.data.example import Example, normalize_question, question_key, verifier_metadata
from rljax.data.filtering import GroupSelection, accuracy_band, dynamic_sample, informative_groups, refill
from rljax.data.pipeline import PromptBatch, PromptData, index_batches, prompt_batches, shard_rows
from rljax.data.replay import MixResult, ReplayBuffer, ReplayRows, mix_into_batch
from rljax.data.resampling import ResampledBatch, ResampleSpend, RoundResampler, resample
from rljax.data.selection import (POLICIES, GroupStats, SelectionPolicy, group_stats, make_policy,
                                  register_policy)
from rljax.data.sources import (SOURCES, FieldMap, TaskSource, from_jsonl, from_parquet, from_reasoning_gym,
                                from_tfds, load_task)
from rljax.data.splits import drop_overlap, heldout_split
from rljax.data.templates import EncodedPrompts, PromptFormat, encode_prompts, pick_bucket, render_prompt

__all__ = [
    "Example", "normalize_question", "question_key", "verifier_metadata",
    "GroupSelection", "accuracy_band", "dynamic_sample", "informative_groups", "refill",
    "MixResult", "ReplayBuffer", "ReplayRows", "mix_into_batch",
    "ResampledBatch", "ResampleSpend", "RoundResampler", "resample",
    "POLICIES", "GroupStats", "SelectionPolicy", "group_stats", "make_policy", "register_policy",
    "PromptBatch", "PromptData", "index_batches", "prompt_batches", "shard_rows",
    "SOURCES", "FieldMap", "TaskSource", "from_jsonl", "from_parquet", "from_reasoning_gym", "from_tfds",
    "load_task", "drop_overlap", "heldout_split",
    "EncodedPrompts", "PromptFormat", "encode_prompts", "pick_bucket", "render_prompt",
]
