"""`rljax plan` on a mixture of experts (`rljax.plan.moe`): experts, total and active parameters and
the expert-parallel all-to-all buffers equal a hand count on a tiny Qwen3-MoE, and the command prints them."""

from __future__ import annotations

import json

import jax

from rljax import cli
from rljax.models import init_params, preset
from rljax.models.moe_config import MoEConfig
from rljax.plan.memory import prompt_width
from rljax.plan.moe import moe_params, moe_plan
from rljax.train.config import load_config

# V128 D64 N4 K2 H16 L2, tied embeddings, q/k norms; 8 experts of width 32, top-2
TINY_MOE = preset("qwen2-test").replace(model_type="qwen3_moe", qkv_bias=False, qk_norm=True,
                                        moe=MoEConfig(num_experts=8, top_k=2, expert_size=32))
RUN = ["rl.prompts_per_iteration=8", "sampling.num_samples=2", "sampling.max_new_tokens=4", "data.max_prompt_tokens=8",
       "mesh.fsdp=-1", "mesh.expert=2"]


def test_counts_equal_a_hand_count_and_the_params_tree():
    """Per layer: q 64*4*16 + k, v 64*2*16 each + o 4*16*64 = 12,288; q/k norms 2*16; two norms
    2*64; router 64*8; experts 3*64*32 = 6,144 each, 8 in total and 2 active. Plus embed 128*64
    (tied) and the final norm 64. Catches: experts counted k times in the total, the router or a
    norm forgotten, active counted with all experts."""
    common = 12_288 + 32 + 128 + 512
    assert TINY_MOE.tie_embeddings and TINY_MOE.num_layers == 2
    total, active = moe_params(TINY_MOE)
    assert total == 2 * (common + 8 * 6_144) + 128 * 64 + 64 == 132_480
    assert active == 2 * (common + 2 * 6_144) + 128 * 64 + 64 == 58_752
    tree = jax.eval_shape(lambda: init_params(TINY_MOE, jax.random.key(0)))
    assert sum(x.size for x in jax.tree.leaves(tree)) == total


def test_all_to_all_buffers_equal_a_hand_count():
    """8 devices as fsdp=4 x expert=2: an update micro-batch of 8 prompts x 2 samples rows of
    8 + 4 tokens = 192 tokens, 24 per device; top-2 gives slots of C = 48 rows per destination;
    one layer holds 3 f32 buffers of 2 x 48 x 64 plus the int32 ids going and coming.
    Catches: tokens not split over the expert axis, capacity without k, one buffer instead of three."""
    cfg = load_config("default", RUN)
    assert (cfg.update.num_minibatches, cfg.update.num_microbatches, prompt_width(cfg)) == (1, 1, 8)
    plan = moe_plan(cfg, TINY_MOE, 8, prompt_width(cfg))
    assert (plan.expert_parallel, plan.experts_per_device, plan.tokens_per_device, plan.capacity) == (2, 4, 24, 48)
    assert plan.all_to_all_bytes == 3 * 2 * 48 * 64 * 4 + 2 * 2 * 48 * 4
    dense = moe_plan(load_config("default", RUN[:-1]), TINY_MOE, 8, 8)
    assert (dense.expert_parallel, dense.experts_per_device, dense.all_to_all_bytes) == (1, 8, 0)
    assert moe_plan(cfg, preset("qwen2-test"), 8, 8) is None


def test_cli_plan_prints_the_moe_counts(tmp_path, capsys):
    """`rljax plan --model <qwen3_moe dir> --mesh fsdp=4,expert=2` prints the experts, the total and
    active parameters and the all-to-all buffer line (stopped before compiling by a tiny memory limit)."""
    c = TINY_MOE
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen3_moe", vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=128,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False, hidden_act="silu")))
    code = cli.main(["plan", "--config", "default", "--model", str(tmp_path), "--devices", "8", "--mesh",
                     "fsdp=4,expert=2", *RUN[:4], "plan.device_memory_gib=1e-9"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 2, captured.err
    assert "experts: 8 per layer x 2 MoE layers, top-2, 4 per device (expert=2); params 0.1M total, 0.1M active" in out
    assert "all-to-all per MoE layer: 24 tokens per device x top-2 -> 2 x 48 slots (dropless), 0.1 MiB" in out
