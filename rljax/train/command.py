"""`rljax train`, `rljax eval` and `rljax export`: thin CLI layers over the functional API."""

from __future__ import annotations

import argparse
import sys


def _recipes() -> list[str]:
    """The packaged recipes' names, read from the package data without importing jax (`--help`)."""
    from importlib import resources

    return sorted(f.name.removesuffix(".toml") for f in (resources.files("rljax") / "configs").iterdir()
                  if f.name.endswith(".toml"))


def register(sub) -> None:
    p = sub.add_parser("train", help="run RL training (no arguments: the tiny default job, CPU, 5-8 min)",
                       description="Train with a recipe. Override any setting as key=value, "
                                   "e.g. rl.iterations=20 algorithm.algorithm=dapo.",
                       epilog=f"packaged recipes (--config NAME): {', '.join(_recipes())}")
    p.add_argument("--config", help="a TOML recipe file, or a packaged recipe by name (default: default)")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.set_defaults(func=_train)

    p = sub.add_parser("train-rm", help="train a Bradley-Terry reward model on preference pairs (JSONL)",
                       description="Train a reward model on JSONL pairs {prompt, chosen, rejected[, margin]} and write "
                                   "it as a HF *ForSequenceClassification directory. Settings as key=value, e.g. "
                                   "pairs=pairs.jsonl steps=1000 base=/path/to/causal-lm output_dir=rm_out.")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.set_defaults(func=_train_rm)

    p = sub.add_parser("eval", help="greedy accuracy, pass@k and mean@k of a run's checkpoint on held-out data")
    p.add_argument("run_dir", help="the run's output directory (holds checkpoints/ and its config)")
    p.add_argument("--step", default="best", help="checkpoint step, 'best' or 'latest' (default: best)")
    p.add_argument("--samples", type=int, default=None, help="samples per problem for pass@k (default: config)")
    p.add_argument("--seeds", type=int, default=None, help="sampling seeds for mean@k (default: config)")
    p.set_defaults(func=_eval)

    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face safetensors directory")
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--step", default="best")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--merge", action="store_true",
                      help="one HF model, a LoRA run's adapters merged into its base (the default)")
    form.add_argument("--adapter", action="store_true",
                      help="a LoRA run as a PEFT adapter directory, with its base model in OUT_DIR/base")
    p.set_defaults(func=_export)


def _train(args: argparse.Namespace) -> int:
    from rljax.sharding import initialize
    from rljax.train.config import load_config
    from rljax.train.loop import train

    initialize()  # joins a multi-host run described by RLJAX_* env vars; a no-op otherwise
    cfg = load_config(args.config, args.overrides)
    _check_memory(cfg)
    result = train(cfg, resume=args.resume)
    if result.state is None:  # a sampler host of a multi-process async run: the trainer host reports
        print(f"sampler host done; the trainer host writes {result.output_dir / 'metrics.jsonl'}")
        return 0
    print(f"held-out greedy accuracy: {result.start_accuracy:.3f} -> {result.final_accuracy:.3f}")
    print(f"checkpoints: {result.output_dir / 'checkpoints'}")
    print(f"metrics:     {result.output_dir / 'metrics.jsonl'} (TensorBoard: {result.output_dir / 'tensorboard'})")
    if result.plot:
        print(f"plot:        {result.plot}")
    return 0


def _train_rm(args: argparse.Namespace) -> int:
    from rljax.config_io import apply_overrides, build
    from rljax.train.reward_model import RewardTrainConfig, train_reward_model

    # model.* settings size a from-scratch model whose tokenizer defaults to the default job's
    defaults = {"model": {"tokenizer": RewardTrainConfig().model.tokenizer}}
    summary = train_reward_model(build(RewardTrainConfig, apply_overrides(defaults, args.overrides)))
    print(f"held-out pair accuracy: {summary['before']['eval/pair_accuracy']:.3f} -> "
          f"{summary['after']['eval/pair_accuracy']:.3f}")
    return 0


def _check_memory(cfg) -> None:
    """Plans the run's memory per device before anything is allocated (abstract inputs only) and
    stops with one line when it does not fit (`[plan]` section); no check where the device
    memory is unknown (CPU) or `plan.check = false`."""
    from rljax.plan.accelerators import device_memory

    limit = device_memory(cfg.plan.accelerator, cfg.plan.device_memory_gib) if cfg.plan.check else None
    from rljax.plan.remat import choose_remat, needs_choice

    if needs_choice(cfg) and cfg.plan.check:  # chooses from the plan (cached), refusing in one line when nothing fits
        choose_remat(cfg, limit=limit)  # `build_run` takes the choice from the cache and logs it
        return
    if limit is not None:
        from rljax.plan.advice import check_fits

        check_fits(cfg, *limit)


def _run_config(run_dir: str, step: str):
    """The run's TrainConfig and the checkpoint that `step` ('best', 'latest' or a number) names,
    "best" by the run's own `checkpoint.best_metric` (`rljax.checkpoint.open_run`). `run_dir` may
    be a URI (gs://bucket/run): a pod's run is evaluated or exported from its bucket."""
    from rljax.checkpoint import open_run
    from rljax.config_io import build
    from rljax.errors import CheckpointError
    from rljax.train.config import TrainConfig

    picked = open_run(run_dir, step)
    if picked.config is None:
        raise CheckpointError(f"{picked.checkpoints}/{picked.step} holds no run config; was it saved by rljax train?")
    return build(TrainConfig, picked.config), picked


def _eval(args: argparse.Namespace) -> int:
    import json

    import jax

    from rljax.checkpoint import load_params
    from rljax.envs import get_format
    from rljax.evaluation.runner import EvalSetup, accuracy_by_task, greedy_judged, sampled_eval
    from rljax.rewards import AUDIT_PART
    from rljax.sampling import multiturn
    from rljax.evaluation.episodes import episode_accuracy
    from rljax.train import setup
    from rljax.models.setup import build_tokenizer
    from rljax.train.run import sample_controls
    from rljax.train.vision_setup import build_vision

    cfg, picked = _run_config(args.run_dir, args.step)
    step = picked.step
    print(f"evaluating {picked.describe()} of {args.run_dir}", file=sys.stderr)
    tokenizer = build_tokenizer(cfg.model)
    vision = build_vision(cfg, tokenizer, jax.random.key(0), (None, None))  # None: a text policy
    template = None if vision is None else jax.eval_shape(lambda: vision.params)
    model_cfg, params = load_params(picked.checkpoints, step, params_template=template)
    tokenizer = tokenizer if vision is None else vision.tokenizer
    controls = sample_controls(cfg, tokenizer)
    held_out = setup.eval_split(cfg)
    # the training run's held-out problems and reward: per source, routed by task, for a mixture
    evaluator = EvalSetup.build(model_cfg, held_out, tokenizer, setup.prompt_format(cfg.data),
                                setup.run_reward(cfg), controls,
                                max_prompt_len=cfg.data.max_prompt_tokens, add_bos=cfg.data.add_bos,
                                images=None if vision is None else vision.prompter(cfg, held_out))
    result = {"step": step, "picked": picked.picked, "problems": len(evaluator.examples),
              "prompts_too_long": evaluator.num_too_long}
    if picked.metric is not None:  # what the run measured at this step, beside what eval measures now
        result[f"checkpoint/{picked.metric}"] = picked.value
    if cfg.env.enabled:  # greedy episodes with the run's tool; sampled pass@k is single-turn only
        stop = tokenizer.encode(get_format(cfg.env.format).stop_sequence)
        result["greedy_accuracy"] = episode_accuracy(
            evaluator, params, setup.build_env(cfg.env), cfg.env,
            multiturn.episode_controls(controls, stop))
        print(json.dumps(result, indent=2))
        return 0
    judged = greedy_judged(evaluator, params)
    solved = judged["correct"]
    result["greedy_accuracy"] = float(solved.mean()) if solved.size else float("nan")
    if AUDIT_PART in judged:  # the run's stricter check on the same replies
        result["greedy_accuracy_strict"] = float(judged[AUDIT_PART].mean()) if solved.size else float("nan")
    result.update({f"greedy_accuracy/{task}": acc for task, acc in accuracy_by_task(evaluator, solved).items()})
    samples = args.samples or cfg.eval.num_samples
    result.update(sampled_eval(evaluator, params, num_samples=samples,
                               ks=tuple(k for k in cfg.eval.pass_k if k <= samples),
                               seeds=args.seeds or cfg.eval.seeds, temperature=cfg.eval.temperature))
    print(json.dumps(result, indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    import jax

    from rljax.checkpoint import export_hf, export_peft
    from rljax.checkpoint.export import export_vl
    from rljax.errors import CheckpointError
    from rljax.models.setup import build_tokenizer
    from rljax.train.vision_setup import build_vision

    cfg, picked = _run_config(args.run_dir, args.step)
    tokenizer = build_tokenizer(cfg.model)
    vision = build_vision(cfg, tokenizer, jax.random.key(0), (None, None))  # None: a text policy
    if vision is not None:  # a Qwen2.5-VL directory: tower, merger, M-RoPE; LoRA adapters merged
        if args.adapter:
            raise CheckpointError("--adapter writes a PEFT adapter for a text model; a vision-language run exports "
                                  "one Qwen2.5-VL directory with its adapters merged: drop --adapter")
        export_vl(picked.checkpoints, args.out_dir, picked.step, vision.cfg,
                  params_template=jax.eval_shape(lambda: vision.params), tokenizer=tokenizer)
        print(f"exported {picked.describe()} of {args.run_dir} to {args.out_dir} as a Qwen2.5-VL model (vision tower "
              "and merger included), with its tokenizer")
        return 0
    if args.adapter:
        lora = export_peft(picked.checkpoints, args.out_dir, picked.step, tokenizer=tokenizer)
        print(f"exported the rank-{lora.rank} LoRA adapter of {picked.describe()} of {args.run_dir} to "
              f"{args.out_dir} (its base model: {args.out_dir}/base), with its tokenizer")
        return 0
    export_hf(picked.checkpoints, args.out_dir, picked.step, tokenizer=tokenizer)
    print(f"exported {picked.describe()} of {args.run_dir} to {args.out_dir}, with its tokenizer "
          f"({type(tokenizer).__name__}); sample from it: rljax sample --checkpoint {args.out_dir} --prompt ...")
    return 0
