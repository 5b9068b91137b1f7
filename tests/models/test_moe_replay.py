"""Routing replay on a near-tied router: a bf16 sampler (decode path, KV cache) and an f32 trainer
(full-sequence forward), the setup of an RL stack whose sampler serves in bf16, route some tokens
differently; replaying the sampler's record makes the trainer route every token as the sampler
did and shrinks the log-prob gap. (With both in bf16 compute, rljax's f32 residual stream makes
the two paths' router inputs round to the same bf16 values almost always, so flips are rare.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rljax.models as M
from rljax.models.moe_config import MoEConfig
from rljax.models.transformer import hidden_states, hidden_states_and_routes, logits_from_hidden

B, P, N = 4, 8, 8


def _sample(cfg, params, prompt):
    """Greedy decoding through the KV cache, recording each token's log-prob and every layer's
    routes ([L, B, P + N, k], the prompt's from the prefill)."""
    step = jax.jit(lambda p, tok, pos, c: hidden_states(cfg, p, tok, pos, None, c, return_routes=True))
    cache = M.init_cache(cfg, B, P + N)
    h, cache, routes = step(params, prompt, jnp.broadcast_to(jnp.arange(P), (B, P)), cache)
    tokens, logps, records = [prompt], [], [routes]
    for i in range(N):
        logp_bv = jax.nn.log_softmax(logits_from_hidden(cfg, params, h[:, -1:])[:, 0])
        tok = jnp.argmax(logp_bv, -1)
        logps.append(jnp.take_along_axis(logp_bv, tok[:, None], -1)[:, 0])
        tokens.append(tok[:, None])
        h, cache, routes = step(params, tok[:, None], jnp.full((B, 1), P + i), cache)
        records.append(routes)
    return jnp.concatenate(tokens, 1), jnp.stack(logps, 1), jnp.concatenate(records, 2)


def _trainer_logp(cfg, params, tokens, record=None):
    h, aux = hidden_states_and_routes(cfg, params, tokens, routes_lbtk=record)
    logp_btv = jax.nn.log_softmax(logits_from_hidden(cfg, params, h[:, P - 1:-1]))
    return jnp.take_along_axis(logp_btv, tokens[:, P:, None], -1)[..., 0], aux


def test_replay_removes_route_disagreement_and_shrinks_the_logprob_gap():
    """A router scaled down so its top-2 of 8 are near ties; sampler bf16, trainer f32. Without replay the
    trainer's own routes differ from the sampler's on some token-layer choices and its log-probs
    differ from the sampler's; replaying the record, its routes equal the record on every token
    and the largest log-prob gap falls. A record covering only the completion (the prompt's
    routes replaced by the trainer's own guesses) is a different record: replay then does not
    reproduce the sampler's routes on the prompt."""
    cfg = M.preset("qwen2-test", num_layers=3, moe=MoEConfig(num_experts=8, top_k=2, expert_size=32,
                                                             norm_topk_prob=True))
    sampler_cfg = cfg.replace(compute_dtype="bfloat16")
    params = M.init_params(cfg, jax.random.key(0), std=0.05)
    r = params["layers"]["router"]
    # A large component shared by every expert (it cancels in the softmax, its rounding does not)
    # plus small distinct ones: router logits whose top-2 of 8 are near ties.
    params["layers"]["router"] = 20 * r[..., :1] + 0.3 * r
    prompt = jax.random.randint(jax.random.key(1), (B, P), 1, cfg.vocab_size)
    tokens, sampler_logp, record = _sample(sampler_cfg, params, prompt)
    assert record.shape == (cfg.num_layers, B, P + N, 2)

    trainer = jax.jit(lambda r: _trainer_logp(cfg, params, tokens, r))
    own_logp, own = jax.jit(lambda: _trainer_logp(cfg, params, tokens))()
    same = np.all(np.sort(np.asarray(own.routes_btk), -1) == np.sort(np.asarray(record), -1), -1)
    disagree = 1 - same.mean()
    gap_off = float(jnp.max(jnp.abs(own_logp - sampler_logp)))
    replay_logp, replayed = trainer(record)
    gap_on = float(jnp.max(jnp.abs(replay_logp - sampler_logp)))
    print(f"route disagreement without replay: {disagree:.4f} of token-layer choices; "
          f"max |logp gap| off {gap_off:.3e}, on {gap_on:.3e}")
    assert 0 < disagree < 0.5
    np.testing.assert_array_equal(replayed.routes_btk, record)
    assert gap_on < gap_off

    completion_only = record.at[:, :, :P].set(own.routes_btk[:, :, :P])
    _, partial = trainer(completion_only)
    assert not np.array_equal(np.asarray(partial.routes_btk), np.asarray(record))
