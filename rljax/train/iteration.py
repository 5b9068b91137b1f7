"""One RL iteration: sample -> score -> advantages -> update, compiled as one or two programs.

    prompts [P, T] --sampler (prefill once, while_loop decode)--> completions [P * n, C]
            --verifiers (io_callback: ids -> text -> pool -> float32)--> rewards [P * n]
            --[dynamic sampling: keep groups whose rewards differ]--> a batch of G groups
            --update_step (advantages, epochs x mini-batches x micro-batches, optax)--> new state

`make_iteration` compiles all of it as ONE program: no Python runs between the stages, the host
is visited once (inside the verifier callback), and the train state is donated.

`make_split_iteration` is the same iteration when the sampler has its own layout (e.g. params
replicated over data-parallel sampler replicas, split over tensor-parallel heads): the trainer's
params are resharded on device into the sampler layout (`rljax.sharding.sync_weights`, timed as
weight-sync seconds), a sampling program builds the update `Batch` there, and the update program
runs in the trainer layout. Both forms build the batch with the same `rollout` and draw the same
keys, so they give the same result.

Across processes both forms work unchanged: inputs are global arrays and the verifier callback
runs once, on the process that holds device 0, which sees every row (every process holds the
same example table).
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rljax.data.filtering import dynamic_sample
from rljax.sampling import SampleControls, sample
from rljax.sharding import Layout, sync_weights
from rljax.sharding.rules import batch_axes
from rljax.update import Batch, TrainState
from rljax.update import _update_step as update_step_fn


def _repeat_rows(x, n):
    return jnp.repeat(x, n, axis=0)


def rollout(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, key, *, controls: SampleControls,
            reward_callback: Callable, num_groups: int, dynamic_sampling: bool = False,
            greedy_baseline: bool = False) -> tuple[Batch, dict]:
    """Sample, score and select groups: the update `Batch` of `num_groups` x n rows, and metrics.

    Traceable. P prompts are sampled (P > num_groups over-samples for dynamic sampling, DAPO
    2025); `greedy_baseline` also decodes each prompt greedily and scores it, for ReMax's
    baseline (Li et al., 2023).
    """
    n = controls.num_samples
    out = sample(cfg, params, prompt_tokens_pt, prompt_mask_pt, key, controls)
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
        greedy = sample(cfg, params, prompt_tokens_pt, prompt_mask_pt, key, controls.greedy_version())
        baseline = reward_callback(greedy.tokens, greedy.mask, index_p).total_b
        baseline = _repeat_rows(baseline[groups_g], n)
    batch = Batch(
        tokens_bt=tokens, attn_mask_bt=attn,
        loss_mask_bt=jnp.concatenate([zeros.astype(bool), completion_mask], axis=1),
        old_logp_bt=jnp.concatenate([zeros, take(out.logprobs)], axis=1),
        rewards_b=take(rewards.total_b), group_ids_b=jnp.repeat(jnp.arange(num_groups), n),
        baseline_rewards_b=baseline)
    lengths = out.lengths.astype(jnp.float32)
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
    return batch, metrics


def _rollout_fn(controls, reward_callback, num_groups, dynamic_sampling, greedy_baseline):
    def fn(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, key):
        return rollout(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, key, controls=controls,
                       reward_callback=reward_callback, num_groups=num_groups,
                       dynamic_sampling=dynamic_sampling, greedy_baseline=greedy_baseline)
    return fn


def make_iteration(controls: SampleControls, reward_callback: Callable, *, num_groups: int,
                   dynamic_sampling: bool = False, greedy_baseline: bool = False, layout: Layout | None = None):
    """Builds `iteration(state, prompt_tokens_pt, prompt_mask_pt, index_p, key) -> (state, metrics)`,
    ONE jitted program with the state donated. With a `layout` (the trainer's), the new state comes
    back in it and the metrics come back replicated (readable on every process)."""
    roll = _rollout_fn(controls, reward_callback, num_groups, dynamic_sampling, greedy_baseline)

    def iteration(state: TrainState, prompt_tokens_pt, prompt_mask_pt, index_p, key):
        k_sample, k_update = jax.random.split(key)
        batch, metrics = roll(state.model_cfg, state.params, prompt_tokens_pt, prompt_mask_pt, index_p, k_sample)
        state, update_metrics = update_step_fn(state, batch, k_update)
        metrics = {**update_metrics, **metrics}
        if layout is not None:
            # Pin the outputs: the state leaves as it came (so the next call hits the compile
            # cache instead of recompiling for an equivalent inferred layout), metrics replicated.
            state = jax.lax.with_sharding_constraint(state, layout.tree(state))
            metrics = jax.lax.with_sharding_constraint(metrics, layout.replicated)
        return state, metrics

    return jax.jit(iteration, donate_argnums=(0,))


def make_split_iteration(controls: SampleControls, reward_callback: Callable, state: TrainState, *,
                         num_prompts: int, num_groups: int, trainer: Layout, sampler: Layout,
                         dynamic_sampling: bool = False, greedy_baseline: bool = False):
    """Builds `iteration(state, prompt_tokens_pt, prompt_mask_pt, index_p, key) -> (state, metrics)`
    as weight sync -> sampling program (sampler layout) -> update program (trainer layout).

    `state` is a template (shapes and trainer shardings are taken from it). The prompts should
    arrive in the sampler layout (`sampler.batch`). Metrics add host timings: `time/weight_sync_s`
    (the on-device reshard of the params), `time/sample_s` (sampling, verifier callback included)
    and `time/update_s`.
    """
    roll = _rollout_fn(controls, reward_callback, num_groups, dynamic_sampling, greedy_baseline)
    cfg = state.model_cfg
    rows = num_groups * controls.num_samples

    def rows_sharding(layout: Layout, size: int) -> NamedSharding:
        return NamedSharding(layout.mesh, P(batch_axes(layout.mesh, size)))

    sampler_params_sh = sampler.params(state.params)
    state_shardings = trainer.tree(state)

    def sample_program(params, prompt_tokens_pt, prompt_mask_pt, index_p, key):
        k_sample, _ = jax.random.split(key)
        return roll(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, k_sample)

    def update_program(state, batch, key):
        _, k_update = jax.random.split(key)
        return update_step_fn(state, batch, k_update)

    prompts_in = rows_sharding(sampler, num_prompts)
    sample_jit = jax.jit(sample_program,
                         in_shardings=(sampler_params_sh, prompts_in, prompts_in, prompts_in, sampler.replicated),
                         out_shardings=(rows_sharding(sampler, rows), sampler.replicated))
    batch_sh = rows_sharding(trainer, rows)  # every Batch leaf is [rows, ...]
    update_jit = jax.jit(update_program, donate_argnums=(0,),
                         in_shardings=(state_shardings, batch_sh, trainer.replicated),
                         out_shardings=(state_shardings, trainer.replicated))

    def iteration(state: TrainState, prompt_tokens_pt, prompt_mask_pt, index_p, key):
        params, sync_s = sync_weights(state.params, sampler_params_sh)
        t0 = time.perf_counter()
        batch, metrics = sample_jit(params, prompt_tokens_pt, prompt_mask_pt, index_p, key)
        batch = jax.block_until_ready(jax.device_put(batch, batch_sh))  # sampler -> trainer mesh
        del params  # the sampler's copy is rebuilt from the updated params next iteration
        t1 = time.perf_counter()
        state, update_metrics = update_jit(state, batch, key)
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        return state, {**update_metrics, **metrics, "time/weight_sync_s": sync_s, "time/sample_s": t1 - t0,
                       "time/update_s": t2 - t1}

    return iteration
