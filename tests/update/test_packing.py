"""Padding-free updates (rljax.update.packing): rows packed first-fit decreasing into buffers,
micro-batches sized by tokens, and the update's loss, gradients and metrics equal to the padded
update's for every preset, with one compiled program whatever the lengths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import init_params, preset, token_logprobs
from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
from rljax.optim import OptimConfig
from rljax.update import RolloutBatch, UpdateConfig, init_train_state, microbatch_loss, prepare_batch, update
from rljax.update.loss import aggregation_denominator
from rljax.update.packing import Slab, pack_rows

CFG = preset("qwen2-test")
B, T, PROMPT = 8, 20, 6


def _batch(seed=0, lengths=None):
    """Left-padded prompts (0-3 pads), completions of ragged length: one empty, one at the cap."""
    rng = np.random.default_rng(seed)
    lengths = [0, T - PROMPT, 3, 9, 1, 5, 11, 2] if lengths is None else lengths
    toks = rng.integers(1, CFG.vocab_size, (B, T))
    attn = np.zeros((B, T), bool)
    loss = np.zeros((B, T), bool)
    for i, n in enumerate(lengths):
        attn[i, rng.integers(0, 4):PROMPT + n] = True
        loss[i, PROMPT:PROMPT + n] = True
    toks = np.where(attn, toks, 0)
    params = init_params(CFG, jax.random.key(0))
    logp, _ = token_logprobs(CFG, params, jnp.asarray(toks), jnp.asarray(attn))
    sampler = np.where(loss, np.asarray(logp) + 0.05 * rng.standard_normal((B, T)), 0.0).astype(np.float32)
    return RolloutBatch(tokens_bt=jnp.asarray(toks), attn_mask_bt=jnp.asarray(attn), loss_mask_bt=jnp.asarray(loss),
                        sampler_logp_bt=jnp.asarray(sampler), rewards_b=jnp.asarray(rng.random(B), jnp.float32),
                        group_ids_b=prompt_major_group_ids(B, 4), completion_len=T - PROMPT,
                        baseline_rewards_b=jnp.asarray(rng.random(B), jnp.float32))


def test_pack_rows_is_first_fit_decreasing():
    """Every row with a loss token lands whole in one buffer, longest first into the first buffer
    with room (a NumPy first-fit-decreasing reference), without overlaps; rows with no loss
    token are not packed. Catches an unsorted placement, a row split across buffers, overlaps."""
    batch = _batch()
    attn, loss = np.asarray(batch.attn_mask_bt), np.asarray(batch.loss_mask_bt)
    plan = jax.device_get(pack_rows(batch.attn_mask_bt, batch.loss_mask_bt, T))
    spans = [(np.flatnonzero(a)[-1] - np.flatnonzero(a)[0] + 1) if m.any() else 0 for a, m in zip(attn, loss)]
    fill, want = [], {}
    for r in sorted(range(B), key=lambda r: -spans[r]):  # stable, as argsort(-span, stable)
        if not spans[r]:
            continue
        b = next((i for i, f in enumerate(fill) if f + spans[r] <= T), len(fill))
        fill += [0] * (b + 1 - len(fill))
        want[r] = (b, fill[b])
        fill[b] += spans[r]
    got = {r: (int(plan.buffer_b[r]), int(plan.offset_b[r])) for r in range(B) if plan.buffer_b[r] >= 0}
    assert got == want and int(plan.num_buffers) == len(fill)
    assert int(plan.buffer_b[0]) == -1  # the empty completion


PRESETS = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "remax", "ppo", "gspo", "cispo"]
# The whole `update` (packed micro-batch loop, optimiser step) is compared for a sequence-mean and
# a normalised-sum aggregation and for the critic (token-mean); every preset's loss, gradients and
# metrics, through the same packed slabs, are compared in the first half of the test.
WHOLE_UPDATE = ["grpo", "dr_grpo", "ppo"]


def _state(algorithm, **update_kw):
    algo = AlgorithmConfig(algorithm=algorithm, entropy_coef=0.01)
    # eps = 1: the step is about lr (1 - b1) g, linear in the gradient; Adam's default eps turns a
    # 1e-9 gradient difference on a near-zero entry into a whole step of the other sign
    return init_train_state(CFG, init_params(CFG, jax.random.key(0)), algo, OptimConfig(learning_rate=1e-3, eps=1.0),
                            update_cfg=UpdateConfig(**update_kw), key=jax.random.key(1))


def _grads_and_pairs(state, prepared, den, slabs=None):
    """Summed gradients and metric pairs of the padded micro-batch, or of packed slabs."""
    kw = dict(cfg=CFG, algo=state.algo, update_cfg=state.update_cfg,
              norm_length=state.algo.norm_length or prepared.tokens_bt.shape[1] - PROMPT)
    fn = jax.value_and_grad(microbatch_loss, has_aux=True)
    if slabs is None:
        (_, (pairs, _)), g = fn(state.trainable, prepared, den, **kw)
        return g, pairs
    total_g, total_pairs = None, None
    for slab in slabs:
        (_, (pairs, _)), g = fn(state.trainable, prepared, den, share=1.0 / len(slabs), slab=slab, **kw)
        total_g = g if total_g is None else jax.tree.map(jnp.add, total_g, g)
        total_pairs = pairs if total_pairs is None else jax.tree.map(jnp.add, total_pairs, pairs)
    return total_g, total_pairs


def _close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, atol=1e-6 * max(1.0, float(np.abs(b).max())), rtol=1e-5, err_msg=what)


@pytest.mark.parametrize("algorithm", PRESETS)
def test_packed_update_equals_padded(algorithm):
    """For every preset (PPO with its critic): the packed update's gradients (every leaf), loss
    and metric pairs equal the padded micro-batch's within 1e-6 of the scale, as one packed
    micro-batch and as three (each loss numerator over the mini-batch's denominator); and, for
    GRPO, Dr. GRPO and PPO with its critic, the whole `update` (packing on vs off) gives the same
    metrics and parameters.

    Catches a row attended across its buffer neighbours, positions not restarting per row,
    outputs gathered back to the wrong columns, a row scored twice or dropped, and the
    mean-of-means accumulation (each micro-batch over its own token count, averaged: off by the
    raggedness of the micro-batches)."""
    state = _state(algorithm)
    prepared, _ = prepare_batch(state, _batch())
    den = aggregation_denominator(prepared, state.algo, state.algo.norm_length or T - PROMPT)
    g_pad, pairs_pad = _grads_and_pairs(state, prepared, den)
    plan = pack_rows(prepared.attn_mask_bt, prepared.loss_mask_bt, T)
    n = int(plan.num_buffers)
    assert 3 < n < B  # packing saved buffers, and there are enough for three micro-batches
    for per in (n, -(-n // 3)):
        slabs = [Slab(plan, jnp.asarray(i * per), per) for i in range(-(-n // per))]
        g, pairs = _grads_and_pairs(state, prepared, den, slabs)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_pad)):
            _close(a, b, f"{algorithm} {per}: grad {jax.tree_util.keystr(path)}")
        for k in pairs_pad:
            _close(pairs[k][0] / pairs[k][1], pairs_pad[k][0] / pairs_pad[k][1], f"{algorithm} {per}: {k}")

    if algorithm not in WHOLE_UPDATE:
        return
    packed_state, m_packed = update(_state(algorithm, packing=True, max_tokens_per_microbatch=2 * T), _batch(),
                                    jax.random.key(0))
    padded_state, m_padded = update(_state(algorithm), _batch(), jax.random.key(0))
    for k, v in m_padded.items():
        _close(m_packed[k], v, f"{algorithm}: metric {k}")
    for a, b in zip(jax.tree.leaves(packed_state.trainable), jax.tree.leaves(padded_state.trainable)):
        _close(a, b, f"{algorithm}: params after the update")
    assert float(m_packed["update/pad_fraction"]) < float(m_packed["update/pad_fraction_padded"])


def test_one_program_for_any_lengths():
    """Three batches of one shape with different completion lengths (so different buffer and
    micro-batch counts) run through one compiled packed update: the micro-batch loop's trip
    count is data, not shape. Catches a buffer count that reaches a static shape."""
    from rljax.update import update_step

    state = _state("grpo", packing=True, max_tokens_per_microbatch=T)
    before = update_step._cache_size()
    counts = []
    for seed, lengths in enumerate(([1] * B, [T - PROMPT] * B, [0, 14, 3, 9, 1, 5, 11, 2])):
        state, m = update_step(state, _batch(seed, lengths), jax.random.key(seed))
        counts.append(int(m["update/packed_microbatches"]))
    assert update_step._cache_size() == before + 1
    assert len(set(counts)) == 3, counts


def test_packing_refuses_row_count_micro_batches():
    """`update.packing` with `num_microbatches > 1` is one ConfigError line naming the setting and
    both ways out (a token budget, or packing off)."""
    from rljax.errors import ConfigError

    with pytest.raises(ConfigError, match="num_microbatches=2 .*max_tokens_per_microbatch.*packing=false") as err:
        UpdateConfig(packing=True, num_microbatches=2)
    assert "\n" not in str(err.value)


def test_packed_lora_update_equals_padded():
    """A LoRA state (adapters trained on the frozen base, KL to the base): the packed update's
    metrics and adapters equal the padded update's. Catches a packed forward that bypasses the
    adapters (`TrainState.models`)."""
    from rljax.lora import LoraConfig

    def run(**kw):
        algo = AlgorithmConfig(algorithm="grpo", kl_coef=0.05)
        state = init_train_state(CFG, init_params(CFG, jax.random.key(0)), algo,
                                 OptimConfig(learning_rate=1e-3, eps=1.0), update_cfg=UpdateConfig(**kw),
                                 key=jax.random.key(1), lora=LoraConfig(rank=4))
        return update(state, _batch(), jax.random.key(0))

    (packed, m_packed), (padded, m_padded) = run(packing=True, max_tokens_per_microbatch=2 * T), run()
    for k, v in m_padded.items():
        _close(m_packed[k], v, f"lora: metric {k}")
    for a, b in zip(jax.tree.leaves(packed.adapters), jax.tree.leaves(padded.adapters)):
        _close(a, b, "lora: adapters after the update")


def test_packed_update_on_a_sharded_mesh_equals_one_device():
    """The packed update compiled with the trainer layout (fsdp over 8 simulated devices, batch
    sharded) gives the one-device packed update's metrics and params (1e-5)."""
    from rljax import sharding
    from rljax.update import update_step

    state = _state("grpo", packing=True, max_tokens_per_microbatch=2 * T)
    host_state = jax.tree.map(np.asarray, state)
    ref_state, ref_metrics = update_step(state, _batch(), jax.random.key(3))
    layout = sharding.trainer_layout(sharding.make_mesh(sharding.MeshConfig(1, 8, 1)))
    state_sh, batch_sh = layout.tree(host_state), layout.batch(_batch())
    step = sharding.make_sharded(update_step, layout.mesh, (state_sh, batch_sh, layout.replicated),
                                 (state_sh, layout.replicated))
    new_state, metrics = step(jax.device_put(host_state, state_sh), jax.device_put(_batch(), batch_sh),
                              jax.random.key(3))
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), float(v), atol=1e-5, rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_fused_iteration_runs_the_packed_update():
    """Sample -> verify -> packed update as one compiled iteration (the fused form the default job
    runs) gives the unpacked iteration's metrics from the same key, with the packing metrics.
    Catches a packing switch the iteration does not reach."""
    from rljax.stages.iteration import make_iteration
    from test_iteration import CONTROLS, P, _prompts, reward_callback

    tokens, mask, index = _prompts(3)
    runs = []
    for kw in ({}, dict(packing=True, max_tokens_per_microbatch=2 * 12)):
        state = _state("grpo", **kw)
        iteration = make_iteration(CONTROLS, reward_callback, num_groups=P)
        runs.append(iteration(state, tokens, mask, index, jax.random.key(11))[1])
    padded, packed = runs
    assert "update/pad_fraction" in packed and "update/pad_fraction" not in padded
    for k, v in padded.items():
        _close(packed[k], v, f"iteration metric {k}")


def test_packed_multi_turn_rows_equal_padded():
    """Multi-turn rows (model turn, environment tokens, model turn): the environment's tokens
    are attended but carry no loss, and turn-level credit gives each model turn its own return
    (`TurnReturns`, GRPO's turn-group advantages). Packed equals padded: metrics and parameters
    after a whole update, with 2 token-budget micro-batches.

    Catches a packed row cut at its first loss hole, or packed without its environment tokens
    (the second model turn would lose that context: its log-probs, and so every loss metric,
    would differ), and environment tokens entering the packed loss."""
    from rljax.update import TurnReturns

    base = _batch(1, lengths=[12, 14, 9, 0, 13, 10, 14, 11])
    loss = np.asarray(base.loss_mask_bt).copy()
    turn = np.where(loss, 0, -1)
    for i in range(B):  # tokens PROMPT+4 .. PROMPT+6 are the environment's; the model's turn 1 follows
        if loss[i].sum() > 7:
            loss[i, PROMPT + 4:PROMPT + 7] = False
            turn[i, PROMPT + 4:PROMPT + 7] = -1
            turn[i, PROMPT + 7:] = np.where(loss[i, PROMPT + 7:], 1, -1)
    returns = np.random.default_rng(5).random((B, 2)).astype(np.float32)
    batch = base.replace(loss_mask_bt=jnp.asarray(loss), sampler_logp_bt=jnp.where(loss, base.sampler_logp_bt, 0.0),
                         turn_returns=TurnReturns(jnp.asarray(turn, jnp.int32), jnp.asarray(returns)))
    packed_state, m_packed = update(_state("grpo", packing=True, max_tokens_per_microbatch=2 * T), batch,
                                    jax.random.key(0))
    padded_state, m_padded = update(_state("grpo"), batch, jax.random.key(0))
    assert int(m_packed["update/packed_microbatches"]) >= 2
    for k, v in m_padded.items():
        _close(m_packed[k], v, f"multi-turn: metric {k}")
    for a, b in zip(jax.tree.leaves(packed_state.trainable), jax.tree.leaves(padded_state.trainable)):
        _close(a, b, "multi-turn: params after the update")
