"""PEFT parity (peft and transformers are references here, never imported by rljax/): with the same
base and adapter weights, rljax's unmerged forward and its merged HF export give `peft`'s logits
within 1e-5 in f32, and adapters cross between the two in both directions with equal logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_factory import make_checkpoint  # noqa: E402

from rljax.lora import attach, load_peft, merged_model, save_peft  # noqa: E402
from rljax.models import forward, load_hf, save_hf  # noqa: E402

# peft's notes on tied embeddings and saved embedding layers, and transformers' deprecation of a
# name peft calls: expected here, not problems.
pytestmark = pytest.mark.filterwarnings("ignore:.*(ensure_weight_tying|save_embedding_layers|is_gradient_checkpointing)")
ATOL = 1e-5
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 11))
# qwen2 (tied): every projection plus the input embedding; llama (untied): a subset plus the LM head, rsLoRA.
CASES = {
    "qwen2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj", "embed_tokens"]),
    "llama": dict(r=4, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj",
                                                                     "lm_head"]),
}


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params):
    return forward(cfg, params, jnp.asarray(TOKENS))[0]


def _torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


@functools.cache
def _peft_case(family: str, tmp: str):
    """A tiny random HF model of `family` under `peft.get_peft_model`, every A and B set to random
    values (peft's B = 0 would make any B-side error invisible), saved by peft."""
    base_dir, adapter_dir = f"{tmp}/{family}-base", f"{tmp}/{family}-peft"
    model = make_checkpoint(family, base_dir)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**CASES[family]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn_like(p))
    peft_model.eval().save_pretrained(adapter_dir)
    return base_dir, adapter_dir, _torch_logits(peft_model)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("peft"))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_unmerged_and_merged_export_equal_peft(family, tmp):
    """peft's saved adapter loaded by rljax (`load_peft`) on the same base: the unmerged forward
    (x W + s (x A) B), and the merged HF export loaded back by transformers, both give peft's
    logits within 1e-5 (f32), while the base alone is far off. Both cases together cover every
    target kind: the projections (o with two contracted head axes), the tied embedding's lookup
    and the untied LM head, alpha / r and rsLoRA's alpha / sqrt(r). Catches: a transposed or
    mis-reshaped PEFT tensor, a wrong scale, a tied head moved by the embedding's adapter, or an
    export that drops or mis-merges a target."""
    base_dir, adapter_dir, want = _peft_case(family, tmp)
    cfg, params = load_hf(base_dir)
    lora, adapters = load_peft(adapter_dir, cfg)
    assert lora.rslora == (family == "llama") and lora.rank == 4
    got = np.asarray(_logits(cfg, attach(params, adapters, lora)))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert np.abs(np.asarray(_logits(cfg, params)) - want).max() > 0.1
    cfg_m, merged = merged_model(cfg, params, adapters, lora)
    save_hf(cfg_m, merged, f"{tmp}/{family}-merged")
    exported = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/{family}-merged", attn_implementation="eager")
    np.testing.assert_allclose(_torch_logits(exported.eval()), want, atol=ATOL, rtol=0)


def test_an_rljax_adapter_loads_in_peft(tmp):
    """An adapter written by `save_peft` (adapter_config.json + adapter_model.safetensors, peft's
    tensor names) loads with `PeftModel.from_pretrained` onto the HF base and gives rljax's logits
    within 1e-5. The adapter is the peft-saved one after a round trip through rljax, scaled by 1.5
    so peft cannot pass by reading its own original. Catches: names or layouts peft does not
    load (it would warn and leave B = 0: the base's logits) or a config it reads differently."""
    base_dir, adapter_dir, _ = _peft_case("qwen2", tmp)
    cfg, params = load_hf(base_dir)
    lora, adapters = load_peft(adapter_dir, cfg)
    adapters = jax.tree.map(lambda x: 1.5 * x, adapters)
    save_peft(cfg, adapters, lora, f"{tmp}/rljax-adapter")
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager"),
        f"{tmp}/rljax-adapter").eval()
    want = np.asarray(_logits(cfg, attach(params, adapters, lora)))
    np.testing.assert_allclose(_torch_logits(model), want, atol=ATOL, rtol=0)
