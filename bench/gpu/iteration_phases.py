"""The bench's iteration phase (issue 53): one whole GRPO iteration on one GPU, and TRL's beside it.

case "rljax": the program `rljax train` runs each iteration in its default mode (`rl.mode =
"sync"`, the sampler sharing the trainer's layout: `rljax.stages.iteration.make_iteration`, ONE
compiled program: sample -> verify (host callback) -> update), at Qwen2.5-0.5B shapes with random
weights: 8 prompts x 8 samples, 256 prompt + 768 new tokens (no EOS is ever drawn from a random
model, so every row runs the whole budget), dr_grpo, AdamW, f32 params, bf16 compute, 4
micro-batches. The verifier is rljax's exact-value check (`rljax.rewards.audit.ExactValue` on
the final line, the default job's audit) on the tokens written as digits (`digit_text`): pure
Python, nothing to install on the GPU machine. The iteration is built here rather than by
`rljax train` because the run's data pipeline needs grain (and its tasks reasoning-gym), which
that machine lacks; the compiled program is the same.

    per iteration       wall seconds (`block_until_ready` of its metrics, as `rljax.train.loop`
                        times `time/iteration_s`), the verifier's host seconds inside it
                        (`RewardCallback.take_seconds`, the loop's `time/verify_s`)
    parts, timed alone  sampling (the same rollout with an in-graph zero reward: no host call),
                        verification (the callback's host function on those rows), the update
                        (`update_step` on that batch): each compiled and timed on its own
    host wait           iteration - (sampling alone + update alone): the device idles while the
                        host decodes and verifies and between programs (target < 5%)
    overhead            iteration / (sampling + verification + update alone) - 1 (target < 10%)

case "trl": TRL's `GRPOTrainer` on the same prompts (the token ids written as words of a
whitespace word-level tokenizer, so they tokenize back to the same ids), group size, lengths,
optimiser (AdamW lr 1e-6, weight decay 0.01, clip 1.0) and loss (`loss_type="dr_grpo"`,
`scale_rewards="none"`: reward minus the group mean, Dr. GRPO 2025), bf16 autocast over f32
params, generation by transformers' `generate` (TRL's default without vLLM: a weak peer, as the
issue says), the same verifier. One TRL step = one generation of 64 rows + 4 accumulated
micro-batches + one optimiser step = one iteration; timed per step after one warm-up step.
Needs trl and datasets (wheels to carry to the GPU machine: BENCHMARKS.md).

`--small`: the bench's tiny model, 2 prompts x 4 samples, 16 + 16 tokens, 2 iterations, on CPU.
"""

from __future__ import annotations

import time

from gpu.jax_phases import peak_memory_gib
from gpu.shapes import CompileCounter, absent_module_imports, hf_config, timed

ITERATION_CASES = ["rljax", "trl"]
# (prompts, samples per prompt, prompt tokens, new tokens, micro-batches, timed iterations)
SHAPE = (8, 8, 256, 768, 4, 8)
SHAPE_SMALL = (2, 4, 16, 16, 2, 2)
DIGITS = "0123456789 \n"  # a token id's character in the verifier's view: id mod 12


def digit_text(ids: list[list[int]]) -> list[str]:
    """Token ids as text the exact-value verifier reads (id mod 12 -> a digit, space or newline)."""
    return ["".join(DIGITS[i % len(DIGITS)] for i in row) for row in ids]


def _problem(small: bool):
    """(shape, hf config, prompt ids [P, prompt], gold answers [P]) shared by both cases."""
    import numpy as np

    shape = SHAPE_SMALL if small else SHAPE
    p, _, prompt, _, _, _ = shape
    hf = hf_config("0.5B", small)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf["vocab_size"] - 1, (p, prompt)).astype(np.int32)  # vocab - 1 is EOS/pad
    golds = [str(g) for g in rng.integers(0, 10, p)]
    return shape, hf, ids, golds


def _verifier():
    from rljax import rewards
    from rljax.rewards.audit import ExactValue

    return rewards.compose(correct=ExactValue(methods=("final_line",)))


def iteration(args, case, record):
    """One case of the module docstring."""
    (_rljax if case == "rljax" else _trl)(args, record)


def _rljax(args, record):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rljax.models import from_hf_dict, init_params
    from rljax.objectives import AlgorithmConfig
    from rljax.optim import OptimConfig
    from rljax.rewards import as_callback
    from rljax.rewards.base import Rewards
    from rljax.sampling import SampleControls
    from rljax.stages.iteration import make_iteration
    from rljax.stages.rollout import rollout
    from rljax.update import UpdateConfig, init_train_state, update_step

    (p, g, prompt, new, micro, n_iter), hf, ids, golds = _problem(args.small)
    eos = hf["vocab_size"] - 1
    model_cfg = from_hf_dict(hf, compute_dtype="bfloat16", param_dtype="float32")
    state = init_train_state(model_cfg, init_params(model_cfg, jax.random.key(0)), AlgorithmConfig(algorithm="dr_grpo"),
                             OptimConfig(learning_rate=1e-6, max_grad_norm=1.0, weight_decay=0.01),
                             update_cfg=UpdateConfig(num_microbatches=micro))
    reward_fn = _verifier()
    callback = as_callback(reward_fn, digit_text, [{"answer": a} for a in golds])
    controls = SampleControls(max_new_tokens=new, num_samples=g, temperature=1.0, eos_ids=(eos,), pad_id=eos)
    prompts = (ids, np.ones(ids.shape, bool), np.arange(p, dtype=np.int32))  # host arrays, as the driver passes
    step = make_iteration(controls, callback, num_groups=p)  # what the sync driver calls each iteration
    key = jax.random.key(1)
    counter = CompileCounter()
    t = time.perf_counter()
    state, metrics, _ = step(state, *prompts, jax.random.fold_in(key, 0))
    jax.block_until_ready(metrics)
    first_s, first = time.perf_counter() - t, counter.take()
    callback.take_seconds()
    seconds, verify, generated = [], [], []
    for it in range(1, n_iter + 1):
        t = time.perf_counter()
        state, metrics, _ = step(state, *prompts, jax.random.fold_in(key, it))
        metrics = jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - t)
        verify.append(callback.take_seconds())
        generated.append(float(metrics["rollout/tokens"]))
    recompiles = counter.take()["programs_compiled"]

    # the parts, each compiled and timed alone on the same shapes
    def zero_reward(tokens_bt, mask_bt, index_b):
        z = jnp.zeros(tokens_bt.shape[:1], jnp.float32)
        return Rewards(z, {n: z for n in reward_fn.part_names}, jnp.zeros(tokens_bt.shape[:1], bool))

    sample = jax.jit(lambda params, t_, m_, i_, k_: rollout(model_cfg, params, t_, m_, i_, k_, controls=controls,
                                                            reward_callback=zero_reward, num_groups=p,
                                                            needs=state.algo.needs)[0])
    params = state.sampler_params()
    batch = jax.block_until_ready(sample(params, *prompts, key))
    reps = 2 if args.small else 3
    sample_s, _ = timed(lambda: jax.block_until_ready(sample(params, *prompts, key)), reps)
    c = batch.completion_len
    rows = (np.asarray(batch.tokens_bt[:, -c:]), np.asarray(batch.loss_mask_bt[:, -c:]), np.repeat(np.arange(p), g))
    verify_s, _ = timed(lambda: callback.eager(*rows), reps)
    del params
    holder = [state]
    del state

    def update_once():
        new_state, m = update_step(holder[0], batch, key)
        jax.block_until_ready((new_state.params, m))
        holder[0] = new_state

    update_once()  # compile
    update_s, _ = timed(update_once, reps)
    it_s = float(np.median(seconds))
    parts = sample_s + verify_s + update_s
    wait = it_s - sample_s - update_s
    record(system="rljax", model="0.5B", prompts=p, group=g, prompt_len=prompt, new_tokens=new, microbatches=micro,
           iterations=n_iter, first_call_s=first_s, **first, recompiles=recompiles, iteration_s=it_s, times=seconds,
           generated_tokens_per_s=float(np.median(generated)) / it_s, tokens_per_s=p * g * (prompt + new) / it_s,
           verify_in_iteration_s=float(np.median(verify)), sample_alone_s=sample_s, verify_alone_s=verify_s,
           update_alone_s=update_s, parts_sum_s=parts, overhead=it_s / parts - 1, host_wait_s=wait,
           host_wait_share=wait / it_s, peak_mem_gib=peak_memory_gib(jax.devices()[0]),
           absent_modules_imported=absent_module_imports())


def _word_tokenizer(vocab: int, eos: int):
    """A whitespace word-level tokenizer whose word "t<i>" is id i (EOS and pad: id `eos`)."""
    import tokenizers
    import transformers

    model = tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token=f"t{eos}")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos}", pad_token=f"t{eos}")


def _trl(args, record):
    import tempfile

    import datasets
    import torch
    import transformers
    import trl

    from gpu.torch_phases import _device, _qwen2

    (p, g, prompt, new, micro, n_iter), hf, ids, golds = _problem(args.small)
    n_iter = min(n_iter, 2)  # transformers' generate: about a minute per 64 x 768 on an H200
    device = _device()
    tokenizer = _word_tokenizer(hf["vocab_size"], hf["vocab_size"] - 1)
    texts = [" ".join(f"t{i}" for i in row) for row in ids]
    assert tokenizer(texts[0], add_special_tokens=False)["input_ids"] == ids[0].tolist()  # the same prompts
    steps = 1 + n_iter  # one warm-up step
    data = datasets.Dataset.from_dict({"prompt": texts * steps, "answer": golds * steps})
    reward_fn = _verifier()

    def correct(prompts, completions, completion_ids, answer, **_):
        texts_ = digit_text([list(c) for c in completion_ids])
        return [reward_fn({"answer": a}, t_)[0] for a, t_ in zip(answer, texts_)]

    stamps = []

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            stamps.append(["begin", time.perf_counter()])

        def on_step_end(self, *a, **k):
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append(["end", time.perf_counter()])

    rows = p * g
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(
            output_dir=out, per_device_train_batch_size=rows // micro, gradient_accumulation_steps=micro,
            num_generations=g, max_completion_length=new, temperature=1.0, loss_type="dr_grpo",
            scale_rewards="none", beta=0.0, learning_rate=1e-6, weight_decay=0.01, max_grad_norm=1.0,
            lr_scheduler_type="constant", optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
            bf16=device == "cuda", use_cpu=device == "cpu", max_steps=steps, logging_steps=1, report_to="none",
            save_strategy="no", shuffle_dataset=False, disable_tqdm=True, seed=0)
        trainer = trl.GRPOTrainer(model=_qwen2(hf, device), reward_funcs=correct, args=config, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[StepClock()])
        t = time.perf_counter()
        trainer.train()
        total_s = time.perf_counter() - t
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    begins = [s for w, s in stamps if w == "begin"]
    ends = [s for w, s in stamps if w == "end"]
    per_step = [e - b for b, e in zip(begins, ends)]
    timed_steps = per_step[1:] or per_step
    it_s = sum(timed_steps) / len(timed_steps)
    record(system="trl", model="0.5B", prompts=p, group=g, prompt_len=prompt, new_tokens=new, microbatches=micro,
           iterations=len(timed_steps), warmup_s=per_step[0] if per_step else None, iteration_s=it_s,
           times=timed_steps, train_s=total_s, mean_completion_len=lengths[-1] if lengths else None,
           generated_tokens_per_s=rows * (lengths[-1] if lengths else new) / it_s,
           tokens_per_s=rows * (prompt + new) / it_s, generation="transformers generate (no vLLM)",
           loss_type=config.loss_type, scale_rewards=config.scale_rewards,
           peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
           trl=trl.__version__, datasets=datasets.__version__, torch=torch.__version__,
           transformers=transformers.__version__)


def report_lines(r) -> list[str]:
    """The markdown of the iteration phase (`gpu.report.Run` records)."""
    from gpu.report import _num, _pct, _row

    lines = ["### The whole GRPO iteration (0.5B shapes, one device)", "",
             "One iteration: 8 prompts x 8 samples, 256 + 768 tokens, verify, dr_grpo update (AdamW, 4 "
             "micro-batches). rljax: `rljax train`'s compiled iteration (sync mode), its parts compiled and timed "
             "alone; TRL: `GRPOTrainer` (dr_grpo, transformers `generate`, no vLLM). Targets: host wait < 5%, "
             "iteration within 10% of its parts.", "",
             _row("system", "iteration s", "generated tok/s", "sampling s", "verify s", "update s", "parts sum s",
                  "over parts", "host wait", "peak GiB"), _row(*["---"] * 10)]
    for case in ITERATION_CASES:
        x = r.find("iteration", case)
        if not x:
            lines.append(_row(case, r.missing("iteration", case), *[""] * 8))
        elif case == "rljax":
            lines.append(_row("rljax", _num(x["iteration_s"], 2), _num(x["generated_tokens_per_s"]),
                              _num(x["sample_alone_s"], 2), _num(x["verify_alone_s"], 3), _num(x["update_alone_s"], 2),
                              _num(x["parts_sum_s"], 2), _pct(x["overhead"]), _pct(x["host_wait_share"]),
                              _num(x["peak_mem_gib"], 1)))
        else:
            lines.append(_row(f"TRL {x['trl']}", _num(x["iteration_s"], 2), _num(x["generated_tokens_per_s"]),
                              "-", "-", "-", "-", "-", "-", _num(x["peak_mem_gib"], 1)))
    return lines + [""]
