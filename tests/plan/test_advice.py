"""The plan's advice (`rljax.plan.advice.candidates`): which changes it tries, without compiling."""

from __future__ import annotations

from rljax.plan.advice import LONG_ROW_TOKENS, candidates
from rljax.plan.shapes import model_config
from rljax.train.config import load_config

TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=32", "rl.prompts_per_iteration=8", "sampling.num_samples=2",
        "data.max_prompt_tokens=8", "mesh.fsdp=8"]


def test_long_rows_try_context_parallel_degrees_in_increasing_order():
    """Rows of >= LONG_ROW_TOKENS tokens try mesh.context = 2, 4, 8 taken from fsdp (so the first
    that fits is the smallest CP degree that does); short rows never do. Catches: CP offered for
    short rows, degrees out of order, a mesh whose device count changes."""
    long_cfg = load_config("default", [*TINY, f"sampling.max_new_tokens={LONG_ROW_TOKENS}"])
    model_cfg = model_config("Qwen2.5-0.5B")
    cp = [c for c in candidates(long_cfg, model_cfg) if c.setting.startswith("mesh.context")]
    assert [c.setting for c in cp] == ["mesh.context=2 mesh.fsdp=4", "mesh.context=4 mesh.fsdp=2",
                                       "mesh.context=8 mesh.fsdp=1"]
    assert all(c.cfg.mesh.resolve(8)[1] * c.cfg.mesh.context == 8 for c in cp)
    short_cfg = load_config("default", [*TINY, "sampling.max_new_tokens=64"])
    assert not [c for c in candidates(short_cfg, model_cfg) if c.setting.startswith("mesh.context")]
