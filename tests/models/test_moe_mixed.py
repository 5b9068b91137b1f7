"""Stacks that mix dense and MoE layers (Qwen's `mlp_only_layers` and `decoder_sparse_step`):
`rljax.models.mlp_kinds`, against tiny random transformers Qwen3-MoE and Qwen2-MoE models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import rljax.models as M
from hf_factory import save_random_model
from moe_hf import hf_logits_and_routers, left_padded, unit_router
from rljax.errors import CheckpointError
from rljax.models.mlp_kinds import layer_kinds, segments
from rljax.models.moe_config import MoEConfig, dense_layers_from_hf
from rljax.models.moe_losses import load_balancing_loss
from rljax.models.transformer import hidden_states_and_routes
from rljax.sampling import SampleControls, generate

TOL = 1e-4
# 4 layers, mlp_only_layers=[0], decoder_sparse_step=2: layers 1 and 3 sparse, 0 and 2 dense, so
# the depth runs dense, MoE, dense, MoE (four segments; each kind twice)
_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False, intermediate_size=88,
               moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
               decoder_sparse_step=2)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_COMMON, head_dim=16),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**_COMMON, shared_expert_intermediate_size=56,
                                                     norm_topk_prob=True),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def mixed(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = save_random_model(FAMILIES[request.param](), path, unit_router)
    cfg, params = M.load_hf(path)
    return request.param, path, model, cfg, params


def _rows(seed, batch=3, length=12):
    return left_padded(np.random.default_rng(seed), batch, length, 96)


@pytest.mark.parametrize("step,only,layers", [(1, [], 4), (2, [], 4), (2, [0], 4), (3, [1, 4], 6), (1, [0, 2], 3)])
def test_layer_kinds_follow_transformers_rule(step, only, layers):
    """Our per-layer MLP kinds equal the block transformers builds in each layer (a sparse MoE
    block iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0). Catches the
    rule off by one ((i % step) == 0), mlp_only_layers ignored, or the two joined by `and`."""
    hf = transformers.Qwen3MoeConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=layers,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                     moe_intermediate_size=4, num_experts=2, num_experts_per_tok=1,
                                     decoder_sparse_step=step, mlp_only_layers=only)
    model = transformers.Qwen3MoeForCausalLM(hf)
    theirs = tuple("moe" if "Sparse" in type(layer.mlp).__name__ else "dense" for layer in model.model.layers)
    dense = dense_layers_from_hf(hf.to_dict())
    cfg = M.preset("qwen2-test", num_layers=layers, moe=MoEConfig(num_experts=2, top_k=1, expert_size=4,
                                                                  dense_layers=dense))
    assert layer_kinds(cfg) == theirs
    assert sum(s.stop - s.start for s in segments(cfg)) == layers


def test_mixed_stack_logits_and_routes_match_transformers(mixed):
    """4 layers (dense, MoE, dense, MoE), ragged left-padded rows: f32 logits equal transformers'
    within 1e-4 (grouped experts; grouped == dense is `test_moe.py`'s); the routing has one row
    per sparse layer (2), equal to transformers' router logits and top-k; the load-balancing loss
    equals transformers' `load_balancing_loss_func` over its (sparse-only) router logits.
    Catches dense layers computed with the MoE MLP or the width `moe_intermediate_size`, a
    segment given the wrong rows of a kind's stack, and routing rows (or a router loss) for dense
    layers."""
    family, _, model, cfg, params = mixed
    assert cfg.moe.dense_layers == (0, 2) and params["layers"]["gate"].shape == (2, 64, 88)
    assert params["layers"]["router"].shape == (2, 64, 4) and params["layers"]["q"].shape[0] == 4
    tokens, mask = _rows(1)
    ref, routers = hf_logits_and_routers(model, tokens, mask)
    h, aux = hidden_states_and_routes(cfg, params, jnp.asarray(tokens), attn_mask_bt=jnp.asarray(mask))
    ours = M.logits_from_hidden(cfg, params, h)
    np.testing.assert_allclose(np.asarray(ours)[mask], ref[mask], atol=TOL, rtol=0)
    assert aux.routes_btk.shape == (2, *tokens.shape, 2) and len(routers) == 2
    for layer, logits_te in enumerate(routers):
        hf_routes = torch.topk(torch.softmax(torch.tensor(logits_te), -1), 2).indices.numpy()
        np.testing.assert_array_equal(np.asarray(aux.routes_btk[layer])[mask], hf_routes.reshape(*mask.shape, 2)[mask])
        np.testing.assert_allclose(np.asarray(aux.router_logits_bte[layer])[mask],
                                   logits_te.reshape(*mask.shape, -1)[mask], atol=TOL, rtol=0)
    # the load-balancing loss over the sparse layers only, as transformers computes it
    hf_lb = load_balancing_loss_func(tuple(torch.tensor(r) for r in routers), 4, 2, torch.tensor(mask))
    np.testing.assert_allclose(float(load_balancing_loss(aux, jnp.asarray(mask), 4, 2)), float(hf_lb), rtol=1e-5)


def test_mixed_stack_greedy_decoding_and_recorded_routes(mixed):
    """The sampler's cached decode loop (per-layer MLP kinds) emits transformers' greedy tokens,
    and its routing record has one row per sparse layer equal to a teacher-forced forward's top-k.
    Catches the unrolled loop using one MLP kind for every layer, and a record laid out over all
    layers."""
    family, _, model, cfg, params = mixed
    if family != "qwen3_moe":
        pytest.skip("checked on qwen3_moe; qwen2_moe shares the code path")
    prompt = np.random.default_rng(2).integers(1, cfg.vocab_size, (1, 6))
    res = generate(cfg, params, prompt, np.ones_like(prompt, bool), key=jax.random.key(0),
                   controls=SampleControls(max_new_tokens=5, greedy=True, eos_ids=(), pad_id=0, record_routes=True))
    with torch.no_grad():
        hf = model.generate(torch.tensor(prompt), max_new_tokens=5, do_sample=False, min_new_tokens=5)
    np.testing.assert_array_equal(np.asarray(res.tokens)[0], hf.numpy()[0, 6:])
    full = jnp.asarray(hf.numpy())
    _, aux = hidden_states_and_routes(cfg, params, full)
    own_tlk = np.asarray(aux.routes_btk)[:, 0].transpose(1, 0, 2)  # [T, L_sparse, k]
    rec = np.asarray(res.routes)[0]  # completion tokens [N, L_sparse, k]; the last one never fed back
    assert rec.shape == (5, 2, 2) and np.asarray(res.prompt_routes).shape[-2:] == (2, 2)
    prompt_rec = np.asarray(res.prompt_routes)[0]  # the prompt bucket, left-padded (-1)
    np.testing.assert_array_equal(prompt_rec[prompt_rec[:, 0, 0] >= 0], own_tlk[:6])
    np.testing.assert_array_equal(rec[:4], own_tlk[6:10])


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_mixed_stack_export_reloads(mixed, tmp_path, layout):
    """Exported in either expert layout, transformers builds the same dense and sparse layers and
    gives equal logits, and rljax loads the export back to equal params. Catches export writing
    a kind's row i as layer i (a dense MLP under a sparse layer) or mlp_only_layers lost."""
    family, _, model, cfg, params = mixed
    M.save_hf(cfg, params, tmp_path / "out", expert_layout=layout)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens, mask = _rows(3, 2, 10)
    np.testing.assert_allclose(hf_logits_and_routers(reloaded, tokens, mask)[0][mask],
                               hf_logits_and_routers(model, tokens, mask)[0][mask], atol=1e-6, rtol=0)
    back_cfg, back = M.load_hf(tmp_path / "out")
    assert back_cfg.moe.dense_layers == (0, 2)
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_mixed_checkpoint_that_disagrees_with_its_config_is_refused(mixed, tmp_path):
    """A checkpoint whose config.json moves the dense layers (decoder_sparse_step=1: every layer
    sparse) is refused in one line, not loaded with weights in the wrong layers."""
    family, path, model, cfg, params = mixed
    if family != "qwen3_moe":
        pytest.skip("checked once")
    import json
    import shutil

    shutil.copytree(path, tmp_path / "bad")
    conf = json.loads((tmp_path / "bad" / "config.json").read_text())
    conf.update(decoder_sparse_step=1, mlp_only_layers=[0])
    (tmp_path / "bad" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match="MLP kind"):
        M.load_hf(tmp_path / "bad")


def test_mixed_stack_update_router_loss_and_replay():
    """A random-init mixed stack (layers 0 and 2 dense) through `update_step` with routing replay
    on: with an empty record (-1 everywhere: each token routed by the router's own top-k, as
    without replay) `loss/router_aux` equals transformers' `load_balancing_loss_func` on the
    sparse layers' router logits of a separate forward; replaying the trainer's own routes (a
    [B, T, 2, k] record) gives that update within 1e-6 and route agreement 1; a record flipped on
    the second sparse layer (layer 3) lowers the agreement to exactly the flipped share and
    changes the update. All three updates are one compiled program (same config, same record
    shape). Catches the router loss over all layers, a record sliced onto the wrong segment
    (layer 1's record replayed at layer 3), and a replay the segmented scan drops."""
    from rljax.objectives import AlgorithmConfig, prompt_major_group_ids
    from rljax.optim import OptimConfig
    from rljax.update import RolloutBatch, init_train_state, update_step

    cfg = M.preset("qwen2-test", num_layers=4, moe=MoEConfig(num_experts=4, top_k=2, expert_size=32,
                                                             dense_layers=(0, 2)))
    params = M.init_params(cfg, jax.random.key(0), std=0.3)
    assert params["layers"]["gate"].shape[0] == 2 and params["layers"]["router"].shape[0] == 2
    rng = np.random.default_rng(0)
    b, t = 8, 10
    attn = np.ones((b, t), bool)
    attn[1, :2] = False
    loss = np.zeros((b, t), bool)
    loss[:, 4:] = True
    batch = RolloutBatch(tokens_bt=jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32),
                         attn_mask_bt=jnp.asarray(attn), loss_mask_bt=jnp.asarray(loss),
                         sampler_logp_bt=jnp.zeros((b, t), jnp.float32),
                         rewards_b=jnp.asarray(rng.random(b), jnp.float32), group_ids_b=prompt_major_group_ids(b, 4),
                         completion_len=t - 4)
    _, aux = hidden_states_and_routes(cfg, params, batch.tokens_bt, attn_mask_bt=batch.attn_mask_bt)
    logits = tuple(torch.tensor(np.asarray(x)[attn]) for x in aux.router_logits_bte)
    hf_lb = float(load_balancing_loss_func(logits, 4, 2))

    replay = AlgorithmConfig(algorithm="grpo", router_aux_coef=1.0, routing_replay="rollout")

    def run(record):
        state = init_train_state(cfg, jax.tree.map(jnp.array, params), replay, OptimConfig(learning_rate=1e-2))
        return jax.tree.map(np.asarray, update_step(state, batch.replace(routes_btlk=record), jax.random.key(0)))

    own = jnp.where(batch.attn_mask_bt[..., None, None], aux.routes_btk.transpose(1, 2, 0, 3), -1).astype(jnp.int8)
    plain, m = run(jnp.full_like(own, -1))
    np.testing.assert_allclose(float(m["loss/router_aux"]), hf_lb, rtol=1e-5)
    same, m_same = run(own)
    assert float(m_same["moe/route_agreement"]) == 1.0
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), same.params, plain.params)
    flip = own.at[:, :, 1].set(jnp.where(own[:, :, 1] >= 0, (own[:, :, 1] + 1) % 4, -1))  # layer 3 only
    flipped, m_flip = run(flip)
    changed = ~np.all(np.sort(np.asarray(flip), -1) == np.sort(np.asarray(own), -1), -1)[attn]  # [tokens, 2]
    np.testing.assert_allclose(float(m_flip["moe/route_agreement"]), 1.0 - changed.mean(), rtol=1e-6)
    assert changed[:, 1].mean() > 0.5 and not changed[:, 0].any()
    assert np.abs(flipped.params["layers"]["router"][1] - plain.params["layers"]["router"][1]).max() > 1e-6


def test_inspect_and_plan_count_a_mixed_stack(mixed, capsys):
    """`rljax inspect` prints transformers' parameter count and the active parameters of a mixed
    stack (the idle experts of the 2 sparse layers only), and `rljax plan`'s hand count
    (`moe_params`) agrees. Catches counting every layer as sparse (or dense layers at the experts'
    width)."""
    from rljax.cli import main
    from rljax.plan.moe import moe_params

    family, path, model, cfg, params = mixed
    if family != "qwen2_moe":
        pytest.skip("checked on the family with a shared expert")
    assert main(["inspect", str(path)]) == 0
    fields = {line[:28].strip(): line[28:].strip() for line in capsys.readouterr().out.splitlines()}
    total = sum(p.numel() for p in model.parameters())
    idle = 2 * (4 - 2) * 3 * 64 * 40  # 2 sparse layers, E - k experts of 3 D F each
    assert fields["parameters"] == f"{total:,}" and fields["active parameters"] == f"{total - idle:,}"
    assert fields["dense MLP layers"] == "[0, 2] of 4"
    assert moe_params(cfg) == (total, total - idle)
