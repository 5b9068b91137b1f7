"""Replay of successful trajectories for prompts the policy rarely solves (ARPO, RePO; 2025).

ARPO (Lu et al., *End-to-End Policy Optimization for GUI Agents with Experience Replay*, 2025)
keeps successful trajectories per task and, when every sample in a group fails, puts a stored
success into the group, so the group has reward variance and a non-zero GRPO advantage again.
RePO (*Replay-Enhanced Policy Optimization*, 2025) likewise mixes per-prompt off-policy samples
from a buffer into the on-policy group. Here:

    add:   every row with reward >= success_threshold from a group whose pass rate is below
           max_pass_rate (hard prompts: easy ones need no help) is stored with its tokens,
           masks, reward and behaviour log-probs (the log-probs of the policy that drew it).
    mix:   in up to floor(fraction * G) groups whose samples all failed and whose prompt has a
           stored success, the group's last row is replaced by that prompt's newest success.

Replayed rows carry their behaviour log-probs in `sampler_logp_bt`, so with
`recompute_old_logp` the update step's off-policy correction (TIS weight or MIS mask on
pi_old / mu) applies to them exactly as to stale samples.

Routing replay (`algorithm.routing_replay = "rollout"`, an MoE policy): a buffer built with
`routes_lk = (L, k)` stores each row's routing record [row_len, L, k] beside its tokens (-1 where
unrecorded), shifted with them, and a replayed row brings its own record into the batch, so the
trainer recomputes it with the experts its sampler used. A record-carrying batch mixed from a
buffer without records is refused (the replayed rows would have none).

Eviction: at most `per_prompt` rows per prompt (a prompt's oldest row makes way for its newest),
then FIFO over the whole buffer at `capacity`. The per-prompt cap stops one prompt that keeps
succeeding from filling the buffer; FIFO drops the stalest rows first, whose behaviour policy is
furthest from the current one (largest importance weights, most truncated or masked anyway).
The newest row is the one replayed for the same reason. Rows are stored left-padded to
`row_len` (max prompt length + completion length), so the buffer is fixed-size arrays that go
into the checkpoint as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rljax.errors import CheckpointError, ConfigError

_ARRAYS = ("tokens", "attn_mask", "loss_mask", "behaviour_logp", "rewards", "order")
_NO_ROUTE = -1  # a token without a routing record (`rljax.update.batch.RolloutBatch.routes_btlk`)


@dataclasses.dataclass(frozen=True)
class ReplayRows:
    """Rows read from the buffer, each ``[K, row_len]`` (rewards ``[K]``), plus their prompts."""

    tokens_bt: np.ndarray
    attn_mask_bt: np.ndarray
    loss_mask_bt: np.ndarray
    behaviour_logp_bt: np.ndarray
    rewards_b: np.ndarray
    prompt_ids: tuple[str, ...]
    routes_btlk: np.ndarray | None = None  # [K, row_len, L, k] when the buffer keeps routing records


def fit_routes(routes_tlk: np.ndarray, attn_t: np.ndarray, width: int) -> np.ndarray:
    """`fit_width` for a row's routing record [T, L, k] (time first), padded with -1."""
    return np.moveaxis(fit_width(np.moveaxis(routes_tlk, 0, -1), attn_t, width, fill=_NO_ROUTE), -1, 0)


def fit_width(row_t: np.ndarray, attn_t: np.ndarray, width: int, fill=0) -> np.ndarray:
    """A left-padded row at `width` columns: drop leading padding or add it on the left.

    Completion columns sit at the right end, so their alignment is kept. Dropping a real token
    (the row's prompt does not fit) is an internal mismatch and raises."""
    extra = row_t.shape[-1] - width
    if extra > 0:
        if np.any(attn_t[..., :extra]):
            raise ValueError(f"a stored row needs {row_t.shape[-1] - int(np.argmax(attn_t))} columns, "
                             f"the batch has {width}")
        return row_t[..., extra:]
    pad = np.full(row_t.shape[:-1] + (-extra,), fill, row_t.dtype)
    return np.concatenate([pad, row_t], axis=-1)


class ReplayBuffer:
    """A fixed-capacity buffer of successful rows (see the module doc for what goes in and out)."""

    def __init__(self, *, capacity: int, row_len: int, per_prompt: int = 2, success_threshold: float = 1.0,
                 max_pass_rate: float = 0.5, routes_lk: tuple[int, int] | None = None):
        if capacity < 1 or row_len < 1 or per_prompt < 1:
            raise ConfigError(f"replay needs capacity, row_len and per_prompt >= 1, got "
                              f"{capacity}, {row_len}, {per_prompt}")
        if not 0.0 < max_pass_rate <= 1.0:
            raise ConfigError(f"replay max_pass_rate={max_pass_rate} must be in (0, 1]")
        self.capacity, self.row_len, self.per_prompt = capacity, row_len, per_prompt
        self.success_threshold, self.max_pass_rate = success_threshold, max_pass_rate
        self.tokens = np.zeros((capacity, row_len), np.int32)
        self.attn_mask = np.zeros((capacity, row_len), bool)
        self.loss_mask = np.zeros((capacity, row_len), bool)
        self.behaviour_logp = np.zeros((capacity, row_len), np.float32)
        self.rewards = np.zeros(capacity, np.float32)
        self.order = np.full(capacity, -1, np.int64)  # insertion serial; -1 = empty slot
        self.prompt_ids: list[str | None] = [None] * capacity
        # routing records (an MoE policy with routing replay), int16 holds any expert id of int8 or int16
        self.routes = (None if routes_lk is None
                       else np.full((capacity, row_len, *routes_lk), _NO_ROUTE, np.int16))
        self.serial = 0
        self.counters = {"added": 0, "sampled": 0, "evicted": 0, "mixed": 0}

    @property
    def size(self) -> int:
        return int(np.sum(self.order >= 0))

    def slots_of(self, prompt_id) -> list[int]:
        """The prompt's slots, oldest first."""
        key = str(prompt_id)
        return sorted((s for s in range(self.capacity) if self.prompt_ids[s] == key), key=lambda s: self.order[s])

    def _slot_for(self, key: str) -> int:
        own = self.slots_of(key)
        if len(own) >= self.per_prompt:
            return own[0]
        empty = np.flatnonzero(self.order < 0)
        if empty.size:
            return int(empty[0])
        return int(np.argmin(self.order))

    def add(self, prompt_ids_g: Sequence[Any], tokens_bt, attn_mask_bt, loss_mask_bt, behaviour_logp_bt,
            rewards_b, routes_btlk=None) -> int:
        """Store the eligible rows of a prompt-major batch (``B = G * n`` rows, group g = rows
        g*n .. g*n+n-1); returns how many were stored. A buffer with routing records needs the
        batch's (`routes_btlk` [B, T, L, k])."""
        if self.routes is not None and routes_btlk is None:
            raise ConfigError("this replay buffer keeps routing records (algorithm.routing_replay='rollout') but the "
                              "batch has none: sample with the rollout's record (SampleControls.record_routes)")
        rewards_b = np.asarray(rewards_b, np.float32)
        num_groups = len(prompt_ids_g)
        if num_groups == 0 or rewards_b.shape[0] % num_groups:
            raise ValueError(f"{rewards_b.shape[0]} rows do not split into {num_groups} groups")
        n = rewards_b.shape[0] // num_groups
        success_b = rewards_b >= self.success_threshold
        pass_g = success_b.reshape(num_groups, n).mean(axis=1)
        arrays = [np.asarray(a) for a in (tokens_bt, attn_mask_bt, loss_mask_bt, behaviour_logp_bt)]
        stored = 0
        for b in np.flatnonzero(success_b & np.repeat(pass_g < self.max_pass_rate, n)):
            key = str(prompt_ids_g[b // n])
            slot = self._slot_for(key)
            if self.order[slot] >= 0:
                self.counters["evicted"] += 1
            attn = arrays[1][b].astype(bool)
            for dest, src in zip((self.tokens, self.attn_mask, self.loss_mask, self.behaviour_logp), arrays):
                dest[slot] = fit_width(src[b].astype(dest.dtype), attn, self.row_len)
            if self.routes is not None:
                self.routes[slot] = fit_routes(np.asarray(routes_btlk[b]).astype(np.int16), attn, self.row_len)
            self.rewards[slot], self.prompt_ids[slot] = rewards_b[b], key
            self.order[slot], self.serial = self.serial, self.serial + 1
            stored += 1
        self.counters["added"] += stored
        return stored

    def rows(self, slots: Sequence[int]) -> ReplayRows:
        slots = np.asarray(slots, np.int64)
        return ReplayRows(self.tokens[slots].copy(), self.attn_mask[slots].copy(), self.loss_mask[slots].copy(),
                          self.behaviour_logp[slots].copy(), self.rewards[slots].copy(),
                          tuple(self.prompt_ids[s] for s in slots),
                          None if self.routes is None else self.routes[slots].copy())

    def sample(self, k: int, rng: np.random.Generator) -> ReplayRows:
        """Up to `k` distinct rows, uniformly; deterministic given `rng` and the buffer's contents."""
        filled = sorted(np.flatnonzero(self.order >= 0), key=lambda s: self.order[s])
        chosen = rng.choice(np.asarray(filled, np.int64), size=min(k, len(filled)), replace=False)
        self.counters["sampled"] += len(chosen)
        return self.rows(chosen)

    def metrics(self) -> dict[str, float]:
        """`replay/*` scalars: size and the running counts of rows added, sampled, evicted, mixed."""
        return {"replay/size": float(self.size), **{f"replay/{k}": float(v) for k, v in self.counters.items()}}

    def state_dict(self) -> dict:
        """Arrays (copies) plus JSON-able prompt ids and counters, for the checkpoint."""
        routes = {} if self.routes is None else {"routes": self.routes.copy()}
        return {**{name: getattr(self, name).copy() for name in _ARRAYS}, **routes,
                "prompt_ids": list(self.prompt_ids), "serial": self.serial, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        if (self.routes is None) != ("routes" not in state):
            raise CheckpointError("the checkpoint's replay buffer and this run disagree on routing records: resume "
                                  "with the run's algorithm.routing_replay")
        for name in _ARRAYS + (() if self.routes is None else ("routes",)):
            have = np.asarray(state[name])
            want = getattr(self, name)
            if have.shape != want.shape:
                raise CheckpointError(f"replay buffer {name} has shape {have.shape} in the checkpoint but "
                                      f"{want.shape} in the config; keep replay.capacity and row length unchanged")
            setattr(self, name, have.astype(want.dtype).copy())
        self.prompt_ids = [None if p is None else str(p) for p in state["prompt_ids"]]
        self.serial, self.counters = int(state["serial"]), {k: int(v) for k, v in state["counters"].items()}


@dataclasses.dataclass(frozen=True)
class MixResult:
    """batch: the batch with replayed rows; replayed_b: bool ``[B]``, True on replayed rows;
    metrics: ``replay/rows_mixed`` and ``replay/groups_all_failed``."""

    batch: Any
    replayed_b: np.ndarray
    metrics: dict[str, float]


def mix_into_batch(batch, buffer: ReplayBuffer, *, prompt_ids_g: Sequence[Any], fraction: float) -> MixResult:
    """Put stored successes into up to ``floor(fraction * G)`` all-failed groups (module doc).

    `batch` is any dataclass with the `RolloutBatch` fields tokens_bt, attn_mask_bt,
    loss_mask_bt, sampler_logp_bt and rewards_b (and routes_btlk, when set), prompt-major with G = len(prompt_ids_g)
    groups; it is returned as the same type with those fields as NumPy arrays. Call it before
    `buffer.add` on the fresh rows, so a replayed row is never stored twice.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"replay fraction={fraction} must be in [0, 1]")
    fields = {name: np.array(getattr(batch, name)) for name in
              ("tokens_bt", "attn_mask_bt", "loss_mask_bt", "sampler_logp_bt", "rewards_b")}
    routes = getattr(batch, "routes_btlk", None)
    if routes is not None:  # the replayed rows bring their own record (module doc)
        if buffer.routes is None:
            raise ConfigError("the batch carries routing records (algorithm.routing_replay='rollout') but the replay "
                              "buffer keeps none: build it with ReplayBuffer(routes_lk=(layers, top_k))")
        fields["routes_btlk"] = np.array(routes)
    num_rows, width = fields["tokens_bt"].shape
    num_groups = len(prompt_ids_g)
    n = num_rows // num_groups
    failed_g = np.all(fields["rewards_b"].reshape(num_groups, n) < buffer.success_threshold, axis=1)
    budget = int(np.floor(fraction * num_groups))
    replayed_b = np.zeros(num_rows, bool)
    for g in np.flatnonzero(failed_g):
        if replayed_b.sum() >= budget:
            break
        slots = buffer.slots_of(prompt_ids_g[g])
        if not slots:
            continue
        row, b = buffer.rows([slots[-1]]), g * n + n - 1
        attn = row.attn_mask_bt[0]
        for name, src in (("tokens_bt", row.tokens_bt), ("attn_mask_bt", row.attn_mask_bt),
                          ("loss_mask_bt", row.loss_mask_bt), ("sampler_logp_bt", row.behaviour_logp_bt)):
            fields[name][b] = fit_width(src[0], attn, width).astype(fields[name].dtype)
        fields["rewards_b"][b] = row.rewards_b[0]
        if routes is not None:
            fields["routes_btlk"][b] = fit_routes(row.routes_btlk[0], attn, width).astype(routes.dtype)
        replayed_b[b] = True
    buffer.counters["mixed"] += int(replayed_b.sum())
    metrics = {"replay/rows_mixed": float(replayed_b.sum()), "replay/groups_all_failed": float(failed_g.sum())}
    if getattr(batch, "verifier_rewards_b", None) is not None:  # stale on replayed rows: dropped (rewards_b serves)
        fields["verifier_rewards_b"] = None
    return MixResult(dataclasses.replace(batch, **fields), replayed_b, metrics)
