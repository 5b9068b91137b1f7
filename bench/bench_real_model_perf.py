"""CPU throughput on the real model (SmolLM2-135M-Instruct, dequantised from its GGUF), one process,
same weights: rljax's sampler vs transformers' `generate`, and rljax's compiled update step vs a
PyTorch forward + backward + AdamW step, at the `smollm2_arith` recipe's shapes (chat prompts of
the task, `--batch` rows, `--new-tokens` sampled tokens). rljax in f32 and in bf16 compute, which
is how the recipe's dtype was chosen. Called by `bench/real_model_learning.py perf`.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time

import numpy as np

REPEATS = 2
LR = 1e-5


def _prompts(tok, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded chat prompts of the recipe's task, as the run encodes them."""
    from rljax.tokenizers import pad_batch

    rng = random.Random(0)
    texts = [tok.apply_chat_template([
        {"role": "system", "content": "You are a calculator. Reply with the number only."},
        {"role": "user", "content": f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}?"}],
        add_generation_prompt=True) for _ in range(batch)]
    tokens, mask = pad_batch(tok.encode_batch(texts), tok.pad_id, side="left")
    return np.asarray(tokens, np.int32), np.asarray(mask, bool)


def _timed(fn, repeats=REPEATS):
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return first, statistics.median(times)


def rljax_sampling(cfg, params, tokens, mask, new):
    import jax

    from rljax.sampling import SampleControls, generate

    controls = SampleControls(max_new_tokens=new, temperature=1.0, eos_ids=(), pad_id=0)

    def run():
        r = generate(cfg, params, tokens, mask, key=jax.random.key(0), controls=controls)
        r.tokens.block_until_ready()
    return _timed(run)


def torch_generate(model, tokens, mask, new):
    import torch

    ids, attn = torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def run():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=attn, do_sample=True, use_cache=True, max_new_tokens=new,
                           min_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=2)
    return _timed(run)


def _batch(tokens, mask, new, seed=0):
    """A rollout-shaped batch: the prompts plus `new` random completion tokens, loss on those."""
    rng = np.random.default_rng(seed)
    b, p = tokens.shape
    toks = np.concatenate([tokens, rng.integers(0, 49152, (b, new)).astype(np.int32)], 1)
    attn = np.concatenate([mask, np.ones((b, new), bool)], 1)
    loss = np.zeros_like(attn)
    loss[:, p:] = True
    old = (-rng.random(toks.shape) * 3).astype(np.float32)
    rewards = rng.integers(0, 2, b).astype(np.float32)
    return toks, attn, loss, old, rewards


def rljax_update(cfg, params, data, new):
    import jax
    import jax.numpy as jnp

    from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
    from rljax.optim import OptimConfig
    from rljax.update import RolloutBatch, UpdateConfig, init_train_state, update_step

    toks, attn, loss, old, rewards = data
    batch = RolloutBatch(jnp.asarray(toks), jnp.asarray(attn), jnp.asarray(loss), jnp.asarray(old),
                         jnp.asarray(rewards), prompt_major_group_ids(len(toks), 8), completion_len=new)
    state = init_train_state(cfg, jax.tree.map(jnp.copy, params), AlgorithmConfig(algorithm="grpo", kl_coef=0.0),
                             OptimConfig(learning_rate=LR, max_grad_norm=1.0), update_cfg=UpdateConfig())
    box = {"state": state}

    def run():
        box["state"], m = update_step(box["state"], batch, jax.random.key(0))
        jax.block_until_ready((box["state"].params, m))
    return _timed(run)


def torch_update(model, data):
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    toks, attn, loss_mask, old, rewards = (torch.from_numpy(np.asarray(x)) for x in data)
    g = rewards.view(-1, 8)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).reshape(-1)
    mask, tgt = loss_mask[:, 1:].float(), toks[:, 1:].long()

    def run():
        logits = model(input_ids=toks.long(), attention_mask=attn.long()).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tgt[..., None])[..., 0]
        ratio = torch.exp(logp - old[:, 1:])
        per_tok = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.2))
        loss = (per_tok * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return _timed(run)


def perf(args, machine) -> dict:
    import os

    import torch
    import transformers

    from rljax.models import load_gguf, resolve_checkpoint, save_hf
    from rljax.tokenizers import gguf_tokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    before = machine()
    path = resolve_checkpoint("smollm2-135m-instruct")
    tok = gguf_tokenizer(path)
    tokens, mask = _prompts(tok, args.batch)
    new = args.new_tokens
    rows, sampled = tokens.shape[0], tokens.shape[0] * new
    trained = rows * (tokens.shape[1] + new)
    out = {"batch": rows, "prompt_tokens": int(tokens.shape[1]), "new_tokens": new,
           "update_tokens_per_step": trained, "repeats": REPEATS, "machine_before": before,
           "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads()}
    for dtype in ("float32", "bfloat16"):
        cfg, params = load_gguf(path, compute_dtype=dtype)
        first, s = rljax_sampling(cfg, params, tokens, mask, new)
        out[f"rljax_{dtype}_sampling"] = {"tokens_per_s": round(sampled / s, 1), "s": round(s, 2),
                                          "first_call_s": round(first, 1)}
        print(dtype, "sampling", out[f"rljax_{dtype}_sampling"], flush=True)
        first, s = rljax_update(cfg, params, _batch(tokens, mask, new), new)
        out[f"rljax_{dtype}_update"] = {"tokens_per_s": round(trained / s, 1), "s": round(s, 2),
                                        "first_call_s": round(first, 1)}
        print(dtype, "update", out[f"rljax_{dtype}_update"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(cfg, params, tmp)  # the same dequantised weights (f32 params) for PyTorch
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    first, s = torch_generate(model, tokens, mask, new)
    out["transformers_generate"] = {"tokens_per_s": round(sampled / s, 1), "s": round(s, 2)}
    print("transformers generate", out["transformers_generate"], flush=True)
    first, s = torch_update(model, _batch(tokens, mask, new))
    out["torch_update"] = {"tokens_per_s": round(trained / s, 1), "s": round(s, 2)}
    print("torch update", out["torch_update"], flush=True)
    out["machine_after"] = machine()
    return out
