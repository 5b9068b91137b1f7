"""One RL iteration as one compiled function: sample -> score -> advantages -> update.

    prompts [P, T] --sampler (prefill once, while_loop decode)--> completions [P * n, C]
            --verifiers (io_callback: ids -> text -> pool -> float32)--> rewards [P * n]
            --[dynamic sampling: keep groups whose rewards differ]--> a batch of G groups
            --update_step (advantages, epochs x mini-batches x micro-batches, optax)--> new state

No Python runs between the stages: the host is visited once, inside the verifier callback, and
the whole iteration is compiled once per prompt bucket. The train state is donated.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from rljax.data.filtering import dynamic_sample
from rljax.sampling import SampleControls, sample
from rljax.update import Batch, TrainState
from rljax.update import _update_step as update_step_fn


def _repeat_rows(x, n):
    return jnp.repeat(x, n, axis=0)


def make_iteration(controls: SampleControls, reward_callback: Callable, *, num_groups: int,
                   dynamic_sampling: bool = False, greedy_baseline: bool = False):
    """Builds `iteration(state, prompt_tokens_pt, prompt_mask_pt, index_p, key) -> (state, metrics)`.

    P prompts are sampled (P > num_groups over-samples for dynamic sampling); `num_groups` groups
    of `controls.num_samples` rows go to the update. `greedy_baseline` also decodes each prompt
    greedily and scores it, for ReMax's baseline.
    """
    n = controls.num_samples

    def iteration(state: TrainState, prompt_tokens_pt, prompt_mask_pt, index_p, key):
        cfg = state.model_cfg
        k_sample, k_update = jax.random.split(key)
        out = sample(cfg, state.params, prompt_tokens_pt, prompt_mask_pt, k_sample, controls)
        rewards = reward_callback(out.tokens, out.mask, _repeat_rows(index_p, n))
        p = prompt_tokens_pt.shape[0]
        rewards_pn = rewards.total_b.reshape(p, n)
        metrics = {}
        if dynamic_sampling:
            sel = dynamic_sample(rewards_pn, num_groups)
            groups_g, valid_g = sel.indices_g, sel.valid_g
            metrics.update({"dynamic/kept": sel.num_kept, "dynamic/padded": sel.num_padded,
                            "dynamic/dropped": sel.num_dropped})
        else:
            groups_g = jnp.arange(num_groups, dtype=jnp.int32)
            valid_g = jnp.ones((num_groups,), bool)
        rows = (groups_g[:, None] * n + jnp.arange(n)[None, :]).reshape(-1)
        take = lambda x: jnp.take(x, rows, axis=0)  # noqa: E731
        completion_mask = take(out.mask) & _repeat_rows(valid_g, n)[:, None]
        tokens = jnp.concatenate([_repeat_rows(prompt_tokens_pt[groups_g], n), take(out.tokens)], axis=1)
        attn = jnp.concatenate([_repeat_rows(prompt_mask_pt[groups_g], n), take(out.mask)], axis=1)
        zeros = jnp.zeros(_repeat_rows(prompt_mask_pt[groups_g], n).shape, out.logprobs.dtype)
        baseline = None
        if greedy_baseline:
            greedy = sample(cfg, state.params, prompt_tokens_pt, prompt_mask_pt, k_sample,
                            controls.greedy_version())
            baseline = reward_callback(greedy.tokens, greedy.mask, index_p).total_b
            baseline = _repeat_rows(baseline[groups_g], n)
        batch = Batch(
            tokens_bt=tokens, attn_mask_bt=attn,
            loss_mask_bt=jnp.concatenate([zeros.astype(bool), completion_mask], axis=1),
            old_logp_bt=jnp.concatenate([zeros, take(out.logprobs)], axis=1),
            rewards_b=take(rewards.total_b), group_ids_b=jnp.repeat(jnp.arange(num_groups), n),
            baseline_rewards_b=baseline)
        state, update_metrics = update_step_fn(state, batch, k_update)
        lengths = out.lengths.astype(jnp.float32)
        metrics.update(update_metrics)
        metrics.update({
            "reward/mean": jnp.mean(rewards.total_b),
            "reward/std": jnp.std(rewards.total_b),
            "completion/length_mean": jnp.mean(lengths),
            "completion/length_max": jnp.max(lengths),
            "completion/clipped_frac": jnp.mean((out.finish_reason == 0).astype(jnp.float32)),
            "verifier/failed": jnp.sum(rewards.failed_b.astype(jnp.int32)),
            "tokens/generated": jnp.sum(out.lengths),
        })
        metrics.update({f"reward/{k}": jnp.mean(v) for k, v in rewards.parts.items()})
        return state, metrics

    return jax.jit(iteration, donate_argnums=(0,))
