"""MoE models: parity with transformers' Qwen3-MoE, Mixtral and Qwen2-MoE (logits, routes, greedy
decoding, export, both expert layouts), and the grouped expert matmul against the dense reference."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file

import rljax.models as M
from hf_factory import save_random_model
from moe_hf import hf_logits_and_routers, left_padded, unit_router
from rljax.errors import CheckpointError
from rljax.models.experts import ExpertWeights, experts_apply
from rljax.models.moe import moe_mlp
from rljax.models.moe_config import MoEConfig
from rljax.models.transformer import hidden_states_and_routes
from rljax.sampling import SampleControls, generate

TOL = 1e-4
_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_COMMON, head_dim=16, intermediate_size=112,
                                                     moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2),
    "mixtral": lambda: transformers.MixtralConfig(**_COMMON, intermediate_size=40, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "mixtral_top8": lambda: transformers.MixtralConfig(**_COMMON, intermediate_size=24, num_local_experts=8,
                                                       num_experts_per_tok=8),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**_COMMON, intermediate_size=112, moe_intermediate_size=40,
                                                     shared_expert_intermediate_size=56, num_experts=4,
                                                     num_experts_per_tok=2, norm_topk_prob=True),
}


def make_moe_checkpoint(family: str, path, seed: int = 0):
    """A random-init MoE model saved to `path`: norms and biases randomised, and the routers drawn
    at unit scale per logit (the HF init's are near zero, so top-k would be decided by ties)."""
    torch.manual_seed(seed)
    return save_random_model(FAMILIES[family](), path, unit_router)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_moe_checkpoint(request.param, path)
    cfg, params = M.load_hf(path)
    return request.param, path, model, cfg, params


def test_logits_and_routes_match_transformers(moe_ckpt):
    """On ragged left-padded rows, f32 logits equal transformers' within 1e-4 at every real
    token, for the grouped and the dense experts, and every layer's router picks transformers'
    top-k (same experts, same order) on every real token."""
    family, _, model, cfg, params = moe_ckpt
    assert cfg.moe.num_experts == (8 if family == "mixtral_top8" else 4)
    tokens, mask = left_padded(np.random.default_rng(1), 3, 12, cfg.vocab_size)
    ref, ref_router = hf_logits_and_routers(model, tokens, mask)
    for impl in ("grouped", "dense"):
        c = cfg.replace(moe=cfg.moe.replace(impl=impl))
        ours, _ = M.forward(c, params, jnp.asarray(tokens), attn_mask_bt=jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(ours)[mask], ref[mask], atol=TOL, rtol=0)
    _, aux = hidden_states_and_routes(cfg, params, jnp.asarray(tokens), attn_mask_bt=jnp.asarray(mask))
    k = cfg.moe.top_k
    for layer, logits_te in enumerate(ref_router):
        hf_routes = torch.topk(torch.softmax(torch.tensor(logits_te), -1), k).indices.numpy()
        np.testing.assert_array_equal(np.asarray(aux.routes_btk[layer])[mask], hf_routes.reshape(*mask.shape, k)[mask])
        np.testing.assert_allclose(np.asarray(aux.router_logits_bte[layer])[mask],
                                   logits_te.reshape(*mask.shape, -1)[mask], atol=TOL, rtol=0)


def test_greedy_decoding_matches_transformers(moe_ckpt):
    """rljax's sampler, greedy, emits transformers' `generate` tokens exactly (Qwen3-MoE and
    Mixtral top-8 of 8; the other two share their code paths)."""
    family, _, model, cfg, params = moe_ckpt
    if family not in ("qwen3_moe", "mixtral_top8"):
        pytest.skip("greedy decoding is checked on qwen3_moe and mixtral_top8")
    prompt = np.random.default_rng(2).integers(1, cfg.vocab_size, (1, 6))
    res = generate(cfg, params, prompt, np.ones_like(prompt, bool), key=jax.random.key(0),
                   controls=SampleControls(max_new_tokens=8, greedy=True, eos_ids=(), pad_id=0))
    with torch.no_grad():
        hf = model.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(res.tokens)[0], hf.numpy()[0, 6:])


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_export_reloads_in_transformers(moe_ckpt, tmp_path, layout):
    """Exported in either expert layout, transformers loads the model with equal logits, and
    rljax loads it back to the same params."""
    family, _, model, cfg, params = moe_ckpt
    M.save_hf(cfg, params, tmp_path / "out", expert_layout=layout)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens, mask = left_padded(np.random.default_rng(3), 2, 10, cfg.vocab_size)
    np.testing.assert_allclose(hf_logits_and_routers(reloaded, tokens, mask)[0][mask],
                               hf_logits_and_routers(model, tokens, mask)[0][mask],
                               atol=1e-6, rtol=0)
    _, back = M.load_hf(tmp_path / "out")
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_hand_written_per_expert_checkpoint_loads(tmp_path):
    """A checkpoint written by hand in the Hub's per-expert layout (Mixtral's
    block_sparse_moe.experts.N.w1/w3/w2, from the torch weights, not through rljax or
    save_pretrained) loads to transformers' logits; so does the fused layout written by hand."""
    model = make_moe_checkpoint("mixtral", tmp_path / "hf")
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    hub, fused = {}, {}
    for name, w in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5 holds [E, 2F, D] in memory
            pre = name[:-len("mlp.experts.gate_up_proj")]
            f = w.shape[1] // 2
            for e in range(w.shape[0]):
                hub[f"{pre}block_sparse_moe.experts.{e}.w1.weight"] = np.ascontiguousarray(w[e, :f])
                hub[f"{pre}block_sparse_moe.experts.{e}.w3.weight"] = np.ascontiguousarray(w[e, f:])
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[:-len("mlp.experts.down_proj")]
            for e in range(w.shape[0]):
                hub[f"{pre}block_sparse_moe.experts.{e}.w2.weight"] = np.ascontiguousarray(w[e])
        else:
            hub[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = w
        if "experts" in name or ".mlp.gate." in name:
            fused[name] = w
        else:
            fused.setdefault(name, w)
    tokens, mask = left_padded(np.random.default_rng(4), 2, 9, 96)
    ref = hf_logits_and_routers(model, tokens, mask)[0]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for layout, tensors in (("hub", hub), ("fused", fused)):
        d = tmp_path / layout
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        cfg, params = M.load_hf(d)
        ours, _ = M.forward(cfg, params, jnp.asarray(tokens), attn_mask_bt=jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(ours)[mask], ref[mask], atol=TOL, rtol=0)


def test_missing_expert_is_reported(tmp_path):
    """A per-expert checkpoint that lacks one expert's tensor is refused, naming the leaf."""
    make_moe_checkpoint("qwen3_moe", tmp_path)
    from safetensors.numpy import load_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="expert_up"):
        M.load_hf(tmp_path)


# ----------------------------------------------------------------------------- grouped == dense


def _experts_case(t=24, e=6, k=2, d=16, f=12, seed=0):
    """Random tokens and experts, routed so expert 5 receives no token."""
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (t, d))
    w = ExpertWeights(*(jax.random.normal(kk, s) / np.sqrt(s[1]) for kk, s in
                        zip(keys[1:4], ((e, d, f), (e, d, f), (e, f, d)))))
    logits = jax.random.normal(keys[4], (t, e)).at[:, e - 1].set(-1e9)
    gates, ids = jax.lax.top_k(jax.nn.softmax(logits), k)
    return x, ids, gates, w


def test_grouped_equals_dense_forward_and_gradients():
    """The blocks path (CPU's grouped matmul), and the ragged_dot path GPUs take, equal the
    all-experts einsum within 1e-5 in f32, for the output and for the gradients of x, the gates
    and every expert weight, with one expert receiving no token (its gradient is exactly zero on
    both)."""
    x, ids, gates, w = _experts_case()
    assert not np.any(np.asarray(ids) == 5)

    def loss(impl, x, gates, w):
        y = experts_apply(x, ids, gates, w, impl=impl)
        return jnp.sum(y * jnp.cos(y)), y

    run = lambda impl: jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2), has_aux=True))
    (_, y_d), g_d = run("dense")(x, gates, w)
    (_, y_b), g_b = run("blocks")(x, gates, w)
    np.testing.assert_allclose(y_b, y_d, atol=1e-5, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), g_b, g_d)
    # the GPU's path (ragged_dot on the sorted rows; its Triton lowering is a GPU flag) at the same reference
    (_, y_r), g_r = run("ragged")(x, gates, w)
    np.testing.assert_allclose(y_r, y_d, atol=1e-5, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), g_r, g_d)
    assert float(jnp.abs(g_b[2].gate_edf[5]).max()) == 0.0 and float(jnp.abs(g_d[2].gate_edf[5]).max()) == 0.0
    assert float(jnp.abs(g_d[2].down_efd).max()) > 0


def test_grouped_moe_layer_gradients_equal_dense():
    """A whole MoE layer's gradients (router and shared expert included) are the same on both
    paths within 1e-5; the router's is not zero (it trains through the gates)."""
    cfg = M.preset("qwen2-test", moe=MoEConfig(num_experts=4, top_k=2, expert_size=32, norm_topk_prob=True,
                                               shared_expert_size=16))
    lp = jax.tree.map(lambda w: w[0], M.init_params(cfg, jax.random.key(1))["layers"])
    x = jax.random.normal(jax.random.key(2), (2, 9, cfg.hidden_size))

    def grads(impl):
        c = cfg.replace(moe=cfg.moe.replace(impl=impl))
        return jax.jit(jax.grad(lambda p: jnp.mean(jnp.sin(moe_mlp(x, p, c)[0]))))(lp)

    g_b, g_d = grads("grouped"), grads("dense")
    assert float(jnp.abs(g_d["router"]).max()) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), g_b, g_d)


def _flops(impl, x, ids, gates, w):
    fn = jax.jit(lambda x, g, w: experts_apply(x, ids, g, w, impl=impl))
    cost = fn.lower(x, gates, w).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("e,k", [(8, 2), (16, 2)])
def test_grouped_flops_are_about_k_over_e_of_dense(e, k):
    """The compiled grouped path does about k/E of the dense path's FLOPs (at most 1.6 k/E: the
    block padding), so it skips the experts a token is not routed to."""
    x, ids, gates, w = _experts_case(t=256, e=e, k=k, d=32, f=64)
    ratio = _flops("blocks", x, ids, gates, w) / _flops("dense", x, ids, gates, w)
    assert k / e * 0.9 <= ratio <= 1.6 * k / e, ratio


def test_inspect_shows_experts_and_active_parameters(moe_ckpt, capsys):
    """`rljax inspect` of an MoE checkpoint prints transformers' parameter count, the experts, and
    the active parameters: the total less the (E - k) experts a token does not visit per layer."""
    family, path, model, cfg, _ = moe_ckpt
    if family != "qwen2_moe":
        pytest.skip("checked on the family with a shared expert")
    from rljax.cli import main

    assert main(["inspect", str(path)]) == 0
    fields = {line[:28].strip(): line[28:].strip() for line in capsys.readouterr().out.splitlines()}
    hf_cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    idle = hf_cfg.num_hidden_layers * (hf_cfg.num_experts - hf_cfg.num_experts_per_tok) * 3 * hf_cfg.hidden_size \
        * hf_cfg.moe_intermediate_size
    assert fields["parameters"] == f"{total:,}"
    assert fields["active parameters"] == f"{total - idle:,}"
    assert fields["experts"] == "4 per layer, 2 active per token"


def test_model_section_builds_a_moe_policy(moe_ckpt):
    """`[model] num_experts = n` random-inits a Qwen3-MoE-shaped policy (experts of
    `moe_intermediate_size`, renormalised top-k, q/k norms); `moe_impl` reaches a checkpoint's
    MoE config too, and a dense section stays dense."""
    from rljax.models.setup import ModelSection, policy_config
    from rljax.tokenizers import load as load_tokenizer

    family, path, _, _, _ = moe_ckpt
    if family != "qwen3_moe":
        pytest.skip("checked once")
    tok = load_tokenizer("chars:0123456789+-= ")
    cfg = policy_config(ModelSection(tokenizer="chars:0123456789+-= ", num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=64, moe_impl="dense"), tok)
    assert (cfg.model_type, cfg.qk_norm, cfg.qkv_bias) == ("qwen3_moe", True, False)
    assert cfg.moe == MoEConfig(num_experts=8, top_k=2, expert_size=64, norm_topk_prob=True, impl="dense")
    assert policy_config(ModelSection(tokenizer="chars:0123456789+-= "), tok).moe is None
    assert policy_config(ModelSection(checkpoint=str(path), moe_impl="dense"), tok).moe.impl == "dense"
