"""LoRA on an MoE policy: adapters on attention and Qwen2-MoE's shared expert, routed experts
frozen (PEFT's behaviour on transformers 5, whose experts are fused parameters, not Linears),
saved in PEFT's format and loaded by PEFT onto the transformers model with rljax's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import peft
import torch
import transformers

import rljax.models as M
from rljax.lora import LoraConfig, resolve_targets
from rljax.lora.adapters import attach, init_adapters
from rljax.lora.peft_io import save_peft


def test_moe_lora_targets_and_peft_format(tmp_path):
    """Default targets on an MoE model are the attention projections (no dense MLP, experts
    frozen); PEFT's module names `gate_proj|up_proj|down_proj` pick the shared expert. Adapters
    with random A and B, saved by rljax, load in `PeftModel.from_pretrained` onto the HF base and
    give rljax's logits within 1e-4 (a name PEFT did not load would leave the base's logits)."""
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=112, moe_intermediate_size=40,
                                         shared_expert_intermediate_size=56, num_experts=4, num_experts_per_tok=2,
                                         tie_word_embeddings=False)
    base = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    base.save_pretrained(tmp_path / "base")
    cfg, params = M.load_hf(tmp_path / "base")
    assert [t.name for t in resolve_targets(LoraConfig(rank=4), cfg)] == ["q", "k", "v", "o"]
    lora = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"))
    assert [t.name for t in resolve_targets(lora, cfg)] == ["q", "v", "shared_gate", "shared_up", "shared_down"]
    adapters = init_adapters(cfg, lora, jax.random.key(0))
    leaves, tree = jax.tree.flatten(adapters)
    adapters = jax.tree.unflatten(tree, [0.1 * jax.random.normal(jax.random.key(i), x.shape) for i, x in
                                         enumerate(leaves)])
    save_peft(cfg, adapters, lora, tmp_path / "adapter")
    tokens = np.random.default_rng(0).integers(1, 96, (2, 9))
    ours, _ = M.forward(cfg, attach(params, adapters, lora), jnp.asarray(tokens))
    base_logits, _ = M.forward(cfg, params, jnp.asarray(tokens))
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                           tmp_path / "adapter").eval()
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.float().numpy()
    assert np.abs(np.asarray(ours) - np.asarray(base_logits)).max() > 1e-2
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)
