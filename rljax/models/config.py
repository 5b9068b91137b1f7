"""The decoder-only transformer config shared by the Llama, Qwen2/3 and Gemma 1/2 families.

One frozen dataclass holds every architectural switch. `from_hf_dict` reads a Hugging Face
`config.json` and `to_hf_dict` writes one back, so a checkpoint round-trips through transformers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from rljax.errors import CheckpointError, ConfigError
from rljax.models.moe_config import MOE_MODEL_TYPES, MoEConfig, moe_from_hf, moe_to_hf

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma", "gemma2") + MOE_MODEL_TYPES
_ACTIVATIONS = ("silu", "gelu_tanh")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")
DECODE_ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder-only transformer.

    Family switches: `qkv_bias` (Qwen2), `qk_norm` (Qwen3), `norm_plus_one` and
    `scale_embeddings` (Gemma's RMSNorm (1 + w) and sqrt(d) embedding scale), `sandwich_norm`,
    soft-caps and `sliding_window_pattern` (Gemma 2), `rope_type='llama3'` (Llama 3.1+),
    `rope_type='yarn'` (Qwen2.5's long-context configs: `rope_factor`, `rope_original_max_positions`,
    the `rope_beta_*` ramp and `rope_attention_factor`; see `rope_inv_freq`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "qwen2"
    activation: str = "silu"
    rms_norm_eps: float = 1e-6
    norm_plus_one: bool = False
    scale_embeddings: bool = False
    sandwich_norm: bool = False
    tie_embeddings: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    rope_beta_fast: float = 32.0  # YaRN: rotations above which a dimension is not interpolated
    rope_beta_slow: float = 1.0  # YaRN: rotations below which a dimension is fully interpolated
    rope_attention_factor: float | None = None  # YaRN: cos/sin scale; None: 0.1 ln(factor) + 1
    rope_truncate: bool = True  # YaRN: round the ramp's ends to whole dimensions (HF's default)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    sliding_window_pattern: int = 0  # every k-th layer is global; 0: no sliding layers
    max_positions: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    # How attention runs (not part of the architecture, never written to config.json): see
    # `rljax.models.attention.resolve_attention`.
    attention: str = "auto"
    # How a decode step attends over the KV cache: `rljax.models.attention.resolve_decode_attention`.
    decode_attention: str = "auto"
    # Mixture-of-experts MLPs in every layer (Qwen3-MoE, Qwen2-MoE, Mixtral): `rljax.models.moe`.
    moe: MoEConfig | None = None

    def __post_init__(self):
        def need(ok: bool, msg: str):
            if not ok:
                raise ConfigError(msg)

        need(self.activation in _ACTIVATIONS, f"activation={self.activation!r}; choose one of {_ACTIVATIONS}")
        need(self.rope_type in _ROPE_TYPES, f"rope_type={self.rope_type!r} is unsupported; choose one of {_ROPE_TYPES}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE")
        for name in ("param_dtype", "compute_dtype"):
            need(getattr(self, name) in _DTYPES, f"{name}={getattr(self, name)!r}; choose one of {tuple(_DTYPES)}")
        need(self.attention in ATTENTION_IMPLEMENTATIONS,
             f"attention={self.attention!r}; choose one of {ATTENTION_IMPLEMENTATIONS}")
        need(self.decode_attention in DECODE_ATTENTION_IMPLEMENTATIONS,
             f"decode_attention={self.decode_attention!r}; choose one of {DECODE_ATTENTION_IMPLEMENTATIONS}")
        need(self.sliding_window_pattern == 0 or self.sliding_window,
             "sliding_window_pattern > 0 needs sliding_window set")
        if self.moe is not None and self.moe.dense_layers:
            need(self.moe.dense_layers[-1] < self.num_layers and len(self.moe.dense_layers) < self.num_layers,
                 f"moe dense_layers={self.moe.dense_layers} must name some but not all of {self.num_layers} layers")

    @property
    def params_jnp_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def compute_jnp_dtype(self):
        return _DTYPES[self.compute_dtype]

    @property
    def query_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def layer_windows(self) -> tuple[int, ...]:
        """Per-layer attention window (0 means global), Gemma 2 style: layer i is local unless
        (i + 1) % pattern == 0."""
        if not self.sliding_window_pattern:
            return (0,) * self.num_layers
        return tuple(
            0 if (i + 1) % self.sliding_window_pattern == 0 else int(self.sliding_window)
            for i in range(self.num_layers)
        )

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embeddings: bool = True) -> int:
        d, n, k, h, f = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        n_dense = len(self.moe.dense_layers) if self.moe else self.num_layers  # the rest are MoE layers
        mlp = (self.num_layers - n_dense) * self.moe.params_per_layer(d)[0] if self.moe else 0
        per_layer = d * n * h * 2 + d * k * h * 2 + 2 * d
        total = self.num_layers * per_layer + mlp + n_dense * 3 * d * f + d
        if include_embeddings:
            total += self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return total

    def num_active_params(self, include_embeddings: bool = True) -> int:
        """Parameters one token uses: `num_params` less the experts it is not routed to."""
        if not self.moe:
            return self.num_params(include_embeddings)
        total, active = self.moe.params_per_layer(self.hidden_size)
        sparse = self.num_layers - len(self.moe.dense_layers)
        return self.num_params(include_embeddings) - sparse * (total - active)


# ----------------------------------------------------------------------------- HF config.json


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Reads RoPE settings from either the transformers v5 `rope_parameters` or v4 fields."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    src = params if "factor" in params else legacy
    if rope_type not in _ROPE_TYPES:
        raise CheckpointError(
            f"rope_type {rope_type!r} is not supported; supported: {_ROPE_TYPES}")
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3", "yarn"):
        out["rope_factor"] = float(src["factor"])
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(src.get("low_freq_factor", 1.0))
        out["rope_high_freq_factor"] = float(src.get("high_freq_factor", 4.0))
        out["rope_original_max_positions"] = int(src["original_max_position_embeddings"])
    if rope_type == "yarn":
        out.update(_yarn_from_hf(hf, src, out["rope_factor"]))
    return out


def _yarn_from_hf(hf: dict[str, Any], src: dict[str, Any], factor: float) -> dict[str, Any]:
    """YaRN's fields as transformers reads them: the pretrained window is
    `original_max_position_embeddings` (default: `max_position_embeddings`); the cos/sin scale is
    `attention_factor`, else DeepSeek's mscale ratio, else 0.1 ln(factor) + 1 (left None)."""
    out: dict[str, Any] = {
        "rope_original_max_positions": int(src.get("original_max_position_embeddings")
                                           or hf.get("max_position_embeddings", 4096)),
        "rope_beta_fast": float(src.get("beta_fast") or 32.0),
        "rope_beta_slow": float(src.get("beta_slow") or 1.0),
        "rope_truncate": bool(src.get("truncate", True)),
    }
    if src.get("attention_factor") is not None:
        out["rope_attention_factor"] = float(src["attention_factor"])
    elif src.get("mscale") and src.get("mscale_all_dim"):
        out["rope_attention_factor"] = _yarn_mscale(factor, src["mscale"]) / _yarn_mscale(factor, src["mscale_all_dim"])
    return out


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def from_hf_dict(hf: dict[str, Any], **overrides) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face `config.json` dict."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("mlp_bias"):
        raise CheckpointError("mlp_bias=True is not supported (no supported family uses it)")
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise CheckpointError(f"{model_type} with use_sliding_window=True is not supported; set it to false")
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}.get(act)
    if act is None:
        raise CheckpointError(f"hidden_act {hf.get('hidden_act')!r} is not supported; supported: silu, gelu_pytorch_tanh")
    gemma = model_type in ("gemma", "gemma2")
    fields: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        activation=act,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_plus_one=gemma,
        scale_embeddings=gemma,
        tie_embeddings=hf.get("tie_word_embeddings", gemma or model_type == "qwen2"),
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
        or bool(hf.get("attention_bias", False)),
        o_bias=model_type not in ("qwen2", "qwen2_moe") and bool(hf.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_positions=hf.get("max_position_embeddings", 4096),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(hf["eos_token_id"]) if isinstance(hf.get("eos_token_id"), list) else hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        **_rope_from_hf(hf),
    )
    if model_type == "gemma2":
        fields.update(
            sandwich_norm=True,
            attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            attn_logit_softcap=hf.get("attn_logit_softcapping"),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            sliding_window=hf.get("sliding_window"),
            sliding_window_pattern=2 if hf.get("sliding_window") else 0,
        )
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            cfg_windows = tuple(0 if t == "full_attention" else 1 for t in layer_types)
            want = tuple(0 if (i + 1) % 2 == 0 else 1 for i in range(len(layer_types)))
            if cfg_windows != want:
                raise CheckpointError("gemma2 layer_types other than alternating sliding/full are not supported")
    if model_type in MOE_MODEL_TYPES:
        fields["moe"] = moe_from_hf(hf)
    fields.update(overrides)
    return ModelConfig(**fields)


def _int_if_integral(x: float):
    return int(round(x)) if abs(x - round(x)) < 1e-6 else x


def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """Writes a Hugging Face `config.json` dict that transformers loads into the same model."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[cfg.model_type]
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type in ("linear", "llama3", "yarn"):
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "yarn":
        rope.update(original_max_position_embeddings=cfg.rope_original_max_positions, beta_fast=cfg.rope_beta_fast,
                    beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
        if cfg.rope_attention_factor is not None:
            rope["attention_factor"] = cfg.rope_attention_factor
    if cfg.rope_type == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_positions)
    hf: dict[str, Any] = dict(
        architectures=[arch],
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=max(cfg.max_positions, cfg.rope_original_max_positions + 1)
        if cfg.rope_type == "llama3" else cfg.max_positions,
        rope_parameters=rope,
        rope_theta=cfg.rope_theta,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        torch_dtype=cfg.param_dtype,
    )
    if cfg.model_type in ("gemma", "gemma2"):
        hf["hidden_activation"] = "gelu_pytorch_tanh"
        hf["hidden_act"] = "gelu_pytorch_tanh"
    else:
        hf["hidden_act"] = "silu"
        hf["attention_bias"] = cfg.o_bias if cfg.model_type != "qwen2" else False
        if cfg.model_type == "qwen2" and not cfg.qkv_bias:
            raise CheckpointError("qwen2 export needs qkv_bias=True (transformers' Qwen2 always has it)")
    if cfg.model_type == "gemma2":
        hf.update(
            query_pre_attn_scalar=_int_if_integral(cfg.query_scale**-2),
            attn_logit_softcapping=cfg.attn_logit_softcap,
            final_logit_softcapping=cfg.final_logit_softcap,
            sliding_window=cfg.sliding_window,
            layer_types=["full_attention" if w == 0 else "sliding_attention" for w in cfg.layer_windows()],
        )
    if cfg.model_type == "qwen2_moe":
        hf.update(attention_bias=False, qkv_bias=cfg.qkv_bias)
    if cfg.moe is not None:
        hf.update(moe_to_hf(cfg.model_type, cfg.moe))
    elif cfg.model_type in MOE_MODEL_TYPES:
        raise CheckpointError(f"{cfg.model_type} export needs a model with moe set")
    return hf


def preset(name: str, **overrides) -> ModelConfig:
    """Named tiny configs used by tests, benchmarks and the default job."""
    presets = {
        # ~0.2M params: the test model.
        "qwen2-test": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True),
        # The benchmark configs named in the sampler and update-step issues.
        "qwen2-tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=4,
                           num_heads=4, num_kv_heads=2, head_dim=64, qkv_bias=True),
        "qwen2-small": dict(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_layers=8,
                            num_heads=8, num_kv_heads=4, head_dim=64, qkv_bias=True,
                            tie_embeddings=False),
    }
    if name not in presets:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(presets)}")
    return ModelConfig(model_type="qwen2", **{**presets[name], **overrides})


def rope_attention_scale(cfg: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (so every attention logit by its square):
    `rope_attention_factor`, or 0.1 ln(s) + 1 for scale s (YaRN, Peng et al., 2023, eq. 22's
    sqrt(1/t)); 1.0 for every other RoPE type."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return float(cfg.rope_attention_factor)
    return _yarn_mscale(cfg.rope_factor)


def _yarn_inv_freq(cfg: ModelConfig, inv):
    """YaRN's "NTK-by-parts" frequencies (Peng et al., 2023): dimension i rotates r_i = L / lambda_i
    times over the pretrained window L. Dimensions with r_i > beta_fast keep their frequency
    (extrapolate), those with r_i < beta_slow are divided by the scale s (interpolate, as linear
    scaling), and between them a linear ramp over the dimension index blends the two. The ramp's
    ends are the dimensions where r equals each beta, d(r) = D ln(L / (2 pi r)) / (2 ln theta),
    rounded outward when `rope_truncate` (as transformers does)."""
    import numpy as np

    dim, length = cfg.head_dim, cfg.rope_original_max_positions
    corr = lambda rotations: dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
    low, high = corr(cfg.rope_beta_fast), corr(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp: avoid dividing by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (high-frequency dims), 0: interpolate
    return inv / cfg.rope_factor * (1.0 - keep) + inv * keep


def rope_inv_freq(cfg: ModelConfig):
    """Inverse RoPE frequencies, with linear, Llama 3 (Llama 3 report, 2024) or YaRN (Peng et al.,
    2023) scaling."""
    import numpy as np

    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    if cfg.rope_type == "yarn":
        inv = _yarn_inv_freq(cfg, inv)
    elif cfg.rope_type == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        lo_wl = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
        hi_wl = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > lo_wl, inv / cfg.rope_factor, inv)
        smooth = (cfg.rope_original_max_positions / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= hi_wl) & (wavelen <= lo_wl)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)
