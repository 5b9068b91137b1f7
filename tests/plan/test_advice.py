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
    assert [c.setting for c in cp] == ["mesh.context=2 mesh.fsdp=4 update.num_microbatches=4",
                                       "mesh.context=4 mesh.fsdp=2 update.num_microbatches=8",
                                       "mesh.context=8 mesh.fsdp=1 update.num_microbatches=16"]
    assert all(c.cfg.mesh.resolve(8)[1] * c.cfg.mesh.context == 8 for c in cp)
    short_cfg = load_config("default", [*TINY, "sampling.max_new_tokens=64"])
    assert not [c for c in candidates(short_cfg, model_cfg) if c.setting.startswith("mesh.context")]


def _tokens_per_device(cfg, width: int) -> float:
    """One micro-batch's tokens on one device: its rows (padded) or buffers (packed) over the
    data x fsdp groups, each row's `width` tokens over the context axis."""
    data, fsdp, _ = cfg.mesh.resolve(8)
    u, rows = cfg.update, cfg.rl.prompts_per_iteration * cfg.sampling.num_samples
    per_micro = u.packed_shape(rows, width)[0] if u.packing else rows // u.num_microbatches
    return per_micro / (data * fsdp) * u.packed_shape(rows, width)[1] / cfg.mesh.context if u.packing else \
        per_micro / (data * fsdp) * width / cfg.mesh.context


def test_context_candidates_cut_the_tokens_a_device_holds():
    """Each CP candidate leaves a device one row's share, width / C tokens, padded or packed: its
    micro-batches hold one row (one buffer) per data x fsdp group. Measured on Qwen2.5-7B at 32k
    (BENCHMARKS.md, issue 50): at 64 micro-batches of 8 rows, context = 2 x fsdp = 4 held 2 half
    rows a device, as many tokens as fsdp = 8. Catches a CP candidate that keeps the micro-batch:
    a device then holds 2, 4, 8 rows' worth of half, quarter, eighth rows (width tokens each time),
    the activations CP was meant to divide."""
    model_cfg = model_config("Qwen2.5-0.5B")
    width = 8 + LONG_ROW_TOKENS  # prompt bucket + response
    for packing in ("update.packing=false", f"update.packing=true update.max_tokens_per_microbatch={16 * width}"):
        cfg = load_config("default", [*TINY, f"sampling.max_new_tokens={LONG_ROW_TOKENS}", *packing.split()])
        cp = [c for c in candidates(cfg, model_cfg) if c.setting.startswith("mesh.context")]
        assert [c.cfg.mesh.context for c in cp] == [2, 4, 8]
        for c in cp:
            assert _tokens_per_device(c.cfg, width) == width / c.cfg.mesh.context, (packing, c.setting)
