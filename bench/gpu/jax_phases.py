"""The bench's jax phases, each run in its own child process by `bench/bench_gpu.py`.

Every phase is `phase(args, case, record)`: `args` carries `small`, `budget` (this child's time
limit, seconds), `peak_tflops` and `hbm_tb_s` (the ceilings measured earlier in the run, or None);
`record(**fields)` appends one result line.
"""

from __future__ import annotations

import time

from gpu.shapes import CompileCounter, absent_module_imports, accelerator_versions, decode_floor_bytes, timed_update, \
    hf_config, matmul_params, nvidia_smi, timed, train_flops_per_token
from gpu.decode_phases import decode_roofline  # noqa: F401  (issue 48's decode rows, run as a jax phase)

# (rows, tokens per row, micro-batches, remat) of the update step, at full and --small shapes; "auto":
# what `rljax.plan.remat.choose_remat` picks from the memory plan on this device (issue 53)
UPDATE_SHAPES = {"0.5B": (64, 1024, 4, False), "1.5B": (64, 1024, 8, True), "3B": (64, 1024, "auto", "auto"),
                 "7B": (64, 1024, "auto", "auto")}
UPDATE_SHAPES_SMALL = {"0.5B": (8, 64, 2, False), "1.5B": (8, 64, 4, True), "3B": (8, 64, "auto", "auto"),
                       "7B": (8, 64, "auto", "auto")}
LORA_RANK = {"7B": 16}  # LoRA (alpha = 2 x rank, every projection) on a bf16 base; the others train every weight
GROUP_SIZE = 8  # samples per prompt in the synthetic rollout batch


def peak_memory_gib(device) -> float | None:
    """The device's peak bytes in use so far (None where the backend keeps no statistics)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:
        return None
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def ratio(x: float, ceiling: float | None) -> float | None:
    return None if not ceiling else x / ceiling


# ----------------------------------------------------------------------------- ceilings


def ceilings(args, case, record):
    """bf16 matmul TFLOP/s (8192^3) and HBM bandwidth (z + 1 over 4 GiB f32: read + write)."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    record(what="device", platform=dev.platform, device_kind=dev.device_kind, device_count=len(jax.devices()),
           nvidia_smi=nvidia_smi(), accelerator=accelerator_versions())
    n = 1024 if args.small else 8192
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    y = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: a @ b)
    for _ in range(3):
        matmul(x, y).block_until_ready()
    med, times = timed(lambda: matmul(x, y).block_until_ready(), 20, budget_s=args.budget * 0.3)
    record(what="bf16_matmul", n=n, seconds=med, tflops=2 * n**3 / med / 1e12, reps=len(times))
    del x, y
    gib = 1 / 16 if args.small else 4
    z = jnp.full((int(gib * 2**30) // 4,), 1.5, jnp.float32)
    add_one = jax.jit(lambda v: v + 1.0)
    for _ in range(3):
        add_one(z).block_until_ready()
    med, times = timed(lambda: add_one(z).block_until_ready(), 20, budget_s=args.budget * 0.3)
    record(what="hbm", gib=gib, seconds=med, tb_s=2 * gib * 2**30 / med / 1e12, reps=len(times))


# ----------------------------------------------------------------------------- update step


def synthetic_rollout(rows: int, seq: int, vocab: int, seed: int = 0):
    """A full RolloutBatch: a quarter prompt, the rest completion, every token real, 0/1 rewards
    in groups of GROUP_SIZE, and sampler log-probs in [-5, 0]."""
    import jax.numpy as jnp
    import numpy as np

    from rljax.objectives import prompt_major_group_ids
    from rljax.update import RolloutBatch

    rng = np.random.default_rng(seed)
    prompt = seq // 4
    return RolloutBatch(
        tokens_bt=jnp.asarray(rng.integers(0, vocab - 1, (rows, seq)), jnp.int32),
        attn_mask_bt=jnp.ones((rows, seq), bool),
        loss_mask_bt=jnp.asarray(np.arange(seq)[None, :].repeat(rows, 0) >= prompt),
        sampler_logp_bt=jnp.asarray(-rng.random((rows, seq)) * 5, jnp.float32),
        rewards_b=jnp.asarray(rng.integers(0, 2, rows), jnp.float32),
        group_ids_b=prompt_major_group_ids(rows, GROUP_SIZE),
        completion_len=seq - prompt)


def update(args, case, record):
    """rljax's `update_step` (dr_grpo, AdamW + grad-norm clip, f32 params, bf16 compute) at one
    shape and attention choice: case "<0.5B|1.5B|3B|7B>-<auto|xla|cudnn|splash>". 7B trains LoRA
    adapters on a bf16 base (`LORA_RANK`); an "auto" micro-batch count or remat mode is chosen
    from the memory plan first (`gpu.remat_phases.auto_schedule`)."""
    import jax

    from rljax.models import from_hf_dict, init_params
    from rljax.models.attention import describe_attention, resolve_attention
    from rljax.objectives import AlgorithmConfig
    from rljax.lora import LoraConfig
    from rljax.optim import OptimConfig
    from rljax.update import UpdateConfig, init_train_state, update_step

    name, attention = case.split("-")
    rows, seq, micro, remat = (UPDATE_SHAPES_SMALL if args.small else UPDATE_SHAPES)[name]
    rank = LORA_RANK.get(name, 0)
    if "auto" in (micro, remat):
        from gpu.remat_phases import auto_schedule

        remat, micro = auto_schedule(args, name, micro, remat, record, lora_rank=rank)
    hf = hf_config(name, args.small)
    cfg = from_hf_dict(hf, compute_dtype="bfloat16", param_dtype="bfloat16" if rank else "float32", attention=attention)
    counter = CompileCounter()
    batch = synthetic_rollout(rows, seq, hf["vocab_size"])
    update_cfg = UpdateConfig(num_microbatches=micro, remat=remat)
    state = init_train_state(cfg, init_params(cfg, jax.random.key(0)), AlgorithmConfig(algorithm="dr_grpo"),
                             OptimConfig(learning_rate=1e-6, max_grad_norm=1.0, weight_decay=0.01),
                             update_cfg=update_cfg, lora=LoraConfig(rank=rank, alpha=2.0 * rank) if rank else None)
    first_s, first, med, times, metrics = timed_update(update_step, state, batch, counter, 2 if args.small else 5,
                                                       args.budget * 0.35)
    del state
    tokens = rows * seq
    # a frozen base computes no weight gradients: 4 N per token (forward 2 N, input gradients 2 N), not 6 N
    tflops = train_flops_per_token(hf, seq) * (4 / 6 if rank else 1) * tokens / med / 1e12
    record(system="rljax", model=name, attention=attention, lora_rank=rank, attention_resolved=resolve_attention(cfg),
           attention_line=describe_attention(cfg), rows=rows, seq=seq, microbatches=micro, remat=remat,
           log_entropy=update_cfg.log_entropy, unroll_layers=update_cfg.unroll_layers,
           params=cfg.num_params(), matmul_params=matmul_params(hf), first_call_s=first_s, **first,
           recompiles=counter.take()["programs_compiled"], step_s=med, times=times, tokens_per_s=tokens / med,
           model_tflops=tflops, mfu=ratio(tflops, args.peak_tflops), peak_mem_gib=peak_memory_gib(jax.devices()[0]),
           metrics={k: float(v) for k, v in metrics.items() if "loss" in k or "grad_norm" in k},
           absent_modules_imported=absent_module_imports())


# ----------------------------------------------------------------------------- decode


# case -> (scheduler, batch, model.decode_attention); "auto" is the Pallas decode kernel on one GPU,
# "static-256-xla" the einsum decode on the same shapes: what the kernel buys.
DECODE_CASES = {"static-64": ("static", 64, "auto"), "static-256": ("static", 256, "auto"),
                "continuous-256": ("continuous", 256, "auto"), "static-256-xla": ("static", 256, "xla")}


def decode_lengths(small: bool) -> tuple[int, int]:
    """(prompt, new tokens) of the decode phases."""
    return (16, 32) if small else (128, 512)


def decode(args, case, record):
    """rljax's `generate` on Qwen2.5-0.5B shapes in bf16, no EOS: case "static-64", "static-256",
    "continuous-256" (256 slots) or "static-256-xla" (einsum decode attention). --small divides
    the batch by 8."""
    import jax
    import numpy as np

    from rljax.models import from_hf_dict, init_params
    from rljax.models.attention import describe_attention, resolve_decode_attention
    from rljax.sampling import SampleControls, generate

    scheduler, batch, decode_attention = DECODE_CASES[case]
    batch = batch // 8 if args.small else batch
    prompt, new = decode_lengths(args.small)
    hf = hf_config("0.5B", args.small)
    cfg = from_hf_dict(hf, compute_dtype="bfloat16", param_dtype="bfloat16", decode_attention=decode_attention)
    params = init_params(cfg, jax.random.key(0))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    counter = CompileCounter()
    tokens = np.random.default_rng(0).integers(0, hf["vocab_size"] - 1, (batch, prompt)).astype(np.int32)
    extra = dict(scheduler="continuous", slots=batch) if scheduler == "continuous" else {}
    controls = SampleControls(max_new_tokens=new, num_samples=1, temperature=1.0, **extra)
    t = time.perf_counter()
    result = generate(cfg, params, tokens, key=jax.random.key(0), controls=controls)
    jax.block_until_ready(result.tokens)
    first_s = time.perf_counter() - t
    first = counter.take()
    med, times = timed(lambda: jax.block_until_ready(
        generate(cfg, params, tokens, key=jax.random.key(1), controls=controls).tokens), 3, budget_s=args.budget * 0.3)
    floor_s = decode_floor_bytes(hf, weight_bytes, batch, prompt, new) / (args.hbm_tb_s * 1e12) \
        if args.hbm_tb_s else None
    record(system="rljax", scheduler=scheduler, batch=batch, slots=batch if scheduler == "continuous" else None,
           prompt=prompt, new=new, attention_line=describe_attention(cfg),
           decode_attention=resolve_decode_attention(cfg), first_call_s=first_s, **first,
           recompiles=counter.take()["programs_compiled"], seconds=med, times=times, tokens_per_s=batch * new / med,
           mean_length=float(np.asarray(result.lengths).mean()), weight_gib=weight_bytes / 2**30,
           roofline_s=floor_s, roofline_share=None if floor_s is None else floor_s / med,
           peak_mem_gib=peak_memory_gib(jax.devices()[0]), absent_modules_imported=absent_module_imports())


# ----------------------------------------------------------------------------- parity

PARITY_MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=4096, bos_token_id=1)


def parity(args, case, record):
    """f32 logits of rljax vs transformers on one random 4-layer Qwen2 checkpoint, at jax's default
    matmul precision and at "highest"; and the bf16 sampler/trainer log-prob gap (4 prompts x 4
    samples x 64 tokens)."""
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from gpu.shapes import COMMON
    from rljax.models import forward, load_hf, token_logprobs
    from rljax.models.attention import describe_attention
    from rljax.sampling import SampleControls, generate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    reference = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**COMMON, **PARITY_MODEL})).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.05)
    with tempfile.TemporaryDirectory() as path:
        reference.save_pretrained(path)
        cfg, params = load_hf(path)
    tokens = np.random.default_rng(0).integers(0, 4000, (4, 96)).astype(np.int32)
    with torch.no_grad():
        want = reference.to(device)(torch.tensor(tokens, device=device).long()).logits.float().cpu().numpy()
    gaps = {}
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            logits = jax.jit(lambda p, t: forward(cfg, p, t)[0])(params, jnp.asarray(tokens))
        gaps[precision] = float(np.abs(np.asarray(logits, np.float32) - want).max())
    record(what="f32_logits_vs_transformers", max_abs_default=gaps["default"], max_abs_highest=gaps["highest"],
           logits_max_abs=float(np.abs(want).max()), tokens=int(tokens.size))

    cfg16 = cfg.replace(compute_dtype="bfloat16")
    prompt = tokens[:, :32]
    controls = SampleControls(max_new_tokens=64, num_samples=4, temperature=1.0)
    result = generate(cfg16, params, prompt, key=jax.random.key(1), controls=controls)
    full = np.concatenate([np.repeat(prompt, 4, axis=0), np.asarray(result.tokens)], axis=1)
    trainer, _ = jax.jit(lambda p, t: token_logprobs(cfg16, p, t))(params, jnp.asarray(full))
    mask = np.asarray(result.mask)
    gap = np.abs(np.asarray(trainer, np.float32)[:, prompt.shape[1]:] - np.asarray(result.logprobs))[mask]
    record(what="bf16_sampler_vs_trainer_logp", max=float(gap.max()), mean=float(gap.mean()), tokens=int(mask.sum()),
           attention_line=describe_attention(cfg16))
