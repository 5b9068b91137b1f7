"""The rollout: prompts in, a `RolloutBatch` for the update step out (traceable).

    prompts [P, T] --sample (prefill once, while_loop decode)--> completions [P * n, C]
            --verifiers (io_callback: ids -> text -> pool -> float32)--> rewards [P * n]
            --[dynamic sampling: keep groups whose rewards differ]--> G groups of n rows
            --[what the objective declares it needs, e.g. a greedy baseline]--> RolloutBatch

What the objective needs beyond tokens, log-probs and rewards comes from
`AlgorithmConfig.needs` (declared by its registry entries); each need has its producer here, so
a new kind of rollout data adds its producer below (see docs/api/objectives.md for the rest).
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from rljax.data.filtering import dynamic_sample
from rljax.errors import ConfigError
from rljax.objectives.config import RolloutNeeds
from rljax.rewards.audit import audit_disputed, audit_metrics
from rljax.sampling import FINISH_LENGTH, SampleControls, SampleResult
from rljax.sampling.vision import sample_prompts
from rljax.update import RolloutBatch

PREVIEW_ROWS = 4


@flax.struct.dataclass
class RolloutPreview:
    """A few sampled rows for the sample log: the rows the audit disputes first (the training
    reward calls them correct, the audit does not: `rljax.rewards.audit.audit_disputed`), then one
    completion of each of the first prompts. disputed_k: bool, which rows are disputed (the loop
    logs the preview in any iteration that has one)."""

    prompt_tokens_kt: jax.Array
    prompt_mask_kt: jax.Array
    completion_tokens_kc: jax.Array
    completion_mask_kc: jax.Array
    rewards_k: jax.Array
    reward_parts_k: dict[str, jax.Array]
    prompt_index_k: jax.Array
    disputed_k: jax.Array | None = None


def _repeat_rows(x, n):
    return jnp.repeat(x, n, axis=0)


def greedy_baseline(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, key, *, controls: SampleControls,
                    reward_callback: Callable, images=None):
    """ReMax's baseline (Li et al., 2023): the reward of each prompt's greedy completion, [P]."""
    greedy = sample_prompts(cfg, params, prompt_tokens_pt, prompt_mask_pt, key, controls.greedy_version(), images)
    return reward_callback(greedy.tokens, greedy.mask, index_p).total_b


def rollout(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, key, *, controls: SampleControls,
            reward_callback: Callable, num_groups: int, needs: RolloutNeeds = RolloutNeeds(),
            dynamic_sampling: bool = False, images=None) -> tuple[RolloutBatch, dict[str, jax.Array], RolloutPreview]:
    """Sample, score and select: the update's `RolloutBatch` of `num_groups` x n rows, the
    `rollout/...` metrics (over every sampled row) and a preview of a few rows.

    P prompts are sampled (P > num_groups over-samples for dynamic sampling, DAPO 2025: groups
    whose rewards all agree are dropped, and missing groups are filled with masked copies).
    `images`: the prompts' `rljax.data.prompt_images.PromptImages` (None: text prompts); the
    tower runs once per prompt and each row of the batch carries its prompt's images.
    """
    # routing replay: the sampler records each token's experts (`SampleControls.record_routes`)
    out = sample_prompts(cfg, params, prompt_tokens_pt, prompt_mask_pt, key,
                         controls.replace(record_routes=True) if needs.routes else controls, images)
    return rollout_from_samples(cfg, params, out, prompt_tokens_pt, prompt_mask_pt, index_p, key, controls=controls,
                                reward_callback=reward_callback, num_groups=num_groups, needs=needs,
                                dynamic_sampling=dynamic_sampling, images=images)


def rollout_from_samples(cfg, params, out: SampleResult, prompt_tokens_pt, prompt_mask_pt, index_p, key, *,
                         controls: SampleControls, reward_callback: Callable, num_groups: int,
                         needs: RolloutNeeds = RolloutNeeds(), dynamic_sampling: bool = False, images=None
                         ) -> tuple[RolloutBatch, dict[str, jax.Array], RolloutPreview]:
    """`rollout` after its sampling: score and select completions `out` ([P * n, C], prompt-major)
    sampled elsewhere, e.g. by an interruptible rollout whose tokens came from several policy
    versions (`rljax.sampling.interruptible`). `out.logprobs` becomes `sampler_logp_bt`, each
    token's behaviour log-prob. `params` and `key` serve only a greedy baseline (`needs`)."""
    n = controls.num_samples
    rewards = reward_callback(out.tokens, out.mask, _repeat_rows(index_p, n))
    p = prompt_tokens_pt.shape[0]
    metrics: dict[str, jax.Array] = {}
    baseline_p = None
    if needs.greedy_baseline:
        baseline_p = greedy_baseline(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, key, controls=controls,
                                     reward_callback=reward_callback, images=images)
        metrics["rollout/baseline_reward_mean"] = jnp.mean(baseline_p)
    if dynamic_sampling:  # under ReMax a group is informative when a sample's reward differs from the greedy one
        sel = dynamic_sample(rewards.total_b.reshape(p, n), num_groups, baseline_p=baseline_p)
        groups_g, valid_g = sel.indices_g, sel.valid_g
        metrics.update({"rollout/dynamic_kept": sel.num_kept, "rollout/dynamic_padded": sel.num_padded,
                        "rollout/dynamic_dropped": sel.num_dropped})
    else:
        groups_g = jnp.arange(num_groups, dtype=jnp.int32)
        valid_g = jnp.ones((num_groups,), bool)
    rows = (groups_g[:, None] * n + jnp.arange(n)[None, :]).reshape(-1)
    take = lambda x: jnp.take(x, rows, axis=0)  # noqa: E731
    prompt_tokens = _repeat_rows(prompt_tokens_pt[groups_g], n)
    prompt_mask = _repeat_rows(prompt_mask_pt[groups_g], n)
    completion_mask = take(out.mask) & _repeat_rows(valid_g, n)[:, None]
    zeros = jnp.zeros(prompt_mask.shape, out.logprobs.dtype)
    baseline = None if baseline_p is None else _repeat_rows(baseline_p[groups_g], n)
    routes = None
    if needs.routes:  # the routing record, aligned with the tokens: prompt (prefill) then completion
        if out.routes is None or out.prompt_routes is None:
            raise ConfigError("algorithm.routing_replay='rollout' needs the sampler's routing record, which these "
                              "samples lack (sampled without SampleControls.record_routes): sample with "
                              "controls.replace(record_routes=True) or set algorithm.routing_replay='off'")
        routes = jnp.concatenate([take(out.prompt_routes), take(out.routes)], axis=1)
    batch = RolloutBatch(
        tokens_bt=jnp.concatenate([prompt_tokens, take(out.tokens)], axis=1),
        attn_mask_bt=jnp.concatenate([prompt_mask, take(out.mask)], axis=1),
        loss_mask_bt=jnp.concatenate([zeros.astype(bool), completion_mask], axis=1),
        sampler_logp_bt=jnp.concatenate([zeros, take(out.logprobs)], axis=1),
        rewards_b=take(rewards.total_b), group_ids_b=jnp.repeat(jnp.arange(num_groups), n),
        completion_len=controls.max_new_tokens, baseline_rewards_b=baseline,
        verifier_rewards_b=take(rewards.parts["correct"]) if "correct" in rewards.parts else None,
        routes_btlk=routes,
        vision=None if images is None else images.rows_for(groups_g, n, out.tokens.shape[1]))
    lengths = out.lengths.astype(jnp.float32)
    metrics.update({
        "rollout/reward_mean": jnp.mean(rewards.total_b),
        "rollout/reward_std": jnp.std(rewards.total_b),
        "rollout/length_mean": jnp.mean(lengths),
        "rollout/length_max": jnp.max(lengths),
        "rollout/clipped_frac": jnp.mean((out.finish_reason == FINISH_LENGTH).astype(jnp.float32)),
        # The sampler's decode steps and the share of their row-steps that decoded a running row
        # (the rest went to rows that had ended, or, continuous, to empty slots).
        "rollout/decode_steps": out.decode_steps.astype(jnp.float32),
        "rollout/slot_occupancy": out.live_row_steps / jnp.maximum(out.slot_steps, 1),
        "rollout/verifier_failed": jnp.sum(rewards.failed_b.astype(jnp.int32)),
        "rollout/tokens": jnp.sum(out.lengths),
    })
    metrics.update({f"rollout/reward_{k}": jnp.mean(v) for k, v in rewards.parts.items()})
    metrics.update(audit_metrics(rewards.parts))
    preview = rollout_preview(out, prompt_tokens_pt, prompt_mask_pt, index_p, rewards, n)
    return batch, metrics, preview


def rollout_preview(out: SampleResult, prompt_tokens_pt, prompt_mask_pt, index_p, rewards, n: int) -> RolloutPreview:
    """PREVIEW_ROWS rows of the P * n sampled: the audit's disputed rows in row order, then sample 0
    of prompts 0, 1, ... (all of them sample 0 of the first prompts when nothing is disputed)."""
    b = out.tokens.shape[0]
    k = min(PREVIEW_ROWS, b // n)
    disputed_b = audit_disputed(rewards.parts, b)
    rank_b = jnp.where(disputed_b, 0, jnp.where(jnp.arange(b) % n == 0, 1, 2))
    rows_k = jnp.argsort(rank_b, stable=True)[:k]
    prompts_k = rows_k // n
    return RolloutPreview(prompt_tokens_kt=prompt_tokens_pt[prompts_k], prompt_mask_kt=prompt_mask_pt[prompts_k],
                          completion_tokens_kc=out.tokens[rows_k], completion_mask_kc=out.mask[rows_k],
                          rewards_k=rewards.total_b[rows_k],
                          reward_parts_k={name: v[rows_k] for name, v in rewards.parts.items()},
                          prompt_index_k=index_p[prompts_k], disputed_k=disputed_b[rows_k])
