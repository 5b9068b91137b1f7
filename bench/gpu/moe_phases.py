"""The bench's moe phase (issue 47): rljax's `update_step` on a Qwen3-MoE-shaped model, grouped
experts (on a GPU: `jax.lax.ragged_dot` with the Pallas Triton lowering) against the dense
all-experts reference, tokens/s and MFU over ACTIVE parameters.

The shape (full size; `--small` shrinks it to a CPU smoke test):

    8 layers, hidden 2048, 32 query / 4 kv heads of 128, 64 experts of width 768, top-8,
    norm_topk_prob, Qwen3's 151,936-token vocabulary with tied embeddings
    = 2.88B parameters in total, 0.77B active per token (0.45B without the embedding)

bf16 params and AdamW moments (6 bytes a parameter: 17.3 GB of train state), bf16 compute, full
remat, 16 rows of 1,024 tokens in 4 micro-batches of 4,096 tokens: it fits one H100 (80 GB) with
room for the dense path's [E, T, F] expert activations of one layer. MFU counts 6 x (active matmul
params + causal attention as a full square) per trained token, as `bench/gpu/shapes.py` does for
the dense models, so grouped and dense share one numerator and the dense path's E/k extra work
shows as lower MFU.
"""

from __future__ import annotations

from gpu.jax_phases import peak_memory_gib, ratio, synthetic_rollout
from gpu.shapes import CompileCounter, timed_update

MOE_CASES = ["grouped", "dense"]
FULL = dict(num_hidden_layers=8, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=64, moe_intermediate_size=768, num_experts_per_tok=8, vocab_size=151936)
SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=8, moe_intermediate_size=32, num_experts_per_tok=2, vocab_size=512)
ROWS_SEQ_MICRO = {False: (16, 1024, 4), True: (4, 32, 2)}


def moe_hf_config(small: bool) -> dict:
    """config.json fields of the bench's Qwen3-MoE shape."""
    return dict(model_type="qwen3_moe", hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=True, norm_topk_prob=True, intermediate_size=6144,
                decoder_sparse_step=1, mlp_only_layers=[], bos_token_id=1, eos_token_id=None,
                **(SMALL if small else FULL))


def active_matmul_params(hf: dict) -> int:
    """Weights one token's matmuls multiply by: q, k, v, o, the router, k of the E experts, and
    the tied vocabulary projection."""
    d, n, kv, h = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    e, k, f = hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
    per_layer = d * (n + 2 * kv) * h + n * h * d + d * e + k * 3 * d * f
    return hf["num_hidden_layers"] * per_layer + hf["vocab_size"] * d


def moe_train_flops_per_token(hf: dict, seq: int) -> float:
    """6 x (active matmul params + attention as a full square over `seq` keys) per trained token."""
    attention = hf["num_hidden_layers"] * 2 * hf["num_attention_heads"] * hf["head_dim"] * seq
    return 6.0 * (active_matmul_params(hf) + attention)


def moe(args, case, record):
    """The update of the Qwen3-MoE shape with `model.moe_impl` = case ("grouped" or "dense")."""
    import jax

    from rljax.models import from_hf_dict, init_params
    from rljax.models.experts import resolve_experts_impl
    from rljax.objectives import AlgorithmConfig
    from rljax.optim import OptimConfig
    from rljax.update import UpdateConfig, init_train_state, update_step

    hf = moe_hf_config(args.small)
    rows, seq, micro = ROWS_SEQ_MICRO[args.small]
    cfg = from_hf_dict(hf, compute_dtype="bfloat16", param_dtype="bfloat16")
    cfg = cfg.replace(moe=cfg.moe.replace(impl=case))
    counter = CompileCounter()
    batch = synthetic_rollout(rows, seq, hf["vocab_size"])
    update_cfg = UpdateConfig(num_microbatches=micro, remat=True)
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(algorithm="dr_grpo"),
                             OptimConfig(learning_rate=1e-6, max_grad_norm=1.0, weight_decay=0.01),
                             update_cfg=update_cfg)
    first_s, first, med, times, metrics = timed_update(update_step, state, batch, counter, 2 if args.small else 5,
                                                       args.budget * 0.35)
    del state
    tokens = rows * seq
    tflops = moe_train_flops_per_token(hf, seq) * tokens / med / 1e12
    record(system="rljax", model="qwen3_moe-8L-64x768-top8" if not args.small else "qwen3_moe-small", moe_impl=case,
           experts_impl=resolve_experts_impl(case), rows=rows, seq=seq, microbatches=micro, remat=True,
           params=cfg.num_params(), active_params=cfg.num_active_params(),
           active_matmul_params=active_matmul_params(hf),
           first_call_s=first_s, **first, step_s=med, times=times, tokens_per_s=tokens / med, model_tflops=tflops,
           mfu_active=ratio(tflops, args.peak_tflops), peak_mem_gib=peak_memory_gib(jax.devices()[0]),
           metrics={k: float(v) for k, v in metrics.items() if "loss" in k or "grad_norm" in k})
    print(f"moe {case}: {tokens / med:,.0f} tokens/s, {tflops:.1f} model TFLOP/s (active), step {med:.3f} s, "
          f"first call {first_s:.1f} s", flush=True)
