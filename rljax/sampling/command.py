"""`rljax sample`: generate text from a Hugging Face checkpoint directory or a training run's
directory (its best checkpoint, by the run's own metric, and the tokenizer the run trained with),
streamed as it is drawn."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a checkpoint (streams by default)")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="HF directory (config.json, *.safetensors and tokenizer files, e.g. from rljax export), "
                        "or a run directory of rljax train (its best checkpoint)")
    p.add_argument("--step", default="best",
                   help="with a run directory: checkpoint step, 'best' or 'latest' (default: best)")
    p.add_argument("--tokenizer", metavar="SPEC",
                   help="the tokenizer, where the checkpoint's own is missing or another is wanted: a directory "
                        "with tokenizer.json or tokenizer.model, a .model file, a built-in name (qwen) or "
                        "chars:<alphabet> (default: the checkpoint's)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="render the prompt as a user turn of the chat template")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="an image before the prompt (repeat for several); needs a vision-language checkpoint "
                        "(qwen2_5_vl); samples with --scheduler (either) and prints at the end")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-samples", type=int, default=1, help="completions to draw (printed at the end if > 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 turns it off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 turns it off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 turns it off")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--scheduler", choices=("static", "continuous"), default="static",
                   help="continuous: decode --slots rows at a time, refilling ended rows (prints at the end)")
    p.add_argument("--slots", type=int, default=0, help="continuous: rows decoded at once (0: min(rows, 64))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stream", action="store_true", help="print only when generation ends")
    p.set_defaults(func=_sample)


def _sample(args) -> int:
    from pathlib import Path

    import jax
    import numpy as np

    from rljax import tokenizers
    from rljax.checkpoint import is_run_dir
    from rljax.errors import CheckpointError, DataError
    from rljax.models import load_hf
    from rljax.models.vl_io import is_vl_checkpoint, load_vl
    from rljax.models.vlm import VLConfig, text_params
    from rljax.sampling import SampleControls, stream
    from rljax.storage import copy_locally_hint, is_remote

    if is_remote(args.checkpoint):  # the safetensors reader maps local files
        raise CheckpointError(f"--checkpoint {args.checkpoint} is remote; copy it here first "
                              f"({copy_locally_hint(args.checkpoint)}) and pass the local directory")
    ckpt = Path(args.checkpoint)
    run_dir = not (ckpt / "config.json").is_file() and is_run_dir(ckpt)
    if not run_dir and not (ckpt / "config.json").is_file():
        raise CheckpointError(f"{ckpt} has no config.json (a Hugging Face directory, e.g. written by rljax export) "
                              "and no checkpoints/ (a run directory of rljax train); pass one of those")
    if not args.prompt:
        raise DataError("--prompt is empty; pass the text to continue")
    controls = SampleControls(max_new_tokens=args.max_new_tokens, num_samples=args.num_samples,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              greedy=args.greedy, scheduler=args.scheduler,
                              slots=args.slots)  # checked before the checkpoint loads
    if run_dir:
        cfg, params, tok = _from_run(ckpt, args.step, args.tokenizer)
    else:
        if args.tokenizer is None and not any((ckpt / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise CheckpointError(f"{ckpt} holds no tokenizer (tokenizer.json or tokenizer.model); pass --tokenizer, "
                                  "or re-export the run with rljax export, which writes it beside the weights")
        cfg, params = load_vl(ckpt) if is_vl_checkpoint(ckpt) else load_hf(ckpt)
        tok = tokenizers.load(args.tokenizer or ckpt)
    if args.image:
        return _sample_images(args, cfg, params, tok, controls)
    if isinstance(cfg, VLConfig):  # text only: the decoder alone
        cfg, params = cfg.text, text_params(params)
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = tok.encode(text)
    else:
        ids = tok.encode(args.prompt, add_bos=tok.bos_id is not None)
    if not ids:
        raise DataError("the prompt encodes to no tokens; pass a longer prompt")
    controls = controls.with_tokenizer(tok, extra_eos_ids=cfg.eos_ids)
    chunks = stream(cfg, params, np.asarray([ids], np.int32), key=jax.random.key(args.seed), controls=controls)
    live = args.num_samples == 1 and not args.no_stream and args.scheduler == "static"
    rows = [[] for _ in range(args.num_samples)]
    shown = ""
    for tokens, mask in chunks:
        for row, (t, m) in enumerate(zip(tokens, mask)):
            rows[row].extend(int(x) for x in t[m])
        if live:  # re-decode the whole row so multi-token characters print once complete
            text = tok.decode(rows[0])
            if text.startswith(shown) and not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
    if live:
        sys.stdout.write(tok.decode(rows[0])[len(shown):] + "\n")
        return 0
    for i, row in enumerate(rows):
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(tok.decode(row))
    return 0


def _from_run(run_dir, step: str, tokenizer: str | None):
    """(model config, params, tokenizer) of a run directory's checkpoint `step` ("best": by the
    run's own metric), with `tokenizer` or else the one the run's config names; the pick goes to
    stderr."""
    from rljax import tokenizers
    from rljax.checkpoint import load_params, open_run, tokenizer_spec
    from rljax.errors import CheckpointError

    picked = open_run(run_dir, step)
    spec = tokenizer or tokenizer_spec(picked.config)
    if spec is None:
        raise CheckpointError(f"{run_dir}: its checkpoint holds no run config naming a tokenizer; pass --tokenizer")
    print(f"sampling from {picked.describe()} of {run_dir}", file=sys.stderr)
    cfg, params = load_params(picked.checkpoints, picked.step)
    return cfg, params, tokenizers.load(spec)


IMAGE_MARKER = "<|rljax_image|>"


def _sample_images(args, cfg, params, tok, controls) -> int:
    """`rljax sample --image`: the images (preprocessed as `rljax.data.images`) go before the
    prompt, each as vision_start, its placeholder tokens, vision_end; with --chat inside the user
    turn (the template is rendered with a marker there, and the ids are spliced at it)."""
    import jax
    import numpy as np

    from rljax.data.images import preprocess
    from rljax.sampling.vision import generate_vl, require_vision

    cfg = require_vision(cfg, f"{len(args.image)} image(s)")
    pixels, grids = preprocess(args.image)
    image_ids = []
    for grid in grids:
        image_ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (int(np.prod(grid)) // 4) + \
            [cfg.vision_end_token_id]
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": f"{IMAGE_MARKER} {args.prompt}"}],
                                       add_generation_prompt=True)
        before, after = text.split(IMAGE_MARKER, 1)
        ids = tok.encode(before) + image_ids + tok.encode(after)
    else:
        ids = image_ids + tok.encode(args.prompt)
    controls = controls.with_tokenizer(tok, extra_eos_ids=cfg.text.eos_ids)
    res = jax.device_get(generate_vl(cfg, params, np.asarray([ids], np.int32), None, pixels, grids,
                                     key=jax.random.key(args.seed), controls=controls))
    for i, (row, mask) in enumerate(zip(res.tokens, res.mask)):
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(tok.decode([int(t) for t in row[mask]]))
    return 0
