"""Sampling from image prompts (`rljax.sampling.vision`) against the trainer's scoring and the
reference greedy loop, on a tiny random-init Qwen2.5-VL-shaped model (no torch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.errors import DataError
from rljax.models import preset
from rljax.models.vision import VisionConfig
from rljax.models.vlm import VLConfig, greedy_generate, init_vl_params, prepare_inputs, vl_token_logprobs
from rljax.sampling import SampleControls
from rljax.sampling import decode as D
from rljax.sampling.vision import generate_vl, patch_bucket, sample_static_vl
from vl_prompts import END, GRIDS, IMAGE, START, placeholder_batch, sampler_inputs, tower_rows



@pytest.fixture(scope="module")
def model():
    text = preset("qwen2-test", vocab_size=128, tie_embeddings=False)
    vision = VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                          window_size=56, fullatt_block_indexes=(1,))
    cfg = VLConfig(text=text, vision=vision, image_token_id=IMAGE, vision_start_token_id=START,
                   vision_end_token_id=END, video_token_id=121, mrope_section=(2, 3, 3))
    params = init_vl_params(cfg, jax.random.key(0), std=0.2)
    return cfg, params


def _batch():
    return placeholder_batch()


def test_sampler_logprobs_equal_trainer(model):
    """Each sampled token's log-prob equals the trainer's (`vl_token_logprobs` over prompt +
    completion, the images re-encoded per row) within 1e-5 in f32: the decode continues the
    M-RoPE positions by delta, and the prefill splices the same embeddings."""
    cfg, params = model
    tokens, mask, pixels = _batch()
    n = 2
    res = jax.device_get(generate_vl(cfg, params, tokens, mask, pixels, GRIDS, key=jax.random.key(1),
                                     controls=SampleControls(max_new_tokens=8, num_samples=n, temperature=1.0)))
    full = np.concatenate([np.repeat(tokens, n, axis=0), res.tokens], axis=1)
    full_mask = np.concatenate([np.repeat(mask, n, axis=0), res.mask], axis=1)
    grids = np.repeat(GRIDS, n, axis=0)  # prompt-major rows: each prompt's image once per sample
    split = np.cumsum(GRIDS.prod(axis=1))[:-1]
    pix = np.concatenate([np.concatenate([p] * n) for p in np.split(pixels, split)])
    image_bt = np.zeros(full.shape, bool)
    image_bt[:, :tokens.shape[1]] = np.repeat(tokens == IMAGE, n, axis=0)  # the prompts' images only
    inputs = prepare_inputs(cfg, full, full_mask, pix, grids, num_positions=full.shape[1], image_bt=image_bt)
    score = jax.jit(lambda p, t, m, i, im: vl_token_logprobs(cfg, p, t, m, i, image_bt=im)[0])
    logp = score(params, jnp.asarray(full, jnp.int32), jnp.asarray(full_mask), inputs, jnp.asarray(image_bt))
    trainer = np.asarray(logp)[:, tokens.shape[1]:]
    assert res.mask.all()  # no EOS in this vocabulary: every token is compared
    np.testing.assert_allclose(res.logprobs, trainer, atol=1e-5, rtol=0)


def test_greedy_sampler_matches_reference_loop(model):
    """At temperature 0 the sampler's tokens are the reference greedy loop's (`greedy_generate`)."""
    cfg, params = model
    tokens, mask, pixels = _batch()
    res = generate_vl(cfg, params, tokens, mask, pixels, GRIDS, key=jax.random.key(0),
                      controls=SampleControls(max_new_tokens=6, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(res.tokens), greedy_generate(cfg, params, tokens, mask, pixels, GRIDS, 6))


def test_tower_runs_once_per_prompt(model):
    """The compiled rollout embeds each prompt's patches once, however many samples it draws: the
    patch-embedding matmul has the prompts' patch count as rows at n = 1 and at n = 4 (a rollout
    that repeated the pixels per sample would have 4x the rows)."""
    cfg, params = model
    tokens, mask, inputs = sampler_inputs(cfg)
    num_patches = patch_bucket(int(GRIDS.prod(axis=1).sum()))  # the prompts' patches, bucketed
    for n in (1, 4):
        controls = SampleControls(max_new_tokens=4, num_samples=n)
        jaxpr = jax.make_jaxpr(lambda p, i: sample_static_vl(
            cfg, p, tokens, mask, i, jax.random.key(0), np.int32(4), controls.scalars(), np.int32(2 * n),
            spec=controls.static(), num_samples=n, new_bucket=D.bucket_length(4)))(params, inputs)
        assert tower_rows(jaxpr.jaxpr, cfg.vision.patch_dim) == [num_patches]


def test_frozen_tower_gets_no_gradient(model):
    """`train_vision=False` stops the gradient at the merged embeddings: the tower's gradient is 0
    and the language model's is the trained-tower one; with it True the tower's is not 0."""
    cfg, params = model
    tokens, mask, pixels = _batch()
    inputs = prepare_inputs(cfg, tokens, mask, pixels, GRIDS, num_positions=tokens.shape[1])

    def grads(train_vision):
        loss = lambda p: vl_token_logprobs(cfg, p, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), inputs,
                                           train_vision=train_vision)[0].sum()
        return jax.jit(jax.grad(loss))(params)

    frozen, trained = grads(False), grads(True)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(frozen["visual"]))
    assert float(jnp.abs(trained["visual"]["patch_embed"]).max()) > 0
    # the same math in two compiled programs: equal up to fusion rounding
    np.testing.assert_allclose(frozen["layers"]["q"], trained["layers"]["q"], rtol=0, atol=2e-5)


def test_text_model_given_images_is_one_line(model):
    """A model without a vision tower given images is refused in one line naming the fix."""
    cfg, params = model
    tokens, mask, pixels = _batch()
    with pytest.raises(DataError, match="has no vision tower") as err:
        generate_vl(cfg.text, params, tokens, mask, pixels, GRIDS, key=jax.random.key(0),
                    controls=SampleControls(max_new_tokens=2))
    assert "\n" not in str(err.value)


def _word_tokenizer(path):
    import json

    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 128)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}w5 {{ m['content'] }} w6 {% endfor %}w7"}))


def test_cli_sample_with_an_image(model, tmp_path, capsys):
    """`rljax sample --image` puts the image's placeholder inside the chat turn and prints the
    greedy completion of `greedy_generate` on those ids; a text-only checkpoint given an image is
    a one-line error."""
    from PIL import Image

    from rljax.cli import main
    from rljax.data.images import preprocess
    from rljax.models import init_params, save_hf
    from rljax.models.vl_io import save_vl

    cfg, params = model
    save_vl(cfg, params, tmp_path / "vl")
    _word_tokenizer(tmp_path / "vl")
    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(image)
    pixels, grids = preprocess([image])
    n = int(np.prod(grids[0])) // 4
    ids = [5, START] + [IMAGE] * n + [END, 10, 11, 6, 7]
    want = greedy_generate(cfg, params, np.asarray([ids]), np.ones((1, len(ids)), bool), pixels, grids, 5)[0].tolist()
    want = want[:want.index(1)] if 1 in want else want  # stops at <eos>
    assert main(["sample", "--checkpoint", str(tmp_path / "vl"), "--prompt", "w10 w11", "--chat", "--greedy",
                 "--image", str(image), "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.split() == [f"w{t}" for t in want if t > 1]

    save_hf(cfg.text, init_params(cfg.text, jax.random.key(0)), tmp_path / "text")
    _word_tokenizer(tmp_path / "text")
    assert main(["sample", "--checkpoint", str(tmp_path / "text"), "--prompt", "w10", "--image", str(image)]) == 2
    err = capsys.readouterr().err
    assert "no vision tower" in err and len(err.strip().splitlines()) == 1
