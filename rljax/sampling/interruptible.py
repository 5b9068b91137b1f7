"""Partial (interruptible) rollouts: generation that continues across a weight update.

AReaL (Fu et al., 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning") never makes a rollout wait for the trainer: when new weights arrive in the
middle of generation, unfinished rows keep the tokens they have, the KV cache is recomputed under
the new weights, and decoding goes on. A row's tokens may then come from several policy versions,
so each token records the version and the log-probability it was drawn with; the decoupled loss
(`rljax.objectives.losses.decoupled_ppo`) reads those per-token behaviour log-probs.

    partial = start(cfg, params_v0, prompts, mask, key, controls, version=0)   # prefill, token 0
    partial = advance(cfg, params_v0, partial, steps=8, version=0)            # 8 more tokens
    partial = swap_weights(cfg, params_v1, partial)                            # new weights arrived
    partial = advance(cfg, params_v1, partial, steps=8, version=1)
    result, version_bc = finish(partial)

`sample_with_updates` is the host driver an async producer calls: it polls for new weights
before every segment of decode steps and swaps when a newer version is there.

The decoding is the static scheduler's own (`rljax.sampling.decode`: prefill, `record`, `decode`,
the same row keys), so without a swap the tokens and log-probs are bitwise those of
`rljax.sampling.sample` for the same key and controls. A swap after token s - 1 was drawn means:
tokens 0 .. s-1 were drawn from the old params' logits, token s and later from the new params'
logits computed over the whole prefix, exactly as if the new params had produced the cache.

The cache keeps the sampler's phase layout (`decode_widths`; see `decode`)
rather than the full max_new width from the start: decode attention over a wider cache sums its
softmax over more (empty) slots in a different order, which changes the log-probs in the last
f32 bits, and the sampler's bitwise equality (and its smaller average attention read) would be lost.
The price is that the host must know when a phase is full: the drivers read the step counter
once per segment (a scalar), which they need anyway to poll for weights at the right time.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rljax.errors import ConfigError
from rljax.models import ModelConfig, hidden_states, unstack_layers
from rljax.sampling import decode as D
from rljax.sampling.controls import SampleControls, StaticControls
from rljax.sampling.fp8 import sampler_params_jit

NO_VERSION = -1  # version_bc where no token has been drawn


@flax.struct.dataclass
class PartialRollout:
    """A static-scheduler decode in progress, rows prompt-major ([B * n, ...]).

    state: the sampler's `DecodeState` (cache, tokens, per-token behaviour log-probs, stops).
    version_bc: int32 [B * n, new_bucket], the policy version that drew each completion token
      (NO_VERSION = -1 where no token was drawn).
    prompt_tokens_pt / prompt_mask_pt: the left-padded prompts [B, P], for recomputing the cache.
    max_new_tokens, num_samples, spec, widths: the controls' static half and the decode phases'
      cache widths.
    """

    state: D.DecodeState
    version_bc: jax.Array
    prompt_tokens_pt: jax.Array
    prompt_mask_pt: jax.Array
    max_new_tokens: int = flax.struct.field(pytree_node=False)
    num_samples: int = flax.struct.field(pytree_node=False)
    spec: StaticControls = flax.struct.field(pytree_node=False)
    widths: tuple[int, ...] = flax.struct.field(pytree_node=False)

    @property
    def width(self) -> int:
        """New-token slots in the current cache (static)."""
        return self.state.cache["pos"].shape[1] - self.prompt_tokens_pt.shape[1]


def _record_versions(version_bc, length_b, step_from, step_to, version):
    """version_bc with `version` at the tokens drawn in [step_from, step_to) by live rows (a token
    index below the row's length was drawn; a row that had ended draws nothing)."""
    col = jnp.arange(version_bc.shape[1])[None, :]
    drawn = (col >= step_from) & (col < step_to) & (col < length_b[:, None])
    return jnp.where(drawn, jnp.asarray(version, jnp.int32), version_bc)


def _start(cfg: ModelConfig, params, prompt_pt, mask_pt, key, max_new, scalars, version, *, spec: StaticControls,
           num_samples: int, new_bucket: int, max_new_tokens: int, widths: tuple[int, ...]) -> PartialRollout:
    state = D.prefill(cfg, unstack_layers(params, cfg), prompt_pt, mask_pt, key, max_new, scalars, spec=spec,
                      num_samples=num_samples, new_bucket=new_bucket)
    rows = state.tokens_bn.shape[0]
    version_bc = _record_versions(jnp.full((rows, new_bucket), NO_VERSION, jnp.int32), state.length_b, 0, 1, version)
    return PartialRollout(state=state, version_bc=version_bc, prompt_tokens_pt=prompt_pt, prompt_mask_pt=mask_pt,
                          max_new_tokens=max_new_tokens, num_samples=num_samples, spec=spec, widths=widths)


def _segment(cfg: ModelConfig, params, partial: PartialRollout, limit, version) -> PartialRollout:
    """Decodes until `min(limit, cache width, max_new)` tokens are drawn or every row has stopped,
    recording `version` on the tokens drawn."""
    s = partial.state
    step_from = s.step
    s = D.decode(cfg, unstack_layers(params, cfg), s, jnp.minimum(limit, partial.width), spec=partial.spec)
    return partial.replace(state=s, version_bc=_record_versions(partial.version_bc, s.length_b, step_from, s.step,
                                                                version))


def _append(cfg: ModelConfig, params, tokens_bg, positions_bg, mask_bg, cache, *, batch_invariant: bool,
            record_routes: bool = False):
    """`cache` with the keys and values of `tokens_bg` written at its index, from one forward of
    all G tokens of every row (one row at a time under `batch_invariant`, as the sampler does);
    with `record_routes` (an MoE model), also the tokens' experts, int32 [B, G, L, k]."""
    if not batch_invariant:
        _, cache, *routes = hidden_states(cfg, params, tokens_bg, positions_bg, mask_bg, cache,
                                          return_routes=record_routes)
        return (cache, *(r.transpose(1, 2, 0, 3) for r in routes))
    index = cache["index"]

    def one(tok, pos, m, layers, kpos):
        _, new, *routes = hidden_states(cfg, params, tok, pos, m, {"layers": layers, "pos": kpos, "index": index},
                                        return_routes=record_routes)
        return (new["layers"], new["pos"], *(r.swapaxes(0, 1) for r in routes))  # row first: the map strips it

    layers, kpos, *routes = D.one_row_at_a_time(one, tokens_bg, positions_bg, mask_bg, cache["layers"], cache["pos"])
    return ({"layers": layers, "pos": kpos, "index": index + tokens_bg.shape[1]},
            *(r.transpose(0, 2, 1, 3) for r in routes))  # [B, L, G, k] -> [B, G, L, k]


def _swap(cfg: ModelConfig, params, partial: PartialRollout) -> PartialRollout:
    """The cache of prompt + generated-so-far recomputed under `params` (see `swap_weights`).

    The prompts are run once per prompt, as the prefill does, and their cache repeated to the n
    samples; then one forward over the first G = min(width, max_new - 1) completion slots of every
    row (no more can ever have been fed) appends the generated tokens, each attending to its
    prompt and the tokens before it.

    Routing replay (`record_routes`, an MoE model): both forwards re-record the experts of the
    tokens they feed, so the record is each token's routing in the cache decoding goes on from
    (the newest params'), as the rest of the row is decoded from it."""
    s, spec = partial.state, partial.spec
    params = unstack_layers(params, cfg)
    recording = s.routes_bnlk is not None
    cache, _, *prompt_routes = D.prompt_forward(cfg, params, partial.prompt_tokens_pt, partial.prompt_mask_pt,
                                                batch_invariant=spec.batch_invariant, record_routes=recording)
    cache = D.stored_prompt_cache(cfg, cache, spec)  # FP8 (`kv_dtype`): quantised as the prefill's; the
    # appended tokens' keys and values are quantised where the cached forward writes them
    repeat = lambda x: jnp.repeat(x, partial.num_samples, axis=0) if x.ndim else x  # noqa: E731
    cache = D.pad_slots(cfg, jax.tree.map(repeat, cache), partial.width)
    p = partial.prompt_tokens_pt.shape[1]
    cache["index"] = jnp.asarray(p, jnp.int32)
    g = max(1, min(partial.width, partial.max_new_tokens - 1))
    # Completion token i sits at slot p + i and position (real prompt tokens) + i; tokens 0 .. step-2
    # have been fed, token step-1 is `last_token_b`, which the next decode step feeds.
    first_pos_b = repeat(jnp.sum(partial.prompt_mask_pt, axis=1, dtype=jnp.int32))
    positions_bg = first_pos_b[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
    fed_bg = jnp.broadcast_to(jnp.arange(g)[None, :] < s.step - 1, positions_bg.shape)
    cache, *routes = _append(cfg, params, s.tokens_bn[:, :g], positions_bg, fed_bg, cache,
                             batch_invariant=spec.batch_invariant, record_routes=recording)
    cache["index"] = (p + s.step - 1).astype(jnp.int32)
    if recording:  # the fed tokens' new experts; the unfed columns keep -1
        rec = s.routes_bnlk
        fresh = jnp.where(fed_bg[:, :, None, None], routes[0].astype(rec.dtype), rec[:, :g])
        s = s.replace(routes_bnlk=rec.at[:, :g].set(fresh), prompt_routes_bplk=prompt_routes[0])
    return partial.replace(state=s.replace(cache=cache))


_start_jit = jax.jit(_start, static_argnames=("cfg", "spec", "num_samples", "new_bucket", "max_new_tokens",
                                              "widths"))
_segment_jit = jax.jit(_segment, static_argnames=("cfg",), donate_argnames=("partial",))
_swap_jit = jax.jit(_swap, static_argnames=("cfg",), donate_argnames=("partial",))
_widen_jit = jax.jit(lambda cfg, partial, extra: partial.replace(state=D.widen(cfg, partial.state, extra)),
                     static_argnames=("cfg", "extra"))  # new buffers: nothing to donate
_unstack_jit = jax.jit(unstack_layers, static_argnums=1)
_finish_jit = jax.jit(lambda partial: (D.to_result(partial.state, width=partial.max_new_tokens),
                                       partial.version_bc[:, :partial.max_new_tokens]))


def start(cfg: ModelConfig, params, prompt_tokens_pt, prompt_mask_pt, key, controls: SampleControls, *,
          version: int) -> PartialRollout:
    """Prefills the (left-padded) prompts once, repeats each to `controls.num_samples` rows and
    draws token 0 with `params`, recorded as `version`; exactly `rljax.sampling.sample`'s start.
    Static scheduler only. Every function here takes params stacked or split per layer
    (`rljax.models.unstack_layers`); split them once per version, as `sample_with_updates` does,
    or each call copies the layers out of the stacked arrays again."""
    spec = controls.static()
    new_bucket = D.bucket_length(controls.max_new_tokens)
    widths = D.decode_widths(spec, new_bucket, controls.max_new_tokens)
    return _start_jit(cfg, params, jnp.asarray(prompt_tokens_pt, jnp.int32), jnp.asarray(prompt_mask_pt, bool), key,
                      np.int32(controls.max_new_tokens), controls.scalars(), np.int32(version), spec=spec,
                      num_samples=controls.num_samples, new_bucket=new_bucket,
                      max_new_tokens=controls.max_new_tokens, widths=widths)


def progress(partial: PartialRollout) -> tuple[int, bool]:
    """(tokens drawn so far, whether every row has stopped or the budget is spent): one host read."""
    step, all_done = jax.device_get((partial.state.step, jnp.all(partial.state.done_b)))
    return int(step), bool(all_done) or int(step) >= partial.max_new_tokens


def _advance_from(cfg: ModelConfig, params, partial: PartialRollout, step: int, steps: int, version: int
                  ) -> PartialRollout:
    """`advance` with the current step known on the host: decodes to each phase's end, widens the
    cache, goes on. If every row stops early, the remaining calls exit at once."""
    target = min(step + steps, partial.max_new_tokens)
    while step < target:
        if step >= partial.width:  # this phase's cache is full: the next phase
            partial = _widen_jit(cfg, partial, partial.widths[partial.widths.index(partial.width) + 1] - partial.width)
        partial = _segment_jit(cfg, params, partial, np.int32(target), np.int32(version))
        step = min(target, partial.width)
    return partial


def advance(cfg: ModelConfig, params, partial: PartialRollout, *, steps: int, version: int) -> PartialRollout:
    """Decodes up to `steps` more tokens with `params` (rows that end stop), recording `version`
    and the behaviour log-prob of every token drawn. `partial` is donated. Reads the step counter
    once (the host widens the cache between phases); `steps` and `version` never recompile."""
    step, _ = progress(partial)
    return _advance_from(cfg, params, partial, step, steps, version)


def swap_weights(cfg: ModelConfig, params, partial: PartialRollout) -> PartialRollout:
    """New weights arrived mid-generation: every row keeps its tokens, and the KV cache of prompt +
    generated-so-far is recomputed under `params`, with no per-token loop: one batched forward of
    the B prompts (shared by their n samples, as in the prefill) and one of every row's generated
    tokens over that cache. The last drawn token is still to be fed, so the next decode step
    computes the next token's logits under `params` from this cache: decoding continues as if
    `params` had produced the cache. Rows that have ended are recomputed too (harmlessly; they
    draw nothing more). `partial` is donated; the versions are recorded by `advance`."""
    return _swap_jit(cfg, params, partial)


def finish(partial: PartialRollout) -> tuple[D.SampleResult, jax.Array]:
    """(`SampleResult`, version_bc [B * n, max_new_tokens]). `result.logprobs` holds, per token, the
    log-prob under the params that drew it (the behaviour log-probs of the decoupled loss)."""
    return _finish_jit(partial)


def _sampler_weights(cfg: ModelConfig, params, controls: SampleControls):
    """A version's params as the segments take them: the sampler's FP8 copy where
    `controls.weight_dtype` asks for one (`rljax.sampling.fp8`, taken at each swap as at each weight
    sync), split per layer once per version (each jitted segment would copy them out again)."""
    if controls.weight_dtype != "model":
        params = sampler_params_jit(params, weight_dtype=controls.weight_dtype)
    return _unstack_jit(params, cfg)


def sample_with_updates(cfg: ModelConfig, prompt_tokens_pt, prompt_mask_pt, key, controls: SampleControls, *,
                        segment_steps: int, weights: Callable[[], tuple[Any, int]]
                        ) -> tuple[D.SampleResult, jax.Array, int]:
    """Samples like `rljax.sampling.sample`, polling `weights() -> (params, version)` before the
    prefill and before every segment of `segment_steps` decode steps; when the version is newer
    than the one decoding, `swap_weights` and go on with the new params. Returns (result,
    version_bc, number of swaps). Waits for each segment to finish before polling (one scalar
    read), so a weight update is taken up at most `segment_steps` tokens after it arrives."""
    if controls.scheduler != "static":
        raise ConfigError(f"sample_with_updates decodes with the static scheduler, got scheduler="
                          f"{controls.scheduler!r}: set sampling.scheduler='static'")
    params, version = weights()
    params = _sampler_weights(cfg, params, controls)
    partial = start(cfg, params, prompt_tokens_pt, prompt_mask_pt, key, controls, version=version)
    swaps = 0
    while True:
        step, finished = progress(partial)
        if finished:
            break
        new_params, new_version = weights()
        if new_version > version:
            params, version = _sampler_weights(cfg, new_params, controls), new_version
            partial = swap_weights(cfg, params, partial)
            swaps += 1
        partial = _advance_from(cfg, params, partial, step, segment_steps, version)
    result, version_bc = finish(partial)
    return result, version_bc, swaps
