"""The multi-turn rollout: episodes with a host environment in, a `RolloutBatch` out (traceable).

    prompts [P, T] --sample_episodes (one while_loop; the environment stepped by io_callback)-->
        episodes [P * n, N]: tokens, author ids (MODEL / ENV / PAD), model log-probs, turn rewards
    --> RolloutBatch: loss mask = model tokens only (`rljax.envs.loss_mask`), minus the
        trajectories SimpleTIR's void-turn filter drops; reward = the episode's return

The host side the sampler calls is `rljax.sampling.episode_host.EpisodeHost`; the options are the `[env]`
section, `rljax.envs.EnvConfig`.

Reward. The episode's return is sum_k gamma^k r_k over its turns (`turn_discount` = gamma;
`rljax.envs.discounted_turn_returns` at turn 0), with r_k the turn's reward from the environment
(a per-turn reward, plus the answer's score on the answer turn). gamma = 1 (the default) is the
plain episode reward. Credit (`credit`): "episode" gives every model token of an episode the
advantage of its return; "turn" also hands the update each turn's return-to-go
G_k = sum_{j >= k} gamma^(j - k) r_j and each token's turn (`RolloutBatch.turn_returns`), so
turn k's tokens are credited with what followed them against the siblings that reached turn k
(ArCHer-style turn credit, Zhou et al., 2024, without a critic: `rljax.objectives.advantages.
turn_group_advantages`).

`make_episode_iteration` is `rljax.stages.iteration.make_iteration` with this rollout: sample,
score, update as ONE program.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from rljax import envs
from rljax.envs.config import EnvConfig
from rljax.envs.formats import get_format
from rljax.sampling.episode_host import EpisodeHost
from rljax.envs.masks import MODEL, PAD
from rljax.sampling import SampleControls
from rljax.sampling import multiturn as MT
from rljax.sharding import Layout
from rljax.stages.iteration import fuse, no_images
from rljax.stages.rollout import PREVIEW_ROWS, RolloutPreview
from rljax.update import RolloutBatch
from rljax.update.batch import TurnReturns


def model_turns(episodes: MT.Episodes) -> jax.Array:
    """turn_bn: the model turn (0, 1, ...) of each model token, from the sampler's own turn record
    (so a turn stays one even after an empty observation); -1 on the environment's tokens and PAD."""
    return jnp.where(episodes.author_bn == MODEL, episodes.turn_bn, -1)


def turn_returns(episodes: MT.Episodes, gamma: float) -> jax.Array:
    """returns_bn: each model token gets its turn's discounted return G_k = sum_{j >= k}
    gamma^(j - k) r_j (`rljax.envs.discounted_turn_returns`); other tokens 0."""
    g_bk = envs.discounted_turn_returns(episodes.turn_rewards_bk, gamma)
    return envs.turn_values_to_tokens(g_bk, model_turns(episodes))


@flax.struct.dataclass
class EpisodeBatch:
    """The rollout's outputs: the update's batch, the episodes, and which rows the filter kept."""

    batch: RolloutBatch
    episodes: MT.Episodes
    keep_b: jax.Array


def episodes_to_batch(prompt_tokens_bt, prompt_mask_bt, episodes: MT.Episodes, *, num_samples: int,
                      options: EnvConfig) -> EpisodeBatch:
    """A `RolloutBatch` of prompt + episode rows: loss on model tokens only, void-turn
    trajectories dropped from the loss (when the filter is on), reward = the episode's return;
    with `credit="turn"` also each token's turn and each turn's return-to-go (`TurnReturns`;
    a filtered episode keeps its turns, so it counts in its group's baselines as its reward does
    in the episode-credit group statistics)."""
    n = num_samples
    prompt_tokens = jnp.repeat(prompt_tokens_bt, n, axis=0)
    prompt_mask = jnp.repeat(prompt_mask_bt.astype(bool), n, axis=0)
    keep_b = episodes.void_turns_b == 0 if options.void_turn_filter else jnp.ones_like(episodes.void_turns_b, bool)
    model_bn = envs.loss_mask(episodes.author_bn, bool) & keep_b[:, None]
    zeros = jnp.zeros(prompt_mask.shape, jnp.float32)
    g_bk = envs.discounted_turn_returns(episodes.turn_rewards_bk, options.turn_discount)
    groups = prompt_tokens_bt.shape[0]
    turns = None
    if options.credit == "turn":
        prompt_turns = jnp.full(prompt_mask.shape, -1, jnp.int32)
        turns = TurnReturns(jnp.concatenate([prompt_turns, model_turns(episodes)], axis=1), g_bk)
    batch = RolloutBatch(
        tokens_bt=jnp.concatenate([prompt_tokens, episodes.tokens_bn], axis=1),
        attn_mask_bt=jnp.concatenate([prompt_mask, episodes.author_bn != PAD], axis=1),
        loss_mask_bt=jnp.concatenate([zeros.astype(bool), model_bn], axis=1),
        sampler_logp_bt=jnp.concatenate([zeros, episodes.logprobs_bn], axis=1),
        rewards_b=g_bk[:, 0], group_ids_b=jnp.repeat(jnp.arange(groups), n),
        completion_len=episodes.tokens_bn.shape[1], turn_returns=turns,
        routes_btlk=(None if episodes.routes_bnlk is None
                     else jnp.concatenate([episodes.prompt_routes_bnlk, episodes.routes_bnlk], axis=1)))
    return EpisodeBatch(batch, episodes, keep_b)


def episode_metrics(out: EpisodeBatch) -> dict[str, jax.Array]:
    """`rollout/...` metrics over every sampled episode."""
    e = out.episodes
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    model_b, env_b = envs.tokens_by_author(e.author_bn)
    rewards = out.batch.rewards_b
    return {
        "rollout/reward_mean": jnp.mean(rewards), "rollout/reward_std": jnp.std(rewards),
        "rollout/length_mean": jnp.mean(f32(e.lengths_b)), "rollout/length_max": jnp.max(f32(e.lengths_b)),
        "rollout/clipped_frac": jnp.mean(f32(e.finish_b == MT.FINISH_BUDGET)),
        "rollout/turns_per_episode": jnp.mean(f32(e.turns_b)),
        "rollout/tool_calls_per_episode": jnp.mean(f32(e.tool_calls_b)),
        "rollout/tool_errors_per_episode": jnp.mean(f32(e.tool_errors_b)),
        "rollout/void_turns_per_episode": jnp.mean(f32(e.void_turns_b)),
        "rollout/void_filtered": jnp.sum((~out.keep_b).astype(jnp.int32)),
        "rollout/model_tokens": jnp.sum(model_b), "rollout/env_tokens": jnp.sum(env_b),
        "rollout/decode_steps": f32(e.decode_steps),
        "rollout/slot_occupancy": e.live_row_steps / jnp.maximum(e.decode_steps * e.lengths_b.shape[0], 1),
        "rollout/tokens": jnp.sum(e.lengths_b),
    }


def episode_rollout(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, key, *, controls: SampleControls,
                    host: EpisodeHost, options: EnvConfig
                    ) -> tuple[RolloutBatch, dict[str, jax.Array], RolloutPreview]:
    """Sample episodes for P prompts x n, and build the update's batch, the `rollout/...`
    metrics and a preview (one episode of each of the first few prompts)."""
    n = controls.num_samples
    episodes = MT.sample_episodes(cfg, params, prompt_tokens_pt, prompt_mask_pt, index_p, key, controls=controls,
                                  host=host, budget=options.max_episode_tokens, max_turns=options.max_turns,
                                  max_observation_tokens=options.max_observation_tokens)
    out = episodes_to_batch(prompt_tokens_pt, prompt_mask_pt, episodes, num_samples=n, options=options)
    k = min(PREVIEW_ROWS, prompt_tokens_pt.shape[0])
    first = jnp.arange(k) * n
    preview = RolloutPreview(prompt_tokens_kt=prompt_tokens_pt[:k], prompt_mask_kt=prompt_mask_pt[:k],
                             completion_tokens_kc=episodes.tokens_bn[first],
                             completion_mask_kc=episodes.author_bn[first] != PAD,
                             rewards_k=out.batch.rewards_b[first], reward_parts_k={}, prompt_index_k=index_p[:k])
    return out.batch, episode_metrics(out), preview


def make_episode_iteration(controls: SampleControls, host: EpisodeHost, options: EnvConfig, *,
                           layout: Layout | None = None) -> Callable:
    """`iteration(state, prompt_tokens_pt, prompt_mask_pt, index_p, key) -> (state, metrics, preview)`:
    episodes -> update as ONE jitted program, the state donated (as `make_iteration`)."""
    def record(state):  # routing replay: the episodes record every token's experts
        return controls.replace(record_routes=True) if state.algo.needs.routes else controls

    def rollout_of(state, prompt_tokens_pt, prompt_mask_pt, index_p, key, images):
        no_images(images, "multi-turn episodes")
        return episode_rollout(state.model_cfg, state.sampler_params(), prompt_tokens_pt, prompt_mask_pt, index_p,
                               key, controls=record(state), host=host, options=options)

    return fuse(rollout_of, layout=layout)


def episode_controls(controls: SampleControls, tokenizer, env: EnvConfig) -> SampleControls:
    """The run's controls with the env format's tool-call end as a stop sequence."""
    return MT.episode_controls(controls, tokenizer.encode(get_format(env.format).stop_sequence))
