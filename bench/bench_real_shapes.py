"""One GRPO iteration at Qwen2.5-0.5B's exact shapes on this CPU: per-phase times, peak RSS, and
the update program's compiled memory against the unchunked program's.

The model is random-init (no download) with the published Qwen2.5-0.5B `config.json` (494,032,768
parameters, 151,936-id tied embedding), read through `rljax.models.from_hf_dict` as a checkpoint
would be, in the GSM8K recipe's dtypes (`configs/gsm8k_qwen.toml`: f32 params, bf16 compute) and
update schedule (its rows per micro-batch, remat, algorithm and old-log-prob recomputation). The
batch is the issue's small one: 8 GSM8K-style prompts (Qwen chat template and the recipe's system prompt,
64-128 tokens, padded to 128) x 4 samples x 128 new tokens, scored by the recipe's math verifier.

Phases are compiled and timed one by one (the loop fuses them into one program, so this split is
the only way to see them): compile the sampler, sample, verify on the host, compile the update,
update. Peak RSS is VmHWM after each phase. Memory: `memory_analysis()` of the compiled update,
and of the same update with the vocabulary projection in one piece (`update.logprob_chunk` = T,
`update.logprob_vocab_chunk` = V: [rows, T, V] f32 logits) compiled on abstract inputs only
(nothing allocated). Peer: transformers' Qwen2 forward + backward of the same loss on the same
batch and micro-batches in torch bf16 autocast (no optimiser step, no scoring pass), in a child
process so the two peaks stay apart. Writes bench/results/real_shapes.json.

    .venv/bin/python bench/bench_real_shapes.py              # full shapes: ~15 minutes here
    .venv/bin/python bench/bench_real_shapes.py --layers 1 --new-tokens 8 --no-peer   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from peak import matmul_peak_gflops  # noqa: E402  (bench/ is on sys.path when run as a script)
from rljax.rewards.config import build_reward
from rljax.models.setup import build_tokenizer
from rljax.data.example import verifier_metadata  # noqa: E402
from rljax.data.pipeline import prompt_batches  # noqa: E402
from rljax.models import from_hf_dict, init_params  # noqa: E402
from rljax.rewards import as_callback  # noqa: E402
from rljax.sampling import sample  # noqa: E402
from rljax.train import setup  # noqa: E402
from rljax.train.config import load_config  # noqa: E402
from rljax.train.run import sample_controls  # noqa: E402
from rljax.update import RolloutBatch, init_train_state, update  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Qwen/Qwen2.5-0.5B config.json as published (the fields the architecture reads).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151643, "use_sliding_window": False,
}
QWEN25_05B_PARAMS = 494_032_768

# GSM8K-style word problems (answers after '####'), long enough for 64-128-token chat prompts.
_PROBLEMS = [
    ("A bakery sells muffins for $3 each and cookies for $2 each. On Monday it sold 45 muffins and twice as "
     "many cookies as muffins. On Tuesday it sold 10 fewer muffins than on Monday and the same number of cookies "
     "as on Monday. How much money did the bakery make from muffins and cookies over the two days?", "585"),
    ("Maria is saving for a bicycle that costs $240. She already has $60 in her piggy bank. Every week she earns "
     "$15 from walking her neighbour's dog and spends $3 of it on snacks. How many weeks will it take Maria to "
     "have enough money to buy the bicycle?", "15"),
    ("A school is organising a trip for 150 students and 12 teachers. Each bus can carry 40 people, and renting "
     "one bus for the day costs $180. The school also pays $6 per person for museum tickets. What is the total "
     "cost of the buses and the tickets for the trip?", "1692"),
    ("Tom reads 12 pages of his book every weekday and 20 pages every day on the weekend. His book has 380 pages "
     "and he has already read 56 pages. How many full weeks will he need to finish the rest of the book if he "
     "keeps reading at this pace?", "4"),
    ("A farmer has 3 fields. The first field produces 120 kilograms of potatoes, the second produces 50 "
     "kilograms more than the first, and the third produces half as much as the first two fields together. He "
     "sells the potatoes in 5-kilogram bags for $4 a bag. How much money does he make?", "348"),
    ("A water tank holds 900 litres. It is filled by a pipe that adds 30 litres per minute while a leak removes "
     "5 litres per minute. The tank starts with 150 litres of water in it. How many minutes does it take to "
     "fill the tank completely?", "30"),
    ("Lena buys 4 notebooks at $2.50 each, 3 packs of pens at $4 each and a backpack that costs three times as "
     "much as all the notebooks together. She pays with a $100 bill. How much change does she get back from "
     "the cashier?", "48"),
    ("A train travels from city A to city B at 80 kilometres per hour and the trip takes 3 hours. On the way "
     "back it travels 20 kilometres per hour slower because of repairs on the line. How many hours does the "
     "round trip take in total, not counting stops?", "7"),
]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg} (peak RSS {_rss_peak_mib():.0f} MiB)", file=sys.stderr, flush=True)


def _rss_now_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def _rss_peak_mib() -> float:
    """This process's peak RSS (VmHWM; ru_maxrss would start at the parent's peak in a child)."""
    with open("/proc/self/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) / 1024


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def _write_data(path: str) -> None:
    with open(path, "w") as f:
        for i in range(64):  # names vary so every question is distinct
            question, answer = _PROBLEMS[i % len(_PROBLEMS)]
            f.write(json.dumps({"question": f"(Problem {i + 1}) {question}", "answer": f"... #### {answer}"}) + "\n")


def _train_flops(cfg, rows: int, t: int) -> float:
    """Matmul FLOPs of forward + backward (3x forward) over rows x t tokens, attention over t keys."""
    d, n, k, h, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                        cfg.vocab_size)
    per_layer = d * (n + 2 * k) * h + n * h * d + 3 * d * f + 2 * n * h * t
    return 3 * 2.0 * rows * t * (cfg.num_layers * per_layer + v * d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24, help="layers (24: the real model; fewer for a smoke run)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-peer", action="store_true", help="skip the transformers forward + backward")
    ap.add_argument("--peer", help=argparse.SUPPRESS)  # internal: run the peer on this saved batch
    ap.add_argument("--out", default=os.path.join(RESULTS, "real_shapes.json"))
    args = ap.parse_args()
    if args.peer:
        return _torch_peer(args.peer)

    t_start = time.perf_counter()
    code = _code_version()  # before anything runs: the modules are already imported
    rss = {"start": _rss_peak_mib()}
    peaks = {name: round(matmul_peak_gflops(dt), 1) for name, dt in (("float32", jnp.float32),
                                                                      ("bfloat16", jnp.bfloat16))}
    _log(f"matmul peak {peaks} GFLOP/s")
    tmp = tempfile.mkdtemp(prefix="rljax-real-shapes-")
    _write_data(os.path.join(tmp, "train.jsonl"))
    # The recipe's micro-batch size in rows, kept at this smaller batch (its count would not divide it).
    # (padded, as these figures were measured: the recipe now packs; see BENCHMARKS.md)
    recipe = load_config("gsm8k_qwen", ["model.tokenizer=qwen", "update.packing=false", "update.num_microbatches=64"])
    recipe_rows = recipe.rl.prompts_per_iteration * recipe.sampling.num_samples // recipe.update.chunks
    micro = max(1, args.prompts * args.samples // recipe_rows)
    cfg = load_config("gsm8k_qwen", [
        "model.tokenizer=qwen", f"data.path='{tmp}/train.jsonl'", "data.eval_path=''", "data.eval_size=0",
        "data.max_prompt_tokens=128", f"rl.prompts_per_iteration={args.prompts}",
        f"sampling.num_samples={args.samples}", f"sampling.max_new_tokens={args.new_tokens}",
        "update.packing=false", f"update.num_microbatches={micro}", "update.num_minibatches=1", f"output_dir='{tmp}'"])
    tok = build_tokenizer(cfg.model)
    model_cfg = from_hf_dict({**QWEN25_05B, "num_hidden_layers": args.layers}, param_dtype=cfg.model.param_dtype,
                             compute_dtype=cfg.model.compute_dtype, eos_token_id=tok.eos_ids,
                             pad_token_id=tok.pad_id)
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_params(model_cfg, jax.random.key(0)))
    init_s = time.perf_counter() - t0
    n_params = int(sum(x.size for x in jax.tree.leaves(params)))
    if args.layers == 24:
        assert n_params == QWEN25_05B_PARAMS, n_params
    state = init_train_state(model_cfg, params, cfg.algorithm, cfg.optim, update_cfg=cfg.update, shaping=cfg.shaping)
    del params
    rss["model_and_state"] = _rss_peak_mib()
    _log(f"{n_params:,} params, train state built ({init_s:.1f} s init)")

    train_set, _, _ = setup.build_splits(cfg.data)
    data = prompt_batches(train_set, tokenizer=tok, batch_size=args.prompts, seed=0,
                          max_prompt_len=cfg.data.max_prompt_tokens, fmt=setup.prompt_format(cfg.data),
                          add_bos=cfg.data.add_bos)
    callback = as_callback(build_reward(cfg.reward), tok, [verifier_metadata(e) for e in data.examples])
    controls = sample_controls(cfg, tok)
    b = next(iter(data.dataset))
    prompt_lengths = b.mask_bt.sum(1)

    times, memory = {}, {}
    sample_jit = jax.jit(sample, static_argnames=("cfg", "controls"))
    t0 = time.perf_counter()
    sample_c = sample_jit.lower(model_cfg, state.params, b.tokens_bt, b.mask_bt, jax.random.key(1),
                                controls).compile()
    times["compile_sample"] = time.perf_counter() - t0
    _log(f"compile_sample: {times['compile_sample']:.1f} s")
    memory["sample"] = _memory(sample_c)
    t0 = time.perf_counter()
    out = jax.block_until_ready(sample_c(state.params, b.tokens_bt, b.mask_bt, jax.random.key(1)))
    times["sample"] = time.perf_counter() - t0
    _log(f"sample: {times['sample']:.1f} s")
    rss["sample"] = _rss_peak_mib()

    n = controls.num_samples
    index_b = np.repeat(b.indices_b.astype(np.int32), n)
    t0 = time.perf_counter()
    callback.eager(out.tokens, out.mask, index_b)  # starts the verifier pool's worker processes
    times["reward_first_call"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rewards = callback.eager(out.tokens, out.mask, index_b)
    times["reward"] = time.perf_counter() - t0
    _log(f"reward: {times['reward']:.1f} s")

    prompt, pmask = np.repeat(b.tokens_bt, n, 0), np.repeat(b.mask_bt, n, 0)
    out_mask = np.asarray(out.mask)
    batch = RolloutBatch(tokens_bt=np.concatenate([prompt, np.asarray(out.tokens)], 1),
                         attn_mask_bt=np.concatenate([pmask, out_mask], 1),
                         loss_mask_bt=np.concatenate([np.zeros_like(pmask), out_mask], 1),
                         sampler_logp_bt=np.concatenate([np.zeros(pmask.shape, np.float32),
                                                         np.asarray(out.logprobs)], 1),
                         rewards_b=np.asarray(rewards.total_b), group_ids_b=np.repeat(np.arange(args.prompts), n),
                         completion_len=controls.max_new_tokens)
    del out
    rows, t = batch.tokens_bt.shape
    update_jit = jax.jit(update, donate_argnums=(0,))
    t0 = time.perf_counter()
    update_c = update_jit.lower(state, batch, jax.random.key(2)).compile()
    times["compile_update"] = time.perf_counter() - t0
    _log(f"compile_update: {times['compile_update']:.1f} s")
    memory["update"] = _memory(update_c)
    t0 = time.perf_counter()
    state, metrics = update_c(state, batch, jax.random.key(2))
    jax.block_until_ready((state.params, metrics))
    times["update"] = time.perf_counter() - t0
    _log(f"update: {times['update']:.1f} s")
    rss["update"] = _rss_peak_mib()
    rss_steady = _rss_now_mib()
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}

    # The unchunked update, on abstract inputs: nothing is allocated.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
    whole = dataclasses.replace(cfg.update, logprob_chunk=t, logprob_vocab_chunk=model_cfg.vocab_size)
    abstract_state = abstract[0].replace(update_cfg=whole)  # [rows, T, V] f32 logits in one piece
    t0 = time.perf_counter()
    memory["update_unchunked"] = _memory(jax.jit(update, donate_argnums=(0,)).lower(
        abstract_state, abstract[1], jax.random.key(2)).compile())
    times["compile_update_unchunked"] = time.perf_counter() - t0
    _log(f"compile_update_unchunked: {times['compile_update_unchunked']:.1f} s")
    chunks = cfg.update.chunk_for(rows // cfg.update.chunks, t, model_cfg.vocab_size)
    rss["end"] = _rss_peak_mib()

    rescored = cfg.algorithm.recompute_old_logp  # a no-grad forward before the update: 4 forwards, not 3
    gflop = _train_flops(model_cfg, rows, t) * (4 / 3 if rescored else 1) / 1e9
    mib = lambda x: round(x / 2**20, 1)  # noqa: E731
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
                    "backend": jax.default_backend(), "devices": jax.device_count()},
        "versions": {"python": platform.python_version(), "jax": jax.__version__, **_peer_versions()},
        "matmul_peak_gflops": peaks,
        "setup": {"model": "Qwen2.5-0.5B shapes, random init" if args.layers == 24 else f"{args.layers} layers",
                  "params": n_params, "param_dtype": model_cfg.param_dtype, "compute_dtype": model_cfg.compute_dtype,
                  "algorithm": cfg.algorithm.algorithm, "prompts": args.prompts, "samples_per_prompt": n,
                  "new_tokens": controls.max_new_tokens, "prompt_tokens_min_max": [int(prompt_lengths.min()),
                                                                                  int(prompt_lengths.max())],
                  "prompt_bucket": int(b.tokens_bt.shape[1]), "rows": rows, "seq_len": t,
                  "micro_batches": cfg.update.num_microbatches, "remat": cfg.update.remat,
                  "logprob_chunks": {"time": chunks.time, "vocab": chunks.vocab}},
        "times_s": {k: round(v, 2) for k, v in {"init": init_s, **times,
                                                "total": time.perf_counter() - t_start}.items()},
        "generated_tokens": int(out_mask.sum()),
        "sample_new_tok_s": round(float(out_mask.sum()) / times["sample"], 1),
        "update_tok_s": round(rows * t / times["update"], 1),
        "update_rescores_old_logp": rescored,
        "update_gflop": round(gflop, 1),
        "update_gflops": round(gflop / times["update"], 1),
        "update_frac_of_bf16_peak": round(gflop / times["update"] / peaks["bfloat16"], 3),
        "peak_rss_mib": {k: round(v, 1) for k, v in rss.items()},
        "rss_after_update_mib": round(rss_steady, 1),
        "compiled_mib": {name: {k: mib(v) for k, v in m.items()} for name, m in memory.items()},
        "unchunked_over_chunked_update_temp": round(memory["update_unchunked"]["temp"] / memory["update"]["temp"], 2),
        "reward_mean": float(np.mean(rewards.total_b)),
        "metrics": metrics,
        "code": code,
        "peer": None,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:  # written now, and again with the peer
        json.dump(result, f, indent=2)

    del state, update_c, sample_c  # the peer runs next to this process: give its memory back first
    if not args.no_peer:
        batch_file = os.path.join(tmp, "batch.npz")
        adv = np.asarray(rewards.total_b, np.float32).reshape(args.prompts, n)
        np.savez(batch_file, tokens=np.asarray(batch.tokens_bt), attn=np.asarray(batch.attn_mask_bt),
                 loss=np.asarray(batch.loss_mask_bt), adv=(adv - adv.mean(1, keepdims=True)).reshape(-1),
                 layers=args.layers, micro=cfg.update.num_microbatches, rescore=rescored, remat=cfg.update.remat)
        _log("peer: transformers forward + backward")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--peer", batch_file],
                              capture_output=True, text=True, check=True)
        result["peer"] = json.loads(proc.stdout.strip().splitlines()[-1])
        result["update_over_peer"] = round(times["update"] / result["peer"]["total_s"], 2)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


def _torch_peer(batch_file: str) -> None:
    """transformers' Qwen2 forward + backward of the same policy-gradient loss on the saved batch, in
    the same micro-batches, torch bf16 autocast over f32 params (the recipe's dtypes)."""
    import torch
    import transformers

    d = np.load(batch_file)
    torch.manual_seed(0)
    fields = {k: v for k, v in QWEN25_05B.items() if k not in ("architectures", "model_type")}
    hf = transformers.Qwen2Config(**{**fields, "num_hidden_layers": int(d["layers"])})
    model = transformers.Qwen2ForCausalLM(hf).train()
    if bool(d["remat"]):  # the update recomputes layer activations in the backward pass: so does the peer
        model.gradient_checkpointing_enable()
    rss_model = _rss_peak_mib()
    tokens, attn = torch.from_numpy(d["tokens"]).long(), torch.from_numpy(d["attn"]).long()
    loss_mask, adv = torch.from_numpy(d["loss"]).float(), torch.from_numpy(d["adv"]).float()
    micro = int(d["micro"])
    size = tokens.shape[0] // micro
    norm = float(loss_mask.sum())

    def score(rows: slice) -> None:  # the old log-probs, as the update's scoring pass
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=tokens[rows], attention_mask=attn[rows]).logits[:, :-1]
            torch.log_softmax(logits.float(), -1).gather(-1, tokens[rows, 1:, None])

    def step(rows: slice) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=tokens[rows], attention_mask=attn[rows]).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[rows, 1:, None])[..., 0]
        loss = -(adv[rows, None] * logp * loss_mask[rows, 1:]).sum() / norm
        loss.backward()

    step(slice(0, 1))  # warm-up: one row
    model.zero_grad(set_to_none=False)
    score_s = 0.0
    if bool(d["rescore"]):
        t0 = time.perf_counter()
        for i in range(micro):
            score(slice(i * size, (i + 1) * size))
        score_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(micro):
        step(slice(i * size, (i + 1) * size))
    fwd_bwd_s = time.perf_counter() - t0
    print(json.dumps({"what": "transformers Qwen2ForCausalLM: a no-grad scoring forward (when the update rescores) "
                              "then forward + backward (gradient checkpointing when the update remats), torch bf16 "
                              "autocast, f32 params, same batch and micro-batches, no optimiser step",
                      "score_s": round(score_s, 2), "fwd_bwd_s": round(fwd_bwd_s, 2),
                      "total_s": round(score_s + fwd_bwd_s, 2), "threads": torch.get_num_threads(),
                      "peak_rss_mib": round(_rss_peak_mib(), 1), "rss_after_model_mib": round(rss_model, 1)}))


def _code_version() -> dict:
    """The commit measured, and the files under rljax/ that differ from it (uncommitted work)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted_in_rljax": git("status", "--porcelain", "--", "rljax").splitlines()}


def _cpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), None)


def _peer_versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


if __name__ == "__main__":
    main()
