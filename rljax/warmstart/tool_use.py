"""Supervised warm start on scripted tool-use demonstrations, before multi-turn RL.

The single-turn warm start (`rljax.warmstart.sft`) teaches the reference answer. With a tool
the demonstration is an episode: the model calls the tool on the problem's expression, reads the
result and answers with it,

    361 * 220 =  <tool>361 * 220</tool>  <result>79420</result>  79420<eos>
    [prompt]     [model]                 [environment]           [model]

played by the environment itself (`rljax.envs.run_episode` with a scripted policy), so the
observation is exactly what the rollout will show, and kept only when the environment scores the
answer correct. Each segment is encoded on its own, as the rollout writes it, and the loss is the
mean negative log-likelihood of the model's tokens only (`rljax.envs.loss_mask`): the
observation is context, never a target, as in RL. The SFT step is the single-turn warm start's.

As there, `target_accuracy` > 0 stops the warm start once greedy *episodes* on training problems
(never the held-out split) reach it, so RL starts from a policy that uses the tool on some
problems but not most.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rljax import envs
from rljax.data.example import Example
from rljax.data.templates import PromptFormat, encode_prompts
from rljax.errors import ConfigError, DataError
from rljax.tokenizers import pad_batch
from rljax.warmstart.sft import make_sft_step


def call_input(example: Example | dict) -> str:
    """What the demonstration passes to the tool: the example's ``expression`` metadata (e.g.
    reasoning-gym's arithmetic tasks), else its question."""
    meta = example if isinstance(example, dict) else {**dict(example.metadata or {}), "question": example.question}
    return str(meta.get("expression") or meta["question"])


def demonstration(env: envs.ToolEnv, example: Any) -> envs.Transcript | None:
    """One scripted episode: call the default tool on `call_input(example)`, then answer with its
    output. None when the environment does not score the answer correct (or the tool failed)."""
    fmt, tool = env.format, env.tools[0]
    call = fmt.render_call(tool.name, {tool.argument if fmt.json_calls else "input": call_input(example)})

    def policy(text: str) -> str:
        if not text.endswith(fmt.observation_suffix) or fmt.observation_prefix not in text:
            return call
        output = text[text.rindex(fmt.observation_prefix) + len(fmt.observation_prefix):-len(fmt.observation_suffix)]
        return output + fmt.end_of_turn

    episode = envs.run_episode(env, example, policy, prompt="", max_steps=2)
    ok = (len(episode.results) == 2 and episode.results[-1].kind == "answer" and not episode.results[0].tool_error
          and episode.total_reward >= 1.0)
    return episode.transcript if ok else None


def demonstration_batch(examples: Sequence[Example], env: envs.ToolEnv, tokenizer, fmt: PromptFormat, *,
                        max_prompt_len: int, add_bos: bool, max_episode_tokens: int):
    """(tokens_bt, attn_bt, loss_bt) for every example with a correct demonstration: the prompt
    left-padded to P, the episode (+ EOS) right-padded to `max_episode_tokens`, loss on model
    tokens. Episodes longer than the budget are dropped (they would be cut in RL too)."""
    encoded = encode_prompts(examples, tokenizer, fmt, max_prompt_len=max_prompt_len, add_bos=add_bos)
    eos = int(tokenizer.eos_ids[0])
    prompts, episodes, authors = [], [], []
    for example, prompt_ids in zip(encoded.examples, encoded.ids):
        transcript = demonstration(env, example)
        if transcript is None:
            continue
        ids, author = envs.encode_transcript(transcript, tokenizer.encode)
        if len(ids) + 1 > max_episode_tokens:
            continue
        prompts.append(prompt_ids)
        episodes.append([*ids.tolist(), eos])
        authors.append([*author.tolist(), envs.MODEL])
    if not prompts:
        raise DataError(f"tool warm start: none of {len(examples)} demonstrations was scored correct within "
                        f"{max_episode_tokens} tokens; check env.name, the data's expression field and the budget")
    p_tok, p_mask = pad_batch(prompts, tokenizer.pad_id, side="left", length=max(len(p) for p in prompts))
    e_tok, e_mask = pad_batch(episodes, tokenizer.pad_id, side="right", length=max_episode_tokens)
    author_bt, _ = pad_batch(authors, envs.PAD, side="right", length=max_episode_tokens)
    tokens = np.concatenate([p_tok, e_tok], axis=1)
    attn = np.concatenate([p_mask, e_mask], axis=1)
    loss = np.concatenate([np.zeros_like(p_mask), envs.loss_mask(author_bt, bool)], axis=1)
    return tokens, attn, loss


def run_tool_warm_start(cfg, model_cfg, params, tokenizer, examples, fmt, env, key: jax.Array, *,
                        accuracy=None, max_demonstrations: int = 4096, log=print):
    """Up to `cfg.warm_start.steps` SFT steps on demonstrations of the first `max_demonstrations`
    examples; returns params. `accuracy(params) -> float` (greedy episodes on training problems)
    is checked every `check_every` steps when `target_accuracy` > 0."""
    from rljax.optim import OptimConfig, make_optimizer

    ws = cfg.warm_start
    if not isinstance(env, envs.ToolEnv):
        raise ConfigError(f"warm_start with env.name={cfg.env.name!r}: scripted demonstrations need a tool "
                          f"environment (calculator, python, reasoning_gym_tool); set warm_start.steps=0")
    tokens, attn, loss = demonstration_batch(examples[:max_demonstrations], env, tokenizer, fmt,
                                             max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos,
                                             max_episode_tokens=cfg.env.max_episode_tokens)
    log(f"tool warm start: {len(tokens)} demonstrations, {int(loss.sum())} model tokens, "
        f"{int(attn.sum() - loss.sum())} prompt and environment tokens")
    optimizer = make_optimizer(OptimConfig(learning_rate=ws.learning_rate, warmup_steps=ws.warmup_steps,
                                           schedule="constant", max_grad_norm=1.0))
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
    step = make_sft_step(model_cfg, optimizer)
    opt_state = optimizer.init(params)
    start = time.perf_counter()
    for i in range(ws.steps):
        if ws.max_seconds and time.perf_counter() - start > ws.max_seconds:
            log(f"tool warm start stopped at step {i} after {ws.max_seconds:.0f} s")
            break
        idx = rng.integers(0, len(tokens), ws.batch_size)
        params, opt_state, nll = step(params, opt_state, tokens[idx], attn[idx], loss[idx])
        if ws.target_accuracy and accuracy is not None and (i + 1) % ws.check_every == 0:
            acc = accuracy(params)
            log(f"tool warm start {i + 1}/{ws.steps}: nll {float(nll):.3f}, validation accuracy {acc:.3f}")
            if acc >= ws.target_accuracy:
                break
        elif (i + 1) % max(ws.steps // 5, 1) == 0:
            log(f"tool warm start {i + 1}/{ws.steps}: nll {float(nll):.3f}")
    return params
