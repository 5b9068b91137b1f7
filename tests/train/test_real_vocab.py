"""A real vocabulary end to end: the packaged GSM8K recipe (`configs/gsm8k_qwen.toml`) on a model
with Qwen's 151,936-id embedding and a tiny body, the real Qwen tokenizer and chat template, bf16
compute and the math verifier, on 8 simulated devices with FSDP, run as `rljax train` in its own
process so its peak RSS is the run's alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import torch
import transformers

from rljax.checkpoint import Checkpointer
from rljax.tokenizers import load as load_tokenizer

VOCAB = 151_936  # Qwen2.5's embedding rows (the tokenizer's 151,669 ids, padded)
HIDDEN, LAYERS = 128, 2  # 19.74M params, 19.45M of them the embedding
SEVEN = 22  # the Qwen id of "7"
PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 8, 2, 96, 16

# The run's peak RSS (VmHWM), measured on this 2-core EPYC: 1,753 and 1,757 MiB (1,766 and 1,794
# before the state was born sharded). About 850 MiB before the iteration compiles (Python, jax,
# the Qwen tokenizer, the eval programs), +550 MiB compiling the fused 8-device iteration, +360 MiB
# its temporaries (45 MiB a device, `memory_analysis`) next to the 226 MiB train state. What the
# bound must catch, at these shapes:
#   - the [B, T, V] logits in f32, 16 rows x 112 steps x 151,936 ids x 4 B: 1,039 MiB (the same
#     run with update.logprob_chunk=112 update.logprob_vocab_chunk=151936 peaked at 6,661 MiB);
#   - a device-0 copy of the train state (f32 params + Adam's two moments, 19.74M x 12 B): 226 MiB
#     (the same run holding `jax.device_put(state, jax.devices()[0])` peaked at 2,033 MiB);
#     replicated on all 8 devices instead of FSDP-sharded it would be +1,582 MiB.
# 1,950 MiB sits ~190 MiB above the measurements and 83 MiB below the state-copy run.
RSS_BOUND_MIB = 1950


def _write_checkpoint(path) -> int:
    """A random-init Qwen2 checkpoint with the real vocabulary and a tiny body, as safetensors;
    returns its parameter count."""
    tok = load_tokenizer("qwen")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.pad_id, eos_token_id=tok.eos_ids[0], pad_token_id=tok.pad_id)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        # Residual dimension 0 carries a constant that dominates the final RMS norm, so the tied
        # head scores token v by its dimension-0 entry: '7' and <|im_end|> get p ~ 0.47 at every
        # step, so about a fifth of the completions are exactly "7" (the right answer) and most
        # groups of two disagree: the update has advantages and a gradient to work with.
        embed = model.model.embed_tokens.weight
        embed[:, 0] = 4.0
        embed[[SEVEN, tok.eos_ids[0]], 0] += 1.3
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


_NAMES = ("Ali", "Bea", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies")


def _gsm8k_rows(n: int, offset: int) -> list[dict]:
    """GSM8K-shaped rows, a worded question and a worked answer ending in '#### 7': every answer
    is 7, the number the checkpoint above says about a quarter of the time."""
    rows = []
    for i in range(offset, offset + n):
        name, item = _NAMES[i % len(_NAMES)], _ITEMS[i % len(_ITEMS)]
        a, b = 7 + i, i
        rows.append({
            "question": f"{name} has {a + b} {item}, gives {b} to a friend and then eats {a - 7} of them. "
                        f"How many {item} does {name} have left?",
            "answer": f"{name} first has {a + b} - {b} = <<{a + b}-{b}={a}>>{a} {item}.\n"
                      f"Then {a} - {a - 7} = <<{a}-{a - 7}=7>>7.\n#### 7",
        })
    return rows


def _write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# VmHWM, not ru_maxrss: a child starts with its parent's ru_maxrss (Linux keeps it across fork and
# exec), so the test process's own peak would leak into the run's.
_RUN = """
import json, sys
from rljax.cli import main
code = main(sys.argv[1:])
hwm_kib = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print(json.dumps({"exit": code, "peak_rss_mib": hwm_kib / 1024}))
"""


def _sharding(step_dir, item: str, *path):
    """The sharding the run saved a checkpoint leaf with (orbax metadata: nothing is read)."""
    tree = ocp.PyTreeCheckpointer().metadata(step_dir / item).item_metadata.tree
    for key in path:
        tree = tree[key]
    return tree.sharding


def test_gsm8k_recipe_with_the_real_vocabulary(tmp_path):
    """`rljax train --config gsm8k_qwen` runs two GRPO iterations with the real Qwen vocabulary
    (151,936-id tied embedding, the qwen tokenizer and its chat template), bf16 compute and the
    math verifier, FSDP over 8 simulated devices, in a process whose peak RSS stays under
    RSS_BOUND_MIB. 30-160 s on this 2-core machine (quiet to shared), most of it compiling.

    Catches: a [B, T, V] f32 materialisation or an unsharded copy of the train state (the RSS
    bound; see its comment); a NaN anywhere in the bf16 update (every metric must be finite); a
    gradient lost on the way through the vocabulary projection (grad_norm 0 although groups
    disagree); a verifier that never scores the decoded text (rewards must match the completions:
    exactly "7" is right, no 7 at all is wrong); a recipe override that turns off bf16, the chat
    template or the math verifier; a run that silently falls back to one device or to replicated
    params (the checkpoint's shardings must split the embedding and Adam's moments 8 ways on fsdp).
    """
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    num_params = _write_checkpoint(ckpt)
    _write_jsonl(tmp_path / "train.jsonl", _gsm8k_rows(16, 0))
    _write_jsonl(tmp_path / "test.jsonl", _gsm8k_rows(8, 100))
    args = ["train", "--config", "gsm8k_qwen", f"model.checkpoint='{ckpt}'", "model.tokenizer=qwen",
            f"data.path='{tmp_path / 'train.jsonl'}'", f"data.eval_path='{tmp_path / 'test.jsonl'}'",
            f"data.max_prompt_tokens={PROMPT_TOKENS}", f"output_dir='{out}'", "data.eval_size=8", "eval.size=8",
            "eval.num_samples=2", "eval.pass_k=[1, 2]", "rl.iterations=2", f"rl.prompts_per_iteration={PROMPTS}",
            f"sampling.num_samples={SAMPLES}", f"sampling.max_new_tokens={NEW_TOKENS}", "update.num_microbatches=1",
            "checkpoint.keep_last=1", "metrics.tensorboard=false", "metrics.progress_bar=false",
            "metrics.samples_every=1", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"]
    # LLVM's default -O2, not the suite's -O0 (tests/conftest.py): RSS_BOUND_MIB was measured so.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, env=env, timeout=900)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval/prompts_too_long"] == 0  # so every prompt is padded to PROMPT_TOKENS
    rl = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        bad = {k: v for k, v in r.items() if not np.isfinite(v)}
        assert not bad, bad
        assert "loss/policy" in r and r["rollout/verifier_failed"] == 0
        assert r["rollout/reward_correct"] == r["rollout/reward_mean"]  # the only reward term
        if r["train/zero_variance_groups"] < PROMPTS:  # some group's rewards differ
            assert r["grad_norm"] > 0, r
    assert sum(r["rollout/reward_correct"] for r in rl) > 0  # 32 rows at p ~ 0.2 each

    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) >= 4
    for s in samples:
        assert s["prompt"].startswith("system\nThink step by step") and "\nassistant\n" in s["prompt"], s
        if s["completion"].strip() == "7":
            assert s["reward"] == 1.0, s
        elif "7" not in s["completion"]:
            assert s["reward"] == 0.0, s

    with Checkpointer(out / "checkpoints", read_only=True) as ck:
        step = ck.latest_step()
        config = ck.restore(step, params=None).config
    assert (config["model"]["compute_dtype"], config["data"]["chat"], config["reward"]["kind"]) == \
        ("bfloat16", True, "math")
    step_dir = out / "checkpoints" / str(step)
    for item, path in (("params", ("embed",)), ("opt_state", (1, 0, "mu", 0, "embed")),
                       ("opt_state", (1, 0, "nu", 0, "embed"))):
        sh = _sharding(step_dir, item, *path)
        assert dict(zip(sh.axis_names, sh.shape)) == {"data": 1, "fsdp": 8, "tensor": 1}, (item, path, sh)
        assert "fsdp" in tuple(sh.partition_spec), (item, path, sh)  # split, not replicated

    rows_bt = PROMPTS * SAMPLES * (PROMPT_TOKENS + NEW_TOKENS)
    signals = {"[B, T, V] f32 logits": rows_bt * VOCAB * 4 / 2**20, "train state": num_params * 12 / 2**20}
    print(f"peak RSS {report['peak_rss_mib']:.0f} MiB (bound {RSS_BOUND_MIB}), {seconds:.0f} s")  # shown by -rP
    assert report["peak_rss_mib"] < RSS_BOUND_MIB, (report, signals, f"{seconds:.0f} s")
