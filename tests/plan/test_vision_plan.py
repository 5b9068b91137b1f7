"""`rljax plan` on a vision-language recipe (`rljax.plan.vision`): the tower's parameters and the
image tokens, against a hand count."""

from __future__ import annotations

import jax

from rljax.models.setup import build_tokenizer, policy_config
from rljax.models.vl_setup import scratch_vl_config
from rljax.models.vlm import init_vl_params
from rljax.plan.vision import vision_plan
from rljax.train.config import load_config


def test_plan_counts_the_tower_and_the_image_tokens():
    """vl_default: tower = patch embedding 1176 x 64 + 2 blocks (2 RMSNorms, qkv, proj, SwiGLU
    with biases) + the merger (RMSNorm 64, 256 x 256 + 256, 256 x 128 + 128), written out here;
    and the allocated tower's leaves sum to it. An 84 px picture is 6 x 6 patches = 9 image
    tokens. Rollout encodes prompts x 36 patches, the update rows x 36. Catches a count that
    leaves out the merger or biases, or image tokens counted in patches."""
    cfg = load_config("vl_default", [])
    text = policy_config(cfg.model, build_tokenizer(cfg.model))
    plan = vision_plan(cfg, text)
    d, f, depth = 64, 128, 2
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * (d * f + f) + (f * d + d)
    merger = d + (4 * d) ** 2 + 4 * d + 4 * d * 128 + 128  # ln_q [D], fc1 [4D, 4D] + bias, fc2 [4D, 128] + bias
    hand = 1176 * d + depth * block + merger
    vl = scratch_vl_config(cfg.model.vision, text)
    allocated = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: init_vl_params(vl, jax.random.key(0)))["visual"]))
    assert plan.tower_params == allocated == hand
    assert plan.image_tokens == 9 and plan.patches == 36
    assert plan.decoder_params == vl.text.num_params()
    assert "rollout 1152 patches" in plan.lines()[2] and "update 9216 patches" in plan.lines()[2]


def test_text_recipe_has_no_vision_plan():
    cfg = load_config("default", [])
    assert vision_plan(cfg, policy_config(cfg.model, build_tokenizer(cfg.model))) is None
