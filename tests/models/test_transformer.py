"""Model parity with Hugging Face transformers, HF I/O round trips, the KV cache and scoring."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_factory import FAMILIES, make_checkpoint

import rljax.models as M
from rljax.errors import CheckpointError, ConfigError

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(request.param, path)
    cfg, params = M.load_hf(path)
    return request.param, path, model, cfg, params


def _left_padded(rng, batch, length, vocab, pad_id=0):
    tokens = rng.integers(1, vocab, (batch, length))
    mask = np.ones((batch, length), bool)
    for i in range(batch):
        n_pad = i * 3 % length
        tokens[i, :n_pad] = pad_id
        mask[i, :n_pad] = False
    return tokens, mask


def _hf_logits(model, tokens, mask=None, positions=None):
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(mask.astype(np.int64))
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(np.asarray(positions, np.int64))
    with torch.no_grad():
        return model(torch.tensor(tokens), **kwargs).logits.float().numpy()


def test_logits_match_transformers(family_ckpt):
    """f32 logits equal transformers' on a full batch, within 1e-4 max abs."""
    _, _, model, cfg, params = family_ckpt
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 13))
    ours, _ = M.forward(cfg, params, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(model, tokens), atol=TOL, rtol=0)


def test_left_padded_batch_matches_transformers(family_ckpt):
    """With left padding and its attention mask, logits at real tokens equal transformers'."""
    _, _, model, cfg, params = family_ckpt
    tokens, mask = _left_padded(np.random.default_rng(1), 3, 12, cfg.vocab_size)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    ours, _ = M.forward(cfg, params, jnp.asarray(tokens), attn_mask_bt=jnp.asarray(mask))
    ref = _hf_logits(model, tokens, mask, positions)
    np.testing.assert_allclose(np.asarray(ours)[mask], ref[mask], atol=TOL, rtol=0)


def test_kv_cache_decoding_equals_full_forward(family_ckpt):
    """Prefill then token-by-token decoding through the cache equals one full forward."""
    _, _, _, cfg, params = family_ckpt
    tokens, mask = _left_padded(np.random.default_rng(2), 2, 12, cfg.vocab_size)
    full, _ = M.forward(cfg, params, jnp.asarray(tokens), attn_mask_bt=jnp.asarray(mask))
    prompt_len = 7
    cache = M.init_cache(cfg, batch=2, max_len=16)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    step = jax.jit(lambda p, t, pos, m, c: M.forward(cfg, p, t, pos, m, c))
    logits, cache = step(params, tokens[:, :prompt_len], positions[:, :prompt_len], mask[:, :prompt_len], cache)
    pieces = [logits]
    # The sampler's decode step gathers cos and sin from a table built once (`rope_table`).
    table_step = jax.jit(lambda p, t, pos, m, c, r: M.forward(cfg, p, t, pos, m, c, rope_cos_sin=r))
    table = M.rope_table(cfg, 16)
    for t in range(prompt_len, tokens.shape[1]):
        args = (params, tokens[:, t:t + 1], positions[:, t:t + 1], mask[:, t:t + 1], cache)
        logits, cache = step(*args)
        logits_from_table, _ = table_step(*args, table)
        # The table's values are bitwise equal (next test); fusion may round the logits 1 ulp apart.
        np.testing.assert_allclose(np.asarray(logits_from_table), np.asarray(logits), atol=1e-6, rtol=0)
        pieces.append(logits)
    incremental = np.concatenate([np.asarray(p) for p in pieces], axis=1)
    np.testing.assert_allclose(incremental[mask], np.asarray(full)[mask], atol=1e-5, rtol=0)
    assert int(cache["index"]) == tokens.shape[1]


def test_rope_table_rows_equal_computed_angles(family_ckpt):
    """`rope_table` rows are bitwise the cos and sin `rope_tables` computes (Llama 3 scaling too)."""
    from rljax.models.layers import rope_tables
    cfg = family_ckpt[3]
    positions_bt = jnp.asarray([[0, 5, 17], [3, 3, 40]], jnp.int32)
    direct = rope_tables(positions_bt, cfg)
    gathered = rope_tables(positions_bt, cfg, M.rope_table(cfg, 41))
    for a, b in zip(direct, gathered):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    too_short = rope_tables(positions_bt, cfg, M.rope_table(cfg, 40))  # position 40 is off the table
    assert np.isnan(np.asarray(too_short[0])[1, 2]).all() and not np.isnan(np.asarray(too_short[0])[0]).any()


def test_export_round_trip_loads_in_transformers(family_ckpt, tmp_path):
    """save_hf writes a directory transformers loads, with equal logits; load_hf reads it back."""
    family, _, _, cfg, params = family_ckpt
    out = M.save_hf(cfg, params, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert reloaded.config.model_type == family
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 9))
    ours, _ = M.forward(cfg, params, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(reloaded, tokens), atol=TOL, rtol=0)
    cfg2, params2 = M.load_hf(out)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_sharded_safetensors_index_loads(tmp_path):
    """A checkpoint split into several shards with an index loads to the same params."""
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(0))
    M.save_hf(cfg, params, tmp_path / "sharded", max_shard_bytes=20_000)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    _, loaded = M.load_hf(tmp_path / "sharded")
    jax.tree.map(np.testing.assert_array_equal, params, loaded)


def test_token_logprobs_match_reference_log_softmax(family_ckpt):
    """token_logprobs and entropy equal log_softmax/entropy of transformers' logits; chunking agrees."""
    _, _, model, cfg, params = family_ckpt
    tokens, mask = _left_padded(np.random.default_rng(4), 2, 10, cfg.vocab_size)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    ref_logits = torch.tensor(_hf_logits(model, tokens, mask, positions)).double()
    ref_logp = torch.log_softmax(ref_logits, -1)
    ref_tok = torch.gather(ref_logp[:, :-1], -1, torch.tensor(tokens[:, 1:, None])).squeeze(-1).numpy()
    ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)[:, :-1].numpy()
    logp, ent = M.token_logprobs(cfg, params, jnp.asarray(tokens), jnp.asarray(mask), with_entropy=True)
    valid = mask[:, :-1] & mask[:, 1:]
    np.testing.assert_allclose(np.asarray(logp)[:, 1:][valid], ref_tok[valid], atol=TOL)
    np.testing.assert_allclose(np.asarray(ent)[:, 1:][valid], ref_ent[valid], atol=TOL)
    assert np.all(np.asarray(logp)[:, 0] == 0)
    logp_c, ent_c = M.token_logprobs(cfg, params, jnp.asarray(tokens), jnp.asarray(mask), with_entropy=True,
                                     chunk_size=4)
    np.testing.assert_allclose(np.asarray(logp_c), np.asarray(logp), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent_c), np.asarray(ent), atol=1e-6)


def test_token_logprobs_gradient_matches_finite_differences():
    """The scoring function is differentiable: grad wrt the final norm matches central differences."""
    cfg = M.preset("qwen2-test", num_layers=1)
    params = M.init_params(cfg, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, cfg.vocab_size)

    def loss(final_norm):
        return jnp.sum(M.token_logprobs(cfg, {**params, "final_norm": final_norm}, tokens)[0])

    with jax.default_matmul_precision("highest"):
        x = params["final_norm"].astype(jnp.float64) if jax.config.jax_enable_x64 else params["final_norm"]
        g = jax.grad(loss)(x)
        eps = 1e-2
        for i in (0, 7, 31):
            e = jnp.zeros_like(x).at[i].set(eps)
            fd = (loss(x + e) - loss(x - e)) / (2 * eps)
            np.testing.assert_allclose(float(g[i]), float(fd), rtol=2e-2, atol=2e-3)


def test_weight_gradients_match_finite_differences_and_layer_loop_forms():
    """Gradients through the projections' custom VJP: entries of q, o, gate, down and the embedding
    match central differences; the unrolled and rematerialised layer loops give the same gradients
    as the scan; bf16 compute gives gradients close to f32 (cotangents kept in bf16). Each form is
    one compiled program (the ten central differences share one) rather than run op by op.
    Catches: a wrong custom VJP of a projection, a layer-loop form whose gradient differs from the
    scan's, and bf16 cotangents that overflow or drift beyond 10% of the f32 gradient."""
    cfg = M.preset("qwen2-test", num_layers=2)
    params = M.init_params(cfg, jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (2, 7), 0, cfg.vocab_size)

    def loss(p, c=cfg, **kw):
        return jnp.sum(M.token_logprobs(c, p, tokens, **kw)[0])

    with jax.default_matmul_precision("highest"):
        g = jax.jit(jax.grad(loss))(params)
        compiled_loss = jax.jit(loss)
        for path in (("layers", "q"), ("layers", "o"), ("layers", "gate"), ("layers", "down"), ("embed",)):
            w = params
            for k in path:
                w = w[k]
            flat_index = (1 * w.size) // 3
            idx = np.unravel_index(flat_index, w.shape)

            def moved(delta, path=path, idx=idx):
                leaf = params
                for k in path:
                    leaf = leaf[k]
                leaf = leaf.at[idx].add(delta)
                if len(path) == 1:
                    return {**params, path[0]: leaf}
                return {**params, "layers": {**params["layers"], path[1]: leaf}}

            eps = 1e-2
            fd = (compiled_loss(moved(eps)) - compiled_loss(moved(-eps))) / (2 * eps)
            got = g
            for k in path:
                got = got[k]
            np.testing.assert_allclose(float(got[idx]), float(fd), rtol=3e-2, atol=3e-3, err_msg=str(path))
        for kw in ({"unroll": True}, {"remat": True}, {"remat": True, "unroll": True}):
            other = jax.jit(jax.grad(lambda p, kw=kw: loss(p, **kw)))(params)
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(other)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5, err_msg=str(kw))
    bf16 = M.preset("qwen2-test", num_layers=2, compute_dtype="bfloat16")
    g16 = jax.jit(jax.grad(lambda p: loss(p, c=bf16)))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g16)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert b.dtype == np.float32 and np.all(np.isfinite(b))
        assert np.linalg.norm(a - b) <= 0.1 * np.linalg.norm(a) + 1e-6


def test_value_model_shares_backbone_and_starts_at_zero():
    """The critic reuses the backbone, has a scalar head, outputs [B, T] zeros at init and is trainable."""
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(0))
    vparams = M.init_value_params(cfg, params, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (3, 5), 0, cfg.vocab_size)
    v = M.values(cfg, vparams, tokens)
    assert v.shape == (3, 5) and float(jnp.abs(v).max()) == 0.0
    g = jax.grad(lambda vp: jnp.sum(M.values(cfg, vp, tokens) ** 2 + M.values(cfg, vp, tokens)))(vparams)
    assert float(jnp.abs(g["value_head"]).max()) > 0
    h, _ = M.hidden_states(cfg, params, tokens)
    head = jax.random.normal(jax.random.key(3), (cfg.hidden_size,))
    v2 = M.values(cfg, {**vparams, "value_head": head}, tokens)
    np.testing.assert_allclose(np.asarray(v2), np.asarray(h @ head), atol=1e-5)


def _dot_operand_dtypes(fn, *args) -> set[tuple[str, ...]]:
    """The operand dtypes of every matmul (dot_general) in `fn`'s jaxpr, nested jaxprs included."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.add(tuple(str(v.aval.dtype) for v in eqn.invars))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                        walk(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_param_and_compute_dtypes_are_separate():
    """The param dtype is storage only; every matmul runs in the compute dtype.

    bf16 params with f32 compute equal an f32 forward on the bf16-rounded params to 1e-5 (they
    differ by about 1e-7, while computing in bf16 moves the logits by about 2e-3); f32 params
    with bf16 compute run every matmul on bf16 operands and land within bf16 error of f32.

    Catches: computing in the param dtype (bf16 activations: off by ~2e-3 from the rounded
    reference, and bf16 matmuls under f32 compute), ignoring `compute_dtype` (f32 matmuls and
    logits equal to the f32 ones), and returning logits in the compute dtype."""
    cfg = M.preset("qwen2-test")
    params = M.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    ref, _ = M.forward(cfg, params, tokens)
    bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    rounded_ref, _ = M.forward(cfg, jax.tree.map(lambda x: x.astype(jnp.float32), bf16_params), tokens)

    cfg1 = cfg.replace(param_dtype="bfloat16")
    out1, _ = M.forward(cfg1, bf16_params, tokens)
    assert out1.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out1), np.asarray(rounded_ref), atol=1e-5, rtol=0)
    assert _dot_operand_dtypes(lambda p: M.forward(cfg1, p, tokens)[0], bf16_params) == {("float32", "float32")}

    cfg2 = cfg.replace(compute_dtype="bfloat16")
    out2, _ = M.forward(cfg2, params, tokens)
    assert out2.dtype == jnp.float32
    assert _dot_operand_dtypes(lambda p: M.forward(cfg2, p, tokens)[0], params) == {("bfloat16", "bfloat16")}
    err = float(jnp.abs(out2 - ref).max())
    bf16_eps = 2.0**-8
    assert 0 < err < 4 * bf16_eps * float(jnp.abs(ref).max())  # changed, by bf16-sized amounts only
    assert M.init_params(cfg1, jax.random.key(0))["embed"].dtype == jnp.bfloat16


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    """An unsupported model_type or feature names the problem in one line."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(CheckpointError, match="model_type 'deepseek_v3' is not supported"):
        M.load_hf(tmp_path)
    with pytest.raises(ConfigError, match="num_heads=3 must be a multiple"):
        M.preset("qwen2-test", num_heads=3)


def test_mismatched_shape_names_the_key(tmp_path):
    """A tensor whose shape disagrees with config.json is reported by its HF key."""
    make_checkpoint("qwen2", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight"):
        M.load_hf(tmp_path)


def test_missing_tensor_is_reported(tmp_path):
    """A checkpoint that lacks a tensor names what is missing."""
    cfg = M.preset("qwen2-test", tie_embeddings=False)
    M.save_hf(cfg, M.init_params(cfg, jax.random.key(0)), tmp_path / "ck")
    hf = json.loads((tmp_path / "ck" / "config.json").read_text())
    hf["num_hidden_layers"] = 3
    (tmp_path / "ck" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="lacks layer 2"):
        M.load_hf(tmp_path / "ck")


@pytest.mark.parametrize("name", ["silu", "gelu_tanh"])
def test_gated_activation_gradients_are_autodiffs(name):
    """`gated_activation`'s backward (recomputed from the saved gate and up) equals autodiff of
    act(gate) * up: in f32 to 1e-6; with bf16 saving, autodiff's at the bf16-rounded gate and up.
    Catches a wrong activation derivative (e.g. silu' = sigmoid), swapped gate and up
    cotangents, and saved values not rounded as stated."""
    from rljax.models.layers import _activation, gated_activation

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    gate, up, g = (3 * jax.random.normal(k, (4, 8, 32)) for k in (k1, k2, k3))
    plain = lambda a, b: _activation(name, a) * b
    for saved in (jnp.float32, jnp.bfloat16):
        out, vjp = jax.vjp(lambda a, b: gated_activation(a, b, name, saved), gate, up)
        rounded = [x.astype(saved).astype(jnp.float32) for x in (gate, up)]
        ref_out, ref_vjp = jax.vjp(plain, *rounded)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(plain(gate, up)))  # the forward is exact
        for a, b in zip(vjp(g), ref_vjp(g)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)


def test_scanned_layers_save_no_f32_mlp_stack_in_bf16():
    """The gradient of a bf16-compute model's scanned layers, as lowered (the program JAX hands
    XLA), saves its MLP activations as bf16 [L, B, T, F] stacks and no f32 one: autodiff of
    act(gate) * up lowers with 47 f32 [L, B, T, F] values (the five f32 residual stacks the H200
    trace found, and their uses), `gated_activation` with none. (XLA:CPU may still widen a saved
    stack to f32 before its backward loop: a CPU compiler choice; BENCHMARKS.md.)"""
    import re

    cfg = M.preset("qwen2-test", num_layers=3, compute_dtype="bfloat16", param_dtype="bfloat16",
                   intermediate_size=144)
    params = M.init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((2, 16), jnp.int32)
    text = jax.jit(jax.grad(lambda p: M.token_logprobs(cfg, p, tokens)[0].sum())).lower(params).as_text()
    assert not re.findall(r"tensor<3x2x16x144xf32>", text)
    assert re.findall(r"tensor<3x2x16x144xbf16>", text)  # the bf16 stacks it saves instead


def test_unrolled_layers_keep_no_stacked_residuals():
    """The trained forward unrolls its layers by default on GPU and TPU (`UpdateConfig.unroll_layers`
    unset) and scans them on a CPU; an explicit setting wins. Compiled, the scanned gradient
    allocates its saved MLP inputs as [L, B, T, F] stacks (zero-filled, then written layer by
    layer: what the H200 trace found copied whole per micro-batch); the unrolled one has no such
    stack. Catches an "auto" that never unrolls on an accelerator."""
    import re

    from rljax.update import UpdateConfig

    assert UpdateConfig().layers_unrolled("gpu") and UpdateConfig().layers_unrolled("tpu")
    assert not UpdateConfig().layers_unrolled("cpu")
    assert not UpdateConfig(unroll_layers=False).layers_unrolled("gpu")
    assert UpdateConfig(unroll_layers=True).layers_unrolled("cpu")
    cfg = M.preset("qwen2-test", num_layers=3, compute_dtype="bfloat16", param_dtype="bfloat16",
                   intermediate_size=144)
    params = M.init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((2, 16), jnp.int32)
    stacks = {}
    for unroll in (False, True):
        loss = lambda p, unroll=unroll: M.token_logprobs(cfg, p, tokens, unroll=unroll)[0].sum()
        text = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
        stacks[unroll] = len(re.findall(r"= (?:bf16|f32)\[3,2,16,144\]\{[0-9,]+\} broadcast\(", text))
    assert stacks[False] >= 1 and stacks[True] == 0, stacks
