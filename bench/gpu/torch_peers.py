"""The stronger PyTorch peers of the update step (issue 53), beside the eager one in `torch_phases`.

case "<0.5B|1.5B>-<compile|liger>":
- compile: the same step as `torch_phases.torch_update` (transformers Qwen2, sdpa, f32 params under
  bf16 autocast, fused AdamW, the same batch, micro-batches and Dr. GRPO clipped surrogate) with the
  forward + loss of a micro-batch under `torch.compile` (inductor, default mode; `aot_eager` on a
  CPU smoke run);
- liger: the model's hidden states into Liger's `LigerFusedLinearGRPOLoss` (`loss_type="dr_grpo"`,
  what TRL's `use_liger_kernel` runs), which chunks the vocabulary projection and never holds the
  [rows, tokens, vocab] logits. Liger is Python + Triton, GPU only: without a GPU or without the
  `liger_kernel` package the case records a skip and says why.
"""

from __future__ import annotations

from gpu.jax_phases import GROUP_SIZE, UPDATE_SHAPES, UPDATE_SHAPES_SMALL, ratio
from gpu.shapes import hf_config, timed_first, train_flops_per_token
from gpu.torch_phases import CLIP_EPS, _device, _qwen2

PEER_CASES = ["1.5B-compile", "1.5B-liger", "0.5B-compile", "0.5B-liger"]


def _liger_loss(device: str, completion: int):
    """Liger's fused linear GRPO loss, or (None, why) when it cannot run here."""
    if device != "cuda":
        return None, "Liger's kernels are Triton, GPU only: skipped on this CPU run"
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as e:
        return None, f"liger_kernel is not installed ({e}); carry its wheel (pip download liger-kernel --no-deps)"
    return LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=CLIP_EPS, epsilon_high=CLIP_EPS, loss_type="dr_grpo",
                                    max_completion_length=completion, temperature=1.0), None


def torch_peer(args, case, record):
    """One optimiser step over the batch, as `torch_phases.torch_update`, with the forward + loss
    compiled (`compile`) or the loss fused by Liger (`liger`)."""
    import numpy as np
    import torch
    import transformers

    shape, variant = case.split("-")
    device = _device()
    rows, seq, micro, _ = (UPDATE_SHAPES_SMALL if args.small else UPDATE_SHAPES)[shape]
    prompt = seq // 4
    liger = None
    if variant == "liger":
        liger, why = _liger_loss(device, seq - prompt)
        if liger is None:
            print(f"skipped: {why}", flush=True)
            record(system="pytorch+liger", model=shape, skipped=why)
            return
    hf = hf_config(shape, args.small)
    model = _qwen2(hf, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=device == "cuda")
    rng = np.random.default_rng(0)
    tokens = torch.tensor(rng.integers(0, hf["vocab_size"] - 1, (rows, seq)), device=device)
    old_logp = torch.tensor(-rng.random((rows, seq)) * 5, device=device, dtype=torch.float32)
    rewards = torch.tensor(rng.integers(0, 2, rows), device=device, dtype=torch.float32)
    grouped = rewards.view(-1, GROUP_SIZE)
    advantages = (grouped - grouped.mean(1, keepdim=True)).view(-1)
    mask = (torch.arange(seq, device=device)[None, :] >= prompt).float().expand(rows, seq)
    norm = float(rows * (seq - prompt))
    per_micro = rows // micro

    def eager_loss(tok, old, adv, msk):
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(tok).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tok[:, 1:, None])[..., 0]
        ratio_ = torch.exp(logp - old[:, 1:])
        surrogate = torch.minimum(ratio_ * adv[:, None], ratio_.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv[:, None])
        return -(surrogate * msk[:, 1:]).sum() / norm

    def liger_loss(tok, old, adv, msk):
        with torch.autocast(device, dtype=torch.bfloat16):
            hidden = model.model(tok).last_hidden_state
        loss, _ = liger(hidden[:, :-1], model.lm_head.weight, tok[:, 1:], msk[:, 1:], adv,
                        old_per_token_logps=old[:, 1:])
        return loss / micro  # liger divides by its micro-batch's rows x max_completion_length

    # inductor on a GPU; a CPU smoke run traces the same graphs with aot_eager (inductor's C++ build
    # of a whole model step takes minutes on a small CPU, and a CPU number is no measurement)
    backend = "inductor" if device == "cuda" else "aot_eager"
    loss_fn = liger_loss if liger is not None else torch.compile(eager_loss, backend=backend)

    def step():
        opt.zero_grad(set_to_none=True)
        for i in range(micro):
            sl = slice(i * per_micro, (i + 1) * per_micro)
            loss_fn(tokens[sl], old_logp[sl], advantages[sl], mask[sl]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    first_s, med, times = timed_first(step, 2 if args.small else 5, args.budget * 0.4)
    tflops = train_flops_per_token(hf, seq) * rows * seq / med / 1e12
    record(system="pytorch+" + variant, model=shape, rows=rows, seq=seq, microbatches=micro,
           compile_backend=None if liger is not None else backend,
           attention=model.config._attn_implementation, gradient_checkpointing=False,
           params=sum(p.numel() for p in model.parameters()), first_call_s=first_s, step_s=med, times=times,
           tokens_per_s=rows * seq / med, model_tflops=tflops, mfu=ratio(tflops, args.peak_tflops),
           peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
           torch=torch.__version__, transformers=transformers.__version__)
