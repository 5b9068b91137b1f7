"""The multi-turn rollout: episodes with a host environment in, a `RolloutBatch` out (traceable).

    prompts [P, T] --sample_episodes (one while_loop; the environment stepped by io_callback)-->
        episodes [P * n, N]: tokens, author ids (MODEL / ENV / PAD), model log-probs, turn rewards
    --> RolloutBatch: loss mask = model tokens only (`rljax.envs.loss_mask`), minus the
        trajectories SimpleTIR's void-turn filter drops; reward = the episode's return

`EpisodeHost` is the host side the sampler calls: it decodes each finished model turn with the
run's tokenizer, steps the environments through the verifier pool (`rljax.envs.step_batch`, time
limits, failures as error observations) and encodes the observations, cut to
`max_observation_tokens` with a marker.

Reward. The episode's return is sum_k gamma^k r_k over its turns (`turn_discount` = gamma;
`rljax.envs.discounted_turn_returns` at turn 0), with r_k the turn's reward from the environment
(a per-turn reward, plus the answer's score on the answer turn). gamma = 1 (the default) is the
plain episode reward. Credit (`credit`): "episode" gives every model token of an episode the
advantage of its return; "turn" also hands the update each turn's return-to-go
G_k = sum_{j >= k} gamma^(j - k) r_j and each token's turn (`RolloutBatch.turn_returns`), so
turn k's tokens are credited with what followed them against the siblings that reached turn k
(ArCHer-style turn credit, Zhou et al., 2024, without a critic: `rljax.objectives.advantages.
turn_group_advantages`).

`make_episode_iteration` is `rljax.train.iteration.make_iteration` with this rollout: sample,
score, update as ONE program.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rljax import envs
from rljax.envs.masks import MODEL, PAD
from rljax.errors import ConfigError, DataError
from rljax.evaluation.runner import EvalSetup
from rljax.rewards.pool import VerifierPool
from rljax.sampling import SampleControls
from rljax.sampling import multiturn as MT
from rljax.sharding import Layout
from rljax.train.iteration import fuse
from rljax.train.rollout import PREVIEW_ROWS, RolloutPreview
from rljax.update import RolloutBatch
from rljax.update.batch import TurnReturns

_KIND_IDS = {"tool_call": MT.KIND_TOOL_CALL, "answer": MT.KIND_ANSWER, "void": MT.KIND_VOID}


@dataclasses.dataclass(frozen=True)
class EpisodeOptions:
    """The static shape and options of a multi-turn rollout (the `[env]` config section).

    max_turns: model turns per episode (the environment ends the episode at the last one).
    max_episode_tokens: the per-episode token budget, model and environment tokens together
      (the episode buffer's width N).
    max_observation_tokens: an observation's cap in tokens; a longer one is cut and ends with
      the tokenizer's encoding of `truncation_marker`.
    void_turn_filter: drop trajectories with a void turn from the loss (SimpleTIR).
    turn_discount: gamma of the episode return sum_k gamma^k r_k (1: the sum of turn rewards).
    credit: "episode" (one advantage per episode, from its return) or "turn" (per turn, from the
      turn's return-to-go; the batch carries `TurnReturns`).
    """

    max_turns: int = 3
    max_episode_tokens: int = 64
    max_observation_tokens: int = 16
    truncation_marker: str = "..."
    void_turn_filter: bool = True
    turn_discount: float = 1.0
    credit: str = "episode"

    def __post_init__(self):
        if self.credit not in ("episode", "turn"):
            raise ConfigError(f"env.credit={self.credit!r}; choose 'episode' or 'turn'")

    @classmethod
    def from_section(cls, section: Any) -> EpisodeOptions:
        """From the `[env]` config section (`rljax.train.config.EnvSection`)."""
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class _Batch:
    states: list
    actions: list[list[str]]
    results: list[list[envs.StepResult]]


class EpisodeHost:
    """The host side of `rljax.sampling.multiturn`: ``reset(index_b) -> id`` and
    ``step(id, tokens_bn, turn_start_b, step, needs_b) -> EnvOutput``.

    ``table[i]`` is example i (an `Example` or a dict with the verifier's fields); ``tokenizer``
    decodes turns and encodes observations; ``pool`` runs the steps (None: the shared default
    pool; ``VerifierPool(0)``: inline). `last` holds the latest batch's actions and step results
    (for logs and metrics); host seconds accumulate until `take_seconds`.
    """

    def __init__(self, env: envs.Environment, tokenizer: Any, table: Sequence[Any], *, max_observation_tokens: int,
                 truncation_marker: str = "...", pool: VerifierPool | None = None, keep: int = 2) -> None:
        self.env, self.tokenizer, self.table, self.pool = env, tokenizer, table, pool
        self.max_observation_tokens = int(max_observation_tokens)
        self.marker_ids = list(tokenizer.encode(truncation_marker)) if truncation_marker else []
        if len(self.marker_ids) >= self.max_observation_tokens:
            raise ConfigError(f"env.max_observation_tokens={self.max_observation_tokens} leaves no room beside the "
                              f"truncation marker ({len(self.marker_ids)} tokens); raise it")
        self._batches: dict[int, _Batch] = {}
        self._next_id, self._keep = 0, keep
        self._seconds = 0.0

    def reset(self, index_b) -> np.int32:
        start = time.perf_counter()
        examples = [self.table[int(i)] for i in np.asarray(index_b)]
        states, _ = envs.reset_batch(self.env, examples)
        episode_id = self._next_id
        self._next_id += 1
        self._batches[episode_id] = _Batch(states, [[] for _ in states], [[] for _ in states])
        for old in [k for k in self._batches if k <= episode_id - self._keep]:
            del self._batches[old]
        self._seconds += time.perf_counter() - start
        return np.int32(episode_id)

    def step(self, episode_id, tokens_bn, turn_start_b, step, needs_b) -> MT.EnvOutput:
        start = time.perf_counter()
        batch = self._batches[int(episode_id)]
        tokens_bn, turn_start_b, needs_b = np.asarray(tokens_bn), np.asarray(turn_start_b), np.asarray(needs_b)
        rows = np.flatnonzero(needs_b)
        turns = self.tokenizer.decode_batch([tokens_bn[r, turn_start_b[r]:int(step)].tolist() for r in rows],
                                            skip_special=True)
        actions: list[str | None] = [None] * len(batch.states)
        for r, text in zip(rows, turns):
            actions[r] = text
        stepped = envs.step_batch(self.env, batch.states, actions, pool=self.pool)
        b, o = len(batch.states), self.max_observation_tokens
        out = MT.EnvOutput(np.zeros((b, o), np.int32), np.zeros(b, np.int32), np.zeros(b, bool),
                           np.zeros(b, np.float32), np.zeros(b, np.int32), np.zeros(b, bool))
        for r in rows:
            result = stepped.results[r]
            ids = [] if result.done else self.observation_ids(result.observation_text)
            out.obs_bo[r, :len(ids)] = ids
            out.obs_len_b[r], out.done_b[r], out.reward_b[r] = len(ids), result.done, result.reward
            out.kind_b[r], out.tool_error_b[r] = _KIND_IDS[result.kind], result.tool_error
            batch.actions[r].append(actions[r])
            batch.results[r].append(result)
        batch.states = stepped.states
        self._seconds += time.perf_counter() - start
        return out

    def observation_ids(self, text: str) -> list[int]:
        """The observation's tokens, cut to the cap with the marker at the end."""
        ids = self._encode(text)
        if len(ids) <= self.max_observation_tokens:
            return ids
        return ids[:self.max_observation_tokens - len(self.marker_ids)] + self.marker_ids

    def _encode(self, text: str) -> list[int]:
        """`tokenizer.encode`, or, for a tokenizer that cannot spell every character (a character
        vocabulary meeting a tool's error message), the characters it can spell: an observation
        must never stop the rollout."""
        try:
            return list(self.tokenizer.encode(text))
        except DataError:
            text = text[:8 * self.max_observation_tokens]  # enough to fill the cap
            ids: list[int] = []
            for ch in text:
                try:
                    ids += self.tokenizer.encode(ch)
                except DataError:
                    pass
            return ids

    @property
    def last(self) -> _Batch | None:
        return self._batches[max(self._batches)] if self._batches else None

    def take_seconds(self) -> float:
        """Host seconds spent in reset and step since the previous call, then resets."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds


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
                      options: EpisodeOptions) -> EpisodeBatch:
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
        completion_len=episodes.tokens_bn.shape[1], turn_returns=turns)
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
                    host: EpisodeHost, options: EpisodeOptions
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


def make_episode_iteration(controls: SampleControls, host: EpisodeHost, options: EpisodeOptions, *,
                           layout: Layout | None = None) -> Callable:
    """`iteration(state, prompt_tokens_pt, prompt_mask_pt, index_p, key) -> (state, metrics, preview)`:
    episodes -> update as ONE jitted program, the state donated (as `make_iteration`)."""
    return fuse(lambda state, prompt_tokens_pt, prompt_mask_pt, index_p, key: episode_rollout(
        state.model_cfg, state.sampler_params(), prompt_tokens_pt, prompt_mask_pt, index_p, key, controls=controls,
        host=host, options=options), layout=layout)



def episode_accuracy(setup: EvalSetup, params, env: envs.Environment, options: EpisodeOptions,
                     controls: SampleControls, *, pool: VerifierPool | None = None) -> float:
    """Fraction of held-out problems solved by the greedy episode (with the tool), the multi-turn
    `rljax.evaluation.greedy_accuracy`: solved means the episode's reward is above 0.5, i.e. the
    environment scored its answer correct (turn rewards, if any, are small beside it)."""
    if not setup.examples:
        return float("nan")
    host = EpisodeHost(env, setup.tokenizer, setup.examples, max_observation_tokens=options.max_observation_tokens,
                       truncation_marker=options.truncation_marker, pool=pool)
    greedy = controls.greedy_version()
    solved = []
    for idx, real in setup.batches():
        e = MT.sample_episodes_host_loop(setup.model_cfg, params, setup.tokens_bt[idx], setup.mask_bt[idx],
                                         idx.astype(np.int32), jax.random.key(0), controls=greedy, host=host,
                                         budget=options.max_episode_tokens, max_turns=options.max_turns,
                                         max_observation_tokens=options.max_observation_tokens)
        solved.append(np.asarray(jax.device_get(e.rewards_b))[:real] > 0.5)
    return float(np.mean(np.concatenate(solved)))
