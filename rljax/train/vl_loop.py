"""`rljax train` for a vision-language policy (`[model.vision]` or a `qwen2_5_vl` checkpoint):

    policy   = build_vl_policy(...)                         tower + decoder (random init or HF)
    examples = data rows with images                        `data.source = "visual"`, or JSONL/Parquet
                                                            rows with an `image` column
    prompts  = prompt_batches(...)                          the text pipeline (grain), then the host
                                                            adds each row's images (`vl_prompts`)
    warm start: SFT on answer + EOS with the images          (`warm_start.steps`)
    for it in range(iterations):
        state, metrics = vl_iteration(state, prompts)       sample (tower once per prompt) -> verify
                                                            -> GRPO update over the text tokens
        every eval.every: greedy accuracy on the held-out split, with its images

A loop of its own beside `rljax.train.loop.train` (which dispatches here): the text drivers,
checkpoint resume, LoRA, mixtures and multi-device meshes do not take images yet, and each is
refused in one line (`check_vl_config`). The final policy is exported as a Qwen2.5-VL
checkpoint (`final/`, `rljax.models.vl_io.save_vl`).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax.data.pipeline import prompt_batches
from rljax.data.splits import heldout_split
from rljax.data.templates import PromptFormat, encode_prompts
from rljax.data.vl_rows import image_prompts, visual_examples
from rljax.errors import ConfigError
from rljax.models.scoring import token_logprobs
from rljax.models.setup import build_tokenizer, policy_config
from rljax.models.vl_io import save_vl
from rljax.models.vl_setup import build_vl_policy, is_vl_checkpoint
from rljax.optim import OptimConfig, make_optimizer
from rljax.rewards.callback import as_callback
from rljax.rewards.config import build_reward
from rljax.data.example import verifier_metadata
from rljax.sampling.vision import generate_vl
from rljax.stages.vl_iteration import check_image_controls, make_vl_iteration, vl_prompts
from rljax.storage import check_writable
from rljax.tokenizers import pad_batch
from rljax.train.config import TrainConfig
from rljax.train.metrics_writer import MetricsWriter, plot_curves
from rljax.train.setup import build_splits, prompt_format
from rljax.update import init_train_state


def is_vl_run(cfg: TrainConfig) -> bool:
    """Whether `cfg` trains a vision-language policy (or asks for image data)."""
    ckpt = cfg.model.checkpoint
    return cfg.model.vision.enabled or cfg.data.source == "visual" or (ckpt is not None and is_vl_checkpoint(ckpt))


def check_vl_config(cfg: TrainConfig, resume: bool) -> None:
    """One line for each setting a vision-language run does not take yet."""
    ckpt = cfg.model.checkpoint
    if not (cfg.model.vision.enabled or (ckpt is not None and is_vl_checkpoint(ckpt))):
        raise ConfigError("data.source='visual' has images but the model has no vision tower; set [model.vision] "
                          "depth >= 1 or load a qwen2_5_vl checkpoint")
    refusals = (
        (resume, "--resume", "start a new output_dir"),
        (cfg.data.is_mixture, "[[data.sources]] / data.selection", "one data source"),
        (cfg.env.enabled, "[env]", "no [env]"),
        (cfg.lora.enabled, "[lora]", "no [lora]"),
        (cfg.rl.dynamic_sampling, "rl.dynamic_sampling", "rl.dynamic_sampling=false"),
        (cfg.driver != "sync", f"rl.mode / driver {cfg.driver!r}", "rl.mode='sync'"),
        (cfg.mesh.sampler != "shared" or bool(cfg.mesh.sampler_devices), "a sampler mesh", "mesh.sampler='shared'"),
        (bool(cfg.warm_start.target_accuracy or cfg.warm_start.patience), "warm_start.target_accuracy / patience",
         "a fixed warm_start.steps (and max_seconds)"),
    )
    for on, what, fix in refusals:
        if on:
            raise ConfigError(f"a vision-language run does not take {what} yet; use {fix}")
    check_image_controls(cfg.sampling)


def vl_splits(cfg: TrainConfig) -> tuple[tuple, tuple]:
    """(train, held-out) examples with images: a generated visual task (disjoint by drawing), or
    the text sources' split of rows whose `image` column holds their pictures."""
    d = cfg.data
    if d.source == "visual":
        kw = dict(d.task_kwargs)
        size = int(kw.pop("image_size", 112))
        short = bool(kw.pop("short", False))
        if kw:
            raise ConfigError(f"data.task_kwargs {sorted(kw)} are unknown for a visual task; use image_size, short")
        return (visual_examples(d.task, "train", d.size, size=size, short=short),
                visual_examples(d.task, "test", d.eval_size, size=size, short=short))
    train, held, _ = build_splits(d)
    return train, held


def _decoder(tokenizer):
    """Ids -> text for the verifier; ids past the tokenizer's vocabulary (a from-scratch VLM's
    image tokens, if sampled) are dropped."""
    v = tokenizer.vocab_size
    return lambda batch: tokenizer.decode_batch([[i for i in ids if i < v] for ids in batch], skip_special=True)


def encoded(examples, tokenizer, fmt: PromptFormat, cfg: TrainConfig):
    """Left-padded prompt tokens of the examples that fit `data.max_prompt_tokens`."""
    enc = encode_prompts(examples, tokenizer, fmt, max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos)
    toks, mask = pad_batch(enc.ids, tokenizer.pad_id, side="left", length=cfg.data.max_prompt_tokens)
    return enc.examples, np.asarray(toks, np.int32), np.asarray(mask, bool)


def greedy_accuracy(vl_cfg, params, examples, tokenizer, fmt, cfg: TrainConfig, controls, reward_fn, *,
                    width: int, batch: int = 64) -> float:
    """Greedy accuracy on `examples` with their images (the verifier's `correct`)."""
    examples, toks, mask = encoded(examples, tokenizer, fmt, cfg)
    greedy = controls.greedy_version().replace(num_samples=1)
    decode = _decoder(tokenizer)
    solved = []
    for i in range(0, len(examples), batch):
        ex = examples[i:i + batch]
        p = image_prompts(vl_cfg, ex, toks[i:i + batch], mask[i:i + batch], pad_id=greedy.pad_id or 0, width=width)
        out = jax.device_get(generate_vl(vl_cfg, params, p.tokens_pt, p.mask_pt, p.pixel_values, p.grid_thw,
                                         key=jax.random.key(0), controls=greedy))
        texts = decode([row[msk].tolist() for row, msk in zip(out.tokens, out.mask)])
        rewards, _ = reward_fn.batch([verifier_metadata(e) for e in ex], texts)
        solved += list(np.asarray(rewards.parts.get("correct", rewards.total_b)) > 0.5)
    return float(np.mean(solved)) if solved else float("nan")


def warm_start_vl(vl_cfg, params, train_set, tokenizer, fmt, cfg: TrainConfig, width: int, log):
    """Supervised steps on answer + EOS given the prompt and its images (the text warm start's
    loss, `rljax.warmstart.sft.completion_nll`, with the tower spliced in)."""
    ws = cfg.warm_start
    if not ws.steps:
        return params
    examples, toks, mask = encoded(train_set, tokenizer, fmt, cfg)
    eos = list(tokenizer.eos_ids[:1])
    comp = [list(a) + eos for a in tokenizer.encode_batch([e.answer for e in examples])]
    c_len = min(max(map(len, comp)), cfg.sampling.max_new_tokens)
    c_tok, c_mask = pad_batch([c[:c_len] for c in comp], tokenizer.pad_id, side="right", length=c_len)
    c_tok, c_mask = np.asarray(c_tok, np.int32), np.asarray(c_mask, bool)
    tx = make_optimizer(OptimConfig(learning_rate=ws.learning_rate, warmup_steps=ws.warmup_steps))
    opt_state = tx.init(params)
    step = _sft_step(vl_cfg.text, tx)
    rng = np.random.default_rng(cfg.seed)
    controls = cfg.sampling.replace(num_samples=1)
    t0 = time.perf_counter()
    for s in range(ws.steps):
        idx = rng.choice(len(examples), size=min(ws.batch_size, len(examples)), replace=False)
        ex = [examples[i] for i in idx]
        t, m, _, rows = vl_prompts(vl_cfg, ex, toks[idx], mask[idx], controls, train_vision=cfg.model.train_vision,
                                   width=width)
        tokens = np.concatenate([t, c_tok[idx]], axis=1)
        attn = np.concatenate([m, c_mask[idx]], axis=1)
        loss = np.concatenate([np.zeros_like(m), c_mask[idx]], axis=1)
        rows = rows.replace(image_bt=jnp.concatenate([rows.image_bt, jnp.zeros(c_tok[idx].shape, bool)], axis=1))
        params, opt_state, nll = step(params, opt_state, tokens, attn, loss, rows)
        if (s + 1) % ws.check_every == 0 or s + 1 == ws.steps:
            log(f"warm start step {s + 1}: nll {float(nll):.4f} ({time.perf_counter() - t0:.1f}s)")
        if ws.max_seconds and time.perf_counter() - t0 > ws.max_seconds:
            break
    return params


def _sft_step(text_cfg, tx):
    def nll(params, tokens, attn, loss, rows):
        lm, kw = rows.splice(params)
        logp, _ = token_logprobs(text_cfg, lm, tokens, attn, **kw)
        w = loss.astype(jnp.float32)
        return -jnp.sum(logp * w) / jnp.maximum(w.sum(), 1.0)

    def step(params, opt_state, tokens, attn, loss, rows):
        value, grads = jax.value_and_grad(nll)(params, tokens, attn, loss, rows)
        updates, opt_state = tx.update(grads, opt_state, params)
        if not rows.train_vision:
            updates = {**updates, "visual": jax.tree.map(jnp.zeros_like, updates["visual"])}
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


@functools.cache
def _image_width(image_tokens: int, max_prompt: int) -> int:
    return -(-(max_prompt + image_tokens) // 8) * 8


def _width(vl_cfg, cfg: TrainConfig, examples) -> int:
    """The prompt width: data.max_prompt_tokens plus the examples' image blocks (rounded to 8), so
    same-size images compile once."""
    from rljax.data.images import image_tokens, preprocess
    from rljax.data.vl_rows import example_images

    most = 0
    for e in examples:
        _, grid = preprocess(example_images(e))
        most = max(most, sum(image_tokens(g) + 2 for g in grid))
    return _image_width(most, cfg.data.max_prompt_tokens)


def train_vl(cfg: TrainConfig, *, resume: bool = False, log=print):
    """Runs a vision-language `cfg` (see the module docstring): (output dir, state, history,
    start accuracy, final accuracy, plot), the fields of `rljax.train.loop.RunResult`."""
    check_vl_config(cfg, resume)
    out = check_writable(cfg.output_dir)
    k_init, _, k_loop = jax.random.split(jax.random.key(cfg.seed), 3)  # as the text run splits it
    tokenizer = build_tokenizer(cfg.model)
    text_cfg = None if cfg.model.checkpoint else policy_config(cfg.model, tokenizer)
    vl_cfg, params = build_vl_policy(cfg.model.vision, text_cfg, k_init, checkpoint=cfg.model.checkpoint,
                                     param_dtype=cfg.model.param_dtype, compute_dtype=cfg.model.compute_dtype)
    fmt = prompt_format(cfg.data)
    train_set, held_out = vl_splits(cfg)
    held_out = held_out[:cfg.eval.size]
    reward_fn = build_reward(cfg.reward)
    controls = cfg.sampling.with_tokenizer(tokenizer)
    log(f"model qwen2_5_vl {vl_cfg.num_params() / 1e6:.2f}M params (tower {vl_cfg.vision.num_params() / 1e6:.3f}M, "
        f"{'trained' if cfg.model.train_vision else 'frozen'}) | train {len(train_set)} / held-out {len(held_out)} "
        f"problems with images | {cfg.algorithm.algorithm}: {cfg.rl.iterations} iterations x "
        f"{cfg.rl.prompts_per_iteration} prompts x {controls.num_samples} samples")
    width = _width(vl_cfg, cfg, train_set[:8] + held_out[:8])
    params = warm_start_vl(vl_cfg, params, train_set, tokenizer, fmt, cfg, width, log)
    evaluate = lambda p: greedy_accuracy(vl_cfg, p, held_out, tokenizer, fmt, cfg, controls, reward_fn,  # noqa: E731
                                         width=width)
    data = prompt_batches(train_set, tokenizer=tokenizer, batch_size=cfg.rl.num_prompts, seed=cfg.data.seed,
                          max_prompt_len=cfg.data.max_prompt_tokens, fmt=fmt, add_bos=cfg.data.add_bos)
    callback = as_callback(reward_fn, _decoder(tokenizer), [verifier_metadata(e) for e in data.examples])
    state = init_train_state(vl_cfg.text, params, cfg.algorithm, cfg.optim, update_cfg=cfg.update, shaping=cfg.shaping)
    iteration = make_vl_iteration(vl_cfg, controls, callback)
    writer = MetricsWriter(out, tensorboard=cfg.metrics.tensorboard, wandb_project=cfg.metrics.wandb_project,
                           config=cfg.to_dict(), enabled=True, resume=False)
    start_accuracy = accuracy = evaluate(params) if held_out else None
    history: list[dict[str, Any]] = [{"step": 0, "eval/accuracy": start_accuracy}]
    writer.write(0, {"eval/accuracy": start_accuracy})
    log(f"start: held-out greedy accuracy {start_accuracy}")
    batches = iter(data.dataset)
    for it in range(cfg.rl.iterations):
        t0 = time.perf_counter()
        b = next(batches)
        toks, mask, inputs, rows = vl_prompts(vl_cfg, b.examples, b.tokens_bt, b.mask_bt, controls,
                                              train_vision=cfg.model.train_vision, width=width)
        state, metrics, _ = iteration(state, toks, mask, inputs, rows, b.indices_b.astype(np.int32),
                                      jax.random.fold_in(k_loop, it))
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        metrics["time/iteration_s"] = time.perf_counter() - t0
        step = it + 1
        if held_out and (step % cfg.eval.every == 0 or step == cfg.rl.iterations):
            accuracy = metrics["eval/accuracy"] = evaluate(state.params)
        writer.write(step, metrics)
        history.append({"step": step, **metrics})
        log(f"iteration {step}: reward {metrics['rollout/reward_mean']:.3f}"
            + (f" | eval/accuracy {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""))
    save_vl(vl_cfg, jax.device_get(state.params), out / "final")
    writer.close()
    plot = plot_curves(writer.read(), out / "curves.png")
    return out, state, history, start_accuracy, accuracy, plot
