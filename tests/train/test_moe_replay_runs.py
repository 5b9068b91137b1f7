"""Routing replay end to end: a tiny MoE policy (configs/moe_default.toml, shrunk) trained for two
iterations through the host's replay loop (`rl.replay`), async partial rollouts
(`rl.partial_rollouts`) and the fused multi-turn episode iteration (`[env]`), with
`algorithm.routing_replay = "rollout"`.

The sampler runs FP8 weights (`sampling.weight_dtype = "fp8"`), so its routers pick other experts
than the f32 trainer's on some tokens. `moe/route_agreement` is the share of token-layers whose
trainer's own top-k equals the experts the trainer's forward computed them with: exactly 1 when
the forward routes by its own router, below 1 only when it computed tokens with the sampler's
recorded experts. So agreement < 1 in the update shows the record reached the trainer's forward
through that mode's whole path (rollout, queue or buffer, batch, update); a mode that dropped the
record on the way (a buffer that stored rows without their routes, a partial rollout that lost
the record at a weight swap, an episode batch without it) logs exactly 1 and fails. In the
partial-rollout and episode runs the samplers' routes agreed with the trainer's on every
token-layer (their `update/logp_diff_max` was 0: these samplers ran the trainer's weights), so
those modes shift the record's expert ids as it leaves the rollout instead (`_shift_records`).

The held-out evaluations (before RL and after the last iteration) are stubbed: they read no
record and update nothing, and their greedy sampling programs were about a fifth of each run's
compile time."""

from __future__ import annotations

import math

import pytest

from rljax.train.config import load_config

SHRINK = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=2",
          "model.num_kv_heads=1", "model.head_dim=16", "model.num_experts=4", "model.moe_intermediate_size=16",
          "eval.size=4", "eval.every=100", "eval.seeds=1", "warm_start.steps=0", "rl.prompts_per_iteration=2",
          "sampling.num_samples=2", "sampling.max_new_tokens=3", "metrics.tensorboard=false",
          "metrics.progress_bar=false", "checkpoint.every=100", "rl.iterations=2", "sampling.weight_dtype='fp8'",
          "data.size=40", "data.eval_size=4"]
OFF_POLICY = ["algorithm.recompute_old_logp=true", "algorithm.off_policy='tis'"]
MODES = {
    "rl.replay": ["rl.replay.capacity=8", *OFF_POLICY],
    "partial_rollouts": ["mesh.devices=2", "mesh.sampler_devices=1", "rl.mode=async", "rl.partial_rollouts=true",
                         *OFF_POLICY],
    "fused_episodes": ["env.name=calculator", "model.tokenizer='chars:0123456789+-*= <>/.tolresuhangdi'"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_trainer_computes_with_the_sampler_record(mode, tmp_path, monkeypatch):
    from rljax.train.loop import train

    cfg = load_config("moe_default", SHRINK + MODES[mode] + [f"output_dir='{tmp_path}'"])
    _no_evaluation(monkeypatch)
    if mode != "rl.replay":  # these samplers' FP8 routes agreed with the trainer's: shift the record instead
        _shift_records(monkeypatch, mode)
    assert cfg.algorithm.needs.routes
    history = [r for r in train(cfg, log=lambda *_: None).history if "moe/route_agreement" in r]
    assert len(history) == 2
    agreement = [float(r["moe/route_agreement"]) for r in history]
    print(f"\n{mode}: moe/route_agreement {agreement}, update/logp_diff_max "
          f"{[round(float(r['update/logp_diff_max']), 4) for r in history]}")
    if mode != "rl.replay":  # a shifted record: the trainer's own routes agree with it almost nowhere
        assert max(agreement) < 0.5
    else:  # FP8 sampler routes: most agree, some do not
        assert 0.3 < min(agreement) < 1.0
    assert all(math.isfinite(float(r["update/logp_diff_max"])) for r in history)


def _no_evaluation(monkeypatch):
    """The run's held-out evaluation answers 0 without sampling (not what these tests check)."""
    from rljax.train import loop, start

    for module in (loop, start):
        monkeypatch.setattr(module, "evaluate", lambda run, state: {"eval/accuracy": 0.0})


def _shift_records(monkeypatch, mode):
    """Every expert id of the rollout's record + 1 (mod 4), as the batch leaves the rollout (the
    episode batch, or `rollout_from_samples` for partial rollouts): a record the trainer replays
    then differs from its own top-k on every covered token-layer (a shifted pair of 4 experts is
    never the same pair), so agreement falls far below 1 if and only if the update computed with
    the record."""
    import jax.numpy as jnp

    from rljax.stages import episodes, iteration

    shift = lambda b: b.replace(routes_btlk=jnp.where(b.routes_btlk >= 0, (b.routes_btlk + 1) % 4,  # noqa: E731
                                                      b.routes_btlk).astype(b.routes_btlk.dtype))
    if mode == "fused_episodes":
        real = episodes.episodes_to_batch
        monkeypatch.setattr(episodes, "episodes_to_batch", lambda *a, **k: (lambda o: o.replace(
            batch=shift(o.batch)))(real(*a, **k)))
    else:
        real_scores = iteration.rollout_from_samples
        monkeypatch.setattr(iteration, "rollout_from_samples", lambda *a, **k: (lambda o: (shift(o[0]), *o[1:]))(
            real_scores(*a, **k)))
