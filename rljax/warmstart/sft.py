"""Supervised warm start: a short SFT phase on worked solutions before RL.

The loss is the mean negative log-likelihood of the completion tokens (answer + EOS) given the
prompt, computed with the same scoring function the RL update uses. Batches use the RL layout:
the prompt left-padded to P columns, the completion right-padded to C columns after it. Prompts
are encoded by `rljax.data.encode_prompts`, so a prompt over the data's `max_prompt_tokens` is
dropped as in RL, and P is at most that limit.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax.data.example import Example
from rljax.data.templates import PromptFormat, encode_prompts
from rljax.errors import DataError
from rljax.models import ModelConfig, token_logprobs
from rljax.tokenizers import pad_batch
from rljax.update.vision import freeze_tower


@dataclasses.dataclass(frozen=True)
class SFTPairs:
    """(prompt, reference answer + EOS) id pairs for the warm start; `prompt_len` (P) and
    `completion_len` (C) are the padded widths, `num_too_long` the prompts dropped by the limit."""

    examples: tuple[Example, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    completion_ids: tuple[tuple[int, ...], ...]
    prompt_len: int
    completion_len: int
    num_too_long: int


def sft_pairs(examples: Sequence[Example], tokenizer, fmt: PromptFormat, *, max_prompt_len: int, add_bos: bool,
              max_completion_len: int) -> SFTPairs:
    """Encodes the prompts (`encode_prompts`: over-long ones dropped) and the answers + EOS.

    P is the longest kept prompt (so at most `max_prompt_len`); C the longest completion, capped at
    `max_completion_len` (longer completions are cut at the end, like a sampled one)."""
    encoded = encode_prompts(examples, tokenizer, fmt, max_prompt_len=max_prompt_len, add_bos=add_bos)
    if not encoded.examples:
        raise DataError(f"warm start: all {len(examples)} prompts are longer than max_prompt_len={max_prompt_len}")
    eos = list(tokenizer.eos_ids[:1])
    completions = tuple(tuple(a + eos) for a in tokenizer.encode_batch([e.answer for e in encoded.examples]))
    return SFTPairs(encoded.examples, encoded.ids, completions, max(len(p) for p in encoded.ids),
                    min(max(len(c) for c in completions), max_completion_len), encoded.num_too_long)


def pack_prompt_completion(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                           pad_id: int, prompt_len: int, completion_len: int):
    """[prompt left-padded to P | completion right-padded to C] -> tokens, attn mask, loss mask."""
    p_tok, p_mask = pad_batch(prompt_ids, pad_id, side="left", length=prompt_len)
    c_tok, c_mask = pad_batch([c[:completion_len] for c in completion_ids], pad_id, side="right",
                              length=completion_len)
    tokens = np.concatenate([p_tok, c_tok], axis=1)
    attn = np.concatenate([p_mask, c_mask], axis=1)
    loss = np.concatenate([np.zeros_like(p_mask), c_mask], axis=1)
    return tokens, attn, loss


def with_images(images, examples, tokens_bt, attn_bt, loss_bt, prompt_len: int):
    """An SFT batch (prompt P columns | completion) with the prompts given their images by
    `images` (an `rljax.data.prompt_images.ImagePrompter`): (tokens, attn, loss, `VisionRows`),
    the image slots extended over the completion columns."""
    p_tok, p_mask, prompt_images = images(examples, tokens_bt[:, :prompt_len], attn_bt[:, :prompt_len])
    completion = tokens_bt.shape[1] - prompt_len
    tokens = np.concatenate([p_tok, tokens_bt[:, prompt_len:]], axis=1)
    attn = np.concatenate([p_mask, attn_bt[:, prompt_len:]], axis=1)
    loss = np.concatenate([np.zeros_like(p_mask), loss_bt[:, prompt_len:]], axis=1)
    return tokens, attn, loss, prompt_images.rows_for(np.arange(len(examples)), 1, completion)


def completion_nll(cfg: ModelConfig, params, tokens_bt, attn_bt, loss_bt, vision=None):
    """Mean NLL of the loss-masked (completion) tokens: the SFT loss. `vision`: the rows' images
    (`rljax.update.vision.VisionRows`, spliced as the RL update splices them; None: text rows)."""
    kw = {}
    if vision is not None:
        params, kw = vision.splice(params)
    logp_bt, _ = token_logprobs(cfg, params, tokens_bt, attn_bt, **kw)  # chunked from the shapes: bounded memory
    w = loss_bt.astype(jnp.float32)
    return -jnp.sum(logp_bt * w) / jnp.maximum(w.sum(), 1.0)


def make_sft_step(cfg: ModelConfig, optimizer: optax.GradientTransformation):
    """A jitted SFT step: (params, opt_state, tokens, attn_mask, loss_mask, vision=None) ->
    (params, opt_state, nll); image rows' frozen tower gets no update (`freeze_tower`)."""

    def step(params, opt_state, tokens_bt, attn_bt, loss_bt, vision=None):
        nll, grads = jax.value_and_grad(functools.partial(completion_nll, cfg))(params, tokens_bt, attn_bt, loss_bt,
                                                                                 vision)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, freeze_tower(updates, vision)), opt_state, nll

    return jax.jit(step, donate_argnums=(0, 1))


def stop_reason(accuracies: Sequence[float], *, target: float, patience: int, min_delta: float,
                nlls: Sequence[float] | None = None, nll_rel_delta: float = 0.01) -> str | None:
    """Why the warm start stops after these validation checks, or None to go on.

        "target": the last accuracy >= target (target > 0)
        "plateau": neither validation signal improved in the last `patience` checks (patience > 0):
                   max(acc[-patience:]) < max(acc[:-patience]) + min_delta, and (given `nlls`,
                   the validation NLL at the same checks)
                   min(nll[-patience:]) > min(nll[:-patience]) * (1 - nll_rel_delta)

    The plateau rule makes the warm start robust to a target the task cannot reach within the
    budget: without it such a task spends every step overfitting the warm-start pool (and the
    budget RL would have had). Greedy accuracy alone is a poor witness early on: at 0-6% it moves
    by noise while the model is still learning (issue 24: decimal_chain_sum stopped at step 550
    at 6% while its validation NLL was still falling), so the rule also asks the validation NLL,
    a smooth signal, to have stopped falling by `nll_rel_delta` (relative). A first check counts
    as an improvement over nothing.
    """
    if not accuracies:
        return None
    if target and accuracies[-1] >= target:
        return "target"
    if patience and len(accuracies) > patience:
        accuracy_stalled = max(accuracies[-patience:]) < max(accuracies[:-patience]) + min_delta
        nll_stalled = nlls is None or min(nlls[-patience:]) > min(nlls[:-patience]) * (1.0 - nll_rel_delta)
        if accuracy_stalled and nll_stalled:
            return "plateau"
    return None


def make_nll_eval(cfg: ModelConfig):
    """A jitted (params, tokens, attn mask, loss mask) -> `completion_nll`, the SFT loss without
    the gradient: the warm start's validation NLL."""
    return jax.jit(functools.partial(completion_nll, cfg))


def constant_answer_baseline(examples: Sequence[Example]) -> tuple[str, float]:
    """The best accuracy a policy that ignores the question can reach: the most common reference
    answer `a*` and the fraction of `examples` it solves, max_a |{e : e.answer = a}| / |examples|.

    A warm-start target is only evidence of skill above this: answering `2` solves about 30% of
    reasoning-gym's gcd pairs, so an absolute 30% target can stop a warm start on a constant
    policy, whose groups' rewards carry no signal about the question."""
    if not examples:
        return "", 0.0
    answer, count = Counter(e.answer.strip() for e in examples).most_common(1)[0]
    return answer, count / len(examples)


def relative_target(target: float, baseline: float) -> float:
    """The accuracy that stands for `target` above the constant-answer baseline b:
    b + target * (1 - b), i.e. a normalised gain (acc - b) / (1 - b) >= target (Hake, 1998).
    Equals `target` when no answer repeats (b = 0); 0 stays 0 (no target)."""
    return baseline + target * (1.0 - baseline) if target > 0 else 0.0


def run_warm_start(cfg, model_cfg: ModelConfig, params, tokenizer, examples, fmt, key: jax.Array, *,
                   validation=None, images=None, log=print):
    """Up to `cfg.warm_start.steps` SFT steps on (prompt, reference answer + EOS) pairs; returns params.

    With `target_accuracy` > 0 the warm start stops as soon as greedy accuracy on `validation` (an
    `EvalSetup` over *training* problems, never the held-out split) reaches it, checked every
    `check_every` steps, so RL starts from a policy that solves some problems but not most;
    the target counts skill above the validation set's constant-answer baseline
    (`relative_target`), so a policy that answers the most common answer to everything never meets it;
    with `patience` > 0 it also stops when that accuracy plateaus (`stop_reason`). The reason it
    stopped (target, plateau, time budget, step budget) is logged.
    Batches are drawn with a seed derived from `key`, so the warm start is deterministic.
    """
    from rljax.evaluation.runner import greedy_accuracy
    from rljax.optim import OptimConfig, make_optimizer

    ws = cfg.warm_start
    optimizer = make_optimizer(OptimConfig(learning_rate=ws.learning_rate, warmup_steps=ws.warmup_steps,
                                           schedule="constant", max_grad_norm=1.0))
    pairs = sft_pairs(examples, tokenizer, fmt, max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos,
                      max_completion_len=cfg.sampling.max_new_tokens)
    if pairs.num_too_long:
        log(f"warm start: dropped {pairs.num_too_long} prompts longer than {cfg.data.max_prompt_tokens} tokens")
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
    step = make_sft_step(model_cfg, optimizer)
    opt_state = optimizer.init(params)
    nll = float("nan")
    start = time.perf_counter()
    accuracies: list[float] = []
    target = ws.target_accuracy
    if target and validation is not None:
        answer, baseline = constant_answer_baseline(validation.examples)
        target = relative_target(ws.target_accuracy, baseline)
        log(f"warm start target {target:.3f}: {ws.target_accuracy:g} of the way from the constant answer "
            f"{answer!r} (solves {baseline:.3f} of the validation problems) to 1")
    nlls: list[float] = []
    validation_nll = None
    if (target or ws.patience) and validation is not None and validation.examples:
        held = sft_pairs(validation.examples, tokenizer, fmt, max_prompt_len=cfg.data.max_prompt_tokens,
                         add_bos=cfg.data.add_bos, max_completion_len=cfg.sampling.max_new_tokens)
        held_batch = pack_prompt_completion(held.prompt_ids, held.completion_ids, tokenizer.pad_id,
                                            held.prompt_len, held.completion_len)
        nll_eval = make_nll_eval(model_cfg)
        validation_nll = lambda p: float(nll_eval(p, *held_batch))  # noqa: E731
    reason = f"step budget ({ws.steps} steps)"
    for i in range(ws.steps):
        if ws.max_seconds and time.perf_counter() - start > ws.max_seconds:
            reason = f"time budget ({ws.max_seconds:.0f} s) at step {i}"
            break
        idx = rng.integers(0, len(pairs.examples), ws.batch_size)
        tokens, attn, loss = pack_prompt_completion([pairs.prompt_ids[j] for j in idx],
                                                    [pairs.completion_ids[j] for j in idx], tokenizer.pad_id,
                                                    pairs.prompt_len, pairs.completion_len)
        vision = None
        if images is not None:  # the prompts' pictures (`rljax.data.prompt_images.ImagePrompter`)
            tokens, attn, loss, vision = with_images(images, [pairs.examples[j] for j in idx], tokens, attn, loss,
                                                     pairs.prompt_len)
        params, opt_state, nll = step(params, opt_state, tokens, attn, loss, vision)
        if (target or ws.patience) and validation is not None and (i + 1) % ws.check_every == 0:
            accuracies.append(greedy_accuracy(validation, params))
            nlls.append(validation_nll(params) if validation_nll else float("nan"))
            log(f"warm start {i + 1}/{ws.steps}: nll {float(nll):.3f}, validation nll {nlls[-1]:.3f}, "
                f"accuracy {accuracies[-1]:.3f}")
            why = stop_reason(accuracies, target=target, patience=ws.patience, min_delta=ws.min_delta,
                              nlls=nlls if validation_nll else None, nll_rel_delta=ws.nll_rel_delta)
            if why is not None:
                reason = (f"target accuracy {target:.3f} reached" if why == "target" else
                          f"validation accuracy plateaued at {max(accuracies):.3f} ({ws.patience} checks without "
                          f"+{ws.min_delta:g}, nor the validation nll {min(nlls):.3f} -{ws.nll_rel_delta:.0%})"
                          ) + f" at step {i + 1}"
                break
        elif (i + 1) % max(ws.steps // 5, 1) == 0:
            log(f"warm start {i + 1}/{ws.steps}: nll {float(nll):.3f}")
    log(f"warm start stopped: {reason}")
    return params
