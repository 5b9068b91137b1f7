"""Issue 49's vision-language rows: the VL update and sampler at Qwen2.5-VL-3B shapes, rljax
against transformers' `Qwen2_5_VLForConditionalGeneration` on the same card.

Phase `vl`, cases `VL_CASES`. One batch for all four: P = 8 generated "count the shapes" pictures
(`rljax.data.vl_rows.visual_examples`, 448 x 448 px: 32 x 32 patches, 256 merged image tokens
each), a 32-token text prompt each, n = 8 samples a prompt (64 rows), 512 completion tokens.
- "update": rljax's `update_step` (dr_grpo, AdamW + grad-norm clip, f32 params, bf16 compute,
  tower trained, 8 micro-batches, remat): each row carries its prompt's patches
  (`PromptImages.rows_for`);
- "torch_update": the same step in PyTorch (transformers, sdpa, bf16 autocast, fused AdamW, no
  gradient checkpointing), the same tokens, pixels, loss (`gpu.torch_phases`' Dr. GRPO clipped
  surrogate) and micro-batches;
- "sample": rljax's image sampler (bf16 weights; the tower once per prompt, the prefill shared by
  its 8 samples), 512 new tokens, no EOS;
- "hf_sample": transformers `generate` (bf16, sdpa, `num_return_sequences = 8`), stopped at
  `max_time` if it would outrun the phase.
Model FLOPs count the linear layers only (6 x params x tokens for the decoder, x patches for the
tower; the attention squares are left out), so MFU here is a lower bound.

--small: a tiny tower and decoder, 112 px pictures, 16 new tokens (a CPU smoke test).
"""

from __future__ import annotations

import time

from gpu.shapes import timed, timed_first, timed_update

VL_CASES = ("update", "torch_update", "sample", "hf_sample")
PROMPTS, SAMPLES, COMPLETION, TEXT_PROMPT = 8, 8, 512, 32
MICROBATCHES = 8
IMAGE_ID, VIDEO_ID, START_ID, END_ID = 151655, 151656, 151652, 151653

# Qwen2.5-VL-3B-Instruct's published config.json (random weights)
VL_3B = dict(
    text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
              num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
              tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision=dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2, window_size=112, out_hidden_size=2048, in_channels=3, hidden_act="silu",
                fullatt_block_indexes=[7, 15, 23, 31]),
    ids=(IMAGE_ID, VIDEO_ID, START_ID, END_ID), size=448, new=COMPLETION)
VL_SMALL = dict(
    text=dict(vocab_size=4096, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, hidden_act="silu",
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
    vision=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2, window_size=56, out_hidden_size=64, in_channels=3, hidden_act="silu",
                fullatt_block_indexes=[1]),
    ids=(4090, 4091, 4088, 4089), size=112, new=16)


def shapes(small: bool) -> dict:
    return VL_SMALL if small else VL_3B


def hf_vl_dict(small: bool) -> dict:
    """The config.json dict both systems read."""
    s = shapes(small)
    image, video, start, end = s["ids"]
    return dict(model_type="qwen2_5_vl", text_config=dict(s["text"]), vision_config=dict(s["vision"]),
                image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
                tie_word_embeddings=s["text"]["tie_word_embeddings"])


def vl_batch(small: bool):
    """(VLConfig, the P prompts' `ImagePrompts` (NumPy), the rljax `PromptImages`, the P x n rows'
    tokens / attention mask / completion mask / sampler log-probs / rewards) of the module docstring."""
    import numpy as np

    from rljax.data.prompt_images import ImagePrompter
    from rljax.data.vl_rows import image_prompts, visual_examples
    from rljax.models.vl_io import vl_from_hf_dict

    s = shapes(small)
    vl = vl_from_hf_dict(hf_vl_dict(small), compute_dtype="bfloat16", param_dtype="float32")
    examples = visual_examples("count", "train", PROMPTS, size=s["size"])
    rng = np.random.default_rng(0)
    text_pt = rng.integers(3, min(s["ids"]) - 8, (PROMPTS, TEXT_PROMPT)).astype(np.int32)
    mask_pt = np.ones_like(text_pt, bool)
    prompter = ImagePrompter.build(vl, examples, max_prompt_tokens=TEXT_PROMPT, max_new_tokens=s["new"], pad_id=0,
                                   train_vision=True)
    tokens_pt, prompt_mask_pt, images = prompter(examples, text_pt, mask_pt)
    raw = image_prompts(vl, examples, text_pt, mask_pt, pad_id=0, width=prompter.width,
                        num_patches=prompter.num_patches)
    rows, new = PROMPTS * SAMPLES, s["new"]
    completion = rng.integers(3, min(s["ids"]) - 8, (rows, new)).astype(np.int32)
    tokens_bt = np.concatenate([np.repeat(tokens_pt, SAMPLES, 0), completion], axis=1)
    attn_bt = np.concatenate([np.repeat(prompt_mask_pt, SAMPLES, 0), np.ones((rows, new), bool)], axis=1)
    loss_bt = np.concatenate([np.zeros_like(np.repeat(prompt_mask_pt, SAMPLES, 0)), np.ones((rows, new), bool)], 1)
    old_logp = (-rng.random(tokens_bt.shape) * 5).astype(np.float32)
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    return vl, raw, images, tokens_pt, prompt_mask_pt, tokens_bt, attn_bt, loss_bt, old_logp, rewards


def linear_flops(small: bool, text_tokens: int, patches: int, train: bool) -> float:
    """2 (forward) or 6 (training) x the linear weights a token / patch multiplies by."""
    s = shapes(small)
    t, v = s["text"], s["vision"]
    d, f, n, k = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["num_key_value_heads"]
    h = d // n
    text = t["num_hidden_layers"] * (d * (n + 2 * k) * h + n * h * d + 3 * d * f) + t["vocab_size"] * d
    vd, vf = v["hidden_size"], v["intermediate_size"]
    patch_in = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    tower = patch_in * vd + v["depth"] * (4 * vd * vd + 3 * vd * vf)
    merger = (4 * vd) * (4 * vd) / 4 + (4 * vd) * v["out_hidden_size"] / 4  # per patch: the MLP runs on 1 in 4
    return (6.0 if train else 2.0) * (text * text_tokens + (tower + merger) * patches)


def vl(args, case, record):
    """One row of the module docstring."""
    import jax
    import numpy as np

    from gpu.jax_phases import peak_memory_gib, ratio
    from gpu.shapes import CompileCounter

    (vl_cfg, raw, images, tokens_pt, prompt_mask_pt, tokens_bt, attn_bt, loss_bt, old_logp,
     rewards) = vl_batch(args.small)
    rows, seq = tokens_bt.shape
    new = shapes(args.small)["new"]
    patches_per_row = int(np.asarray(raw.grid_thw).prod(axis=1).sum()) // PROMPTS
    common = dict(prompts=PROMPTS, samples=SAMPLES, rows=rows, seq=seq, prompt_width=tokens_pt.shape[1], new=new,
                  patches_per_prompt=patches_per_row, image_px=shapes(args.small)["size"])
    if case in ("update", "sample"):
        from rljax.models.vlm import init_vl_params

        params = init_vl_params(vl_cfg, jax.random.key(0))
        counter = CompileCounter()
    if case == "update":
        import jax.numpy as jnp

        from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
        from rljax.optim import OptimConfig
        from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update_step

        batch = RolloutBatch(tokens_bt=jnp.asarray(tokens_bt), attn_mask_bt=jnp.asarray(attn_bt),
                             loss_mask_bt=jnp.asarray(loss_bt), sampler_logp_bt=jnp.asarray(old_logp),
                             rewards_b=jnp.asarray(rewards), group_ids_b=prompt_major_group_ids(rows, SAMPLES),
                             completion_len=new, vision=images.rows_for(np.arange(PROMPTS), SAMPLES, new))
        state = init_train_state(vl_cfg.text, params, AlgorithmConfig(algorithm="dr_grpo"),
                                 OptimConfig(learning_rate=1e-6, max_grad_norm=1.0, weight_decay=0.01),
                                 update_cfg=UpdateConfig(num_microbatches=MICROBATCHES, remat=True))
        del params
        first_s, first, med, times, metrics = timed_update(update_step, state, batch, counter, 2 if args.small else 4,
                                                           args.budget * 0.3)
        del state, metrics
        tflops = linear_flops(args.small, rows * seq, rows * patches_per_row, True) / med / 1e12
        record(system="rljax", **common, microbatches=MICROBATCHES, remat=True, first_call_s=first_s, **first,
               recompiles=counter.take()["programs_compiled"], step_s=med, times=times, tokens_per_s=rows * seq / med,
               linear_tflops=tflops, mfu_linear=ratio(tflops, args.peak_tflops),
               peak_mem_gib=peak_memory_gib(jax.devices()[0]))
    elif case == "sample":
        from rljax.sampling import SampleControls
        from rljax.sampling.vision import generate_prompts

        params16 = jax.block_until_ready(jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), params))
        counter.take()  # the eager casts above compile one program per leaf shape: not the sampler's
        controls = SampleControls(max_new_tokens=new, num_samples=SAMPLES, temperature=1.0)
        call = lambda k: jax.block_until_ready(generate_prompts(  # noqa: E731
            vl_cfg, params16, tokens_pt, prompt_mask_pt, key=jax.random.key(k), controls=controls, images=images).tokens)
        t = time.perf_counter()
        call(0)
        first_s, first = time.perf_counter() - t, counter.take()
        med, times = timed(lambda: call(1), 3, budget_s=args.budget * 0.3)
        record(system="rljax", **common, first_call_s=first_s, **first, recompiles=counter.take()["programs_compiled"],
               seconds=med, times=times, tokens_per_s=rows * new / med, peak_mem_gib=peak_memory_gib(jax.devices()[0]))
    else:
        torch_vl(args, case, record, common, raw, tokens_pt, prompt_mask_pt, tokens_bt, attn_bt, loss_bt, old_logp,
                 rewards, patches_per_row)


def torch_vl(args, case, record, common, raw, tokens_pt, prompt_mask_pt, tokens_bt, attn_bt, loss_bt, old_logp,
             rewards, patches_per_row):
    """transformers' update step or `generate` on the same batch."""
    import numpy as np
    import torch
    import transformers

    from gpu.jax_phases import ratio
    from gpu.torch_phases import CLIP_EPS, _device

    device = _device()
    hf = hf_vl_dict(args.small)
    config = transformers.Qwen2_5_VLConfig(vision_config=hf["vision_config"], text_config=hf["text_config"],
                                           image_token_id=hf["image_token_id"], video_token_id=hf["video_token_id"],
                                           vision_start_token_id=hf["vision_start_token_id"],
                                           vision_end_token_id=hf["vision_end_token_id"],
                                           tie_word_embeddings=hf["tie_word_embeddings"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    rows, seq = tokens_bt.shape
    new = common["new"]
    pixels_p = torch.tensor(np.asarray(raw.pixel_values), device=device).view(PROMPTS, patches_per_row, -1)
    grid_p = torch.tensor(np.asarray(raw.grid_thw), device=device).view(PROMPTS, -1, 3)
    if case == "torch_update":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=device == "cuda")
        tokens = torch.tensor(tokens_bt, device=device).long()
        attn = torch.tensor(attn_bt, device=device).long()
        loss_mask = torch.tensor(loss_bt, device=device).float()
        old = torch.tensor(old_logp, device=device)
        grouped = torch.tensor(rewards, device=device).view(-1, SAMPLES)
        advantages = (grouped - grouped.mean(1, keepdim=True)).view(-1)
        pixels_r = pixels_p.repeat_interleave(SAMPLES, 0)
        grid_r = grid_p.repeat_interleave(SAMPLES, 0)
        norm, per = float(rows * new), rows // MICROBATCHES

        def step():
            opt.zero_grad(set_to_none=True)
            for i in range(MICROBATCHES):
                sl = slice(i * per, (i + 1) * per)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):  # CPU bf16: slow
                    logits = model(input_ids=tokens[sl], attention_mask=attn[sl],
                                   pixel_values=pixels_r[sl].reshape(-1, pixels_r.shape[-1]),
                                   image_grid_thw=grid_r[sl].reshape(-1, 3)).logits
                logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[sl, 1:, None])[..., 0]
                r = torch.exp(logp - old[sl, 1:])
                adv = advantages[sl, None]
                surrogate = torch.minimum(r * adv, r.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv)
                (-(surrogate * loss_mask[sl, 1:]).sum() / norm).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()

        first_s, med, times = timed_first(step, 1 if args.small else 4, args.budget * 0.4)
        tflops = linear_flops(args.small, rows * seq, rows * patches_per_row, True) / med / 1e12
        record(system="pytorch", **common, microbatches=MICROBATCHES, gradient_checkpointing=False,
               attention=model.config._attn_implementation, first_call_s=first_s, step_s=med, times=times,
               tokens_per_s=rows * seq / med, linear_tflops=tflops, mfu_linear=ratio(tflops, args.peak_tflops),
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
               torch=torch.__version__, transformers=transformers.__version__)
        return
    model = model.to(torch.bfloat16).eval()
    max_time = max(10.0, args.budget * 0.15)
    kwargs = dict(input_ids=torch.tensor(tokens_pt, device=device).long(),
                  attention_mask=torch.tensor(prompt_mask_pt, device=device).long(),
                  pixel_values=pixels_p.reshape(-1, pixels_p.shape[-1]).to(torch.bfloat16),
                  image_grid_thw=grid_p.reshape(-1, 3), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  max_new_tokens=new, min_new_tokens=new, num_return_sequences=SAMPLES, pad_token_id=0,
                  max_time=max_time)
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(**kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    made = int(out.shape[1] - tokens_pt.shape[1])
    record(system="transformers", **common, attention=model.config._attn_implementation, seconds=seconds,
           new_made=made, stopped_at_max_time=made < new, tokens_per_s=rows * made / seconds, max_time_s=max_time,
           peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)
