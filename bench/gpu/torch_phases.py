"""The bench's PyTorch / transformers reference phases (child processes of `bench/bench_gpu.py`).

The PyTorch update step is the strongest plain eager step we know for these shapes, not a straw
man: transformers Qwen2 with sdpa attention, f32 params under bf16 autocast, fused AdamW, no
gradient checkpointing (the memory fits), the same rows, micro-batches and Dr. GRPO clipped
surrogate as rljax's step.
"""

from __future__ import annotations

import time

from gpu.jax_phases import GROUP_SIZE, LORA_RANK, UPDATE_SHAPES, UPDATE_SHAPES_SMALL, decode_lengths, ratio
from gpu.shapes import decode_floor_bytes, hf_config, timed_first, train_flops_per_token

CLIP_EPS = 0.2  # rljax's dr_grpo default (clip_eps_low = clip_eps_high = 0.2)


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _qwen2(hf: dict, device: str):
    """A randomly initialised transformers Qwen2 built directly on `device` (sdpa attention)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**hf, attn_implementation="sdpa")
    with torch.device(device):
        return transformers.Qwen2ForCausalLM(config)


def torch_update(args, case, record):
    """One optimiser step over the batch: micro-batches accumulate gradients, then global-norm
    clip 1.0 and AdamW. Loss: the PPO clipped surrogate with Dr. GRPO advantages (reward minus
    its group's mean) and aggregation (each row's token sum over the completion budget, mean
    over rows). case: "0.5B", "1.5B", "3B" or "7B". Where rljax's shape table leaves the schedule
    to "auto" (3B, 7B), PyTorch runs 8 micro-batches with gradient checkpointing (the 3B step in f32
    with AdamW does not fit an H200 without it); 7B trains peft LoRA adapters (rank 16, alpha 32,
    every projection: rljax's targets) on a bf16 base."""
    import numpy as np
    import torch
    import transformers

    device = _device()
    rows, seq, micro, remat = (UPDATE_SHAPES_SMALL if args.small else UPDATE_SHAPES)[case]
    checkpointing = remat == "auto"
    micro = min(8, rows) if micro == "auto" else micro
    rank = LORA_RANK.get(case, 0)
    hf = hf_config(case, args.small)
    model = _qwen2(hf, device)
    if rank:
        import peft

        model = peft.get_peft_model(model.to(torch.bfloat16), peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        for p in model.parameters():  # the adapters train in f32 (as rljax's), the base stays bf16
            if p.requires_grad:
                p.data = p.data.float()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if rank:
            model.enable_input_require_grads()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, weight_decay=0.01,
                            fused=device == "cuda")
    rng = np.random.default_rng(0)
    prompt = seq // 4
    tokens = torch.tensor(rng.integers(0, hf["vocab_size"] - 1, (rows, seq)), device=device)
    old_logp = torch.tensor(-rng.random((rows, seq)) * 5, device=device, dtype=torch.float32)
    rewards = torch.tensor(rng.integers(0, 2, rows), device=device, dtype=torch.float32)
    grouped = rewards.view(-1, GROUP_SIZE)
    advantages = (grouped - grouped.mean(1, keepdim=True)).view(-1)
    mask = (torch.arange(seq, device=device)[None, :] >= prompt).float().expand(rows, seq)
    norm = float(rows * (seq - prompt))
    per_micro = rows // micro

    def step():
        opt.zero_grad(set_to_none=True)
        for i in range(micro):
            sl = slice(i * per_micro, (i + 1) * per_micro)
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = model(tokens[sl]).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[sl, 1:, None])[..., 0]
            ratio_ = torch.exp(logp - old_logp[sl, 1:])
            adv = advantages[sl, None]
            surrogate = torch.minimum(ratio_ * adv, ratio_.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv)
            loss = -(surrogate * mask[sl, 1:]).sum() / norm
            loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    first_s, med, times = timed_first(step, 2 if args.small else 5, args.budget * 0.4)
    tflops = train_flops_per_token(hf, seq) * (4 / 6 if rank else 1) * rows * seq / med / 1e12
    record(system="pytorch", model=case, rows=rows, seq=seq, microbatches=micro, lora_rank=rank,
           attention=model.config._attn_implementation,
           gradient_checkpointing=checkpointing, params=sum(p.numel() for p in model.parameters()), first_call_s=first_s,
           step_s=med, times=times, tokens_per_s=rows * seq / med, model_tflops=tflops,
           mfu=ratio(tflops, args.peak_tflops),
           peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
           torch=torch.__version__, transformers=transformers.__version__)


def hf_decode(args, case, record):
    """transformers `generate` (sdpa, bf16, dynamic cache, sampling at temperature 1, no EOS) on
    Qwen2.5-0.5B shapes: case is the batch ("64" or "256"; --small divides it by 8). A call that
    would outrun this phase's limit stops at `max_time` and reports the tokens it did make."""
    import numpy as np
    import torch
    import transformers

    device = _device()
    batch = int(case) // 8 if args.small else int(case)
    prompt, new = decode_lengths(args.small)
    hf = hf_config("0.5B", args.small)
    model = _qwen2(hf, device).to(dtype=torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.tensor(np.random.default_rng(0).integers(0, hf["vocab_size"] - 1, (batch, prompt)), device=device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(tokens))
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(tokens, max_new_tokens=8, **kwargs)  # warm-up: kernels, allocator
        if device == "cuda":
            torch.cuda.synchronize()
        max_time = max(5.0, args.budget - (time.perf_counter() - start) - 20)
        t = time.perf_counter()
        out = model.generate(tokens, max_new_tokens=new, max_time=max_time, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    made = out.shape[1] - prompt
    floor_s = decode_floor_bytes(hf, weight_bytes, batch, prompt, made) / (args.hbm_tb_s * 1e12) \
        if args.hbm_tb_s else None
    record(system="transformers", batch=batch, prompt=prompt, new=new, new_tokens_made=made,
           stopped_by_max_time=made < new, max_time_s=max_time, seconds=seconds, tokens_per_s=batch * made / seconds,
           roofline_share=None if floor_s is None else floor_s / seconds, attention="sdpa",
           transformers=transformers.__version__, torch=torch.__version__)
