"""`rljax inspect` (load a HF checkpoint, print its config and size, optionally re-export it) and
`rljax convert` (a GGUF file, or a packaged model's name, into a Hugging Face directory)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("inspect", help="load a Hugging Face checkpoint and print its config and size")
    p.add_argument("checkpoint", help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--export", metavar="DIR", help="also write it back out as a HF directory")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("convert", help="write a GGUF model (dequantised to f32) as a Hugging Face directory")
    p.add_argument("gguf", help="a .gguf file, or a packaged model's name (smollm2-135m-instruct)")
    p.add_argument("out_dir", help="directory to write: config.json, model.safetensors, tokenizer files")
    p.set_defaults(func=_convert)


def _inspect(args) -> int:
    import dataclasses

    import jax

    from rljax.models import load_hf, save_hf

    cfg, params = load_hf(args.checkpoint)
    n = sum(x.size for x in jax.tree.leaves(params))
    for field in dataclasses.fields(cfg):
        print(f"{field.name:28s} {getattr(cfg, field.name)}")
    print(f"{'parameters':28s} {n:,}")
    if cfg.moe is not None:  # a token uses top_k of the experts: the active share of the parameters
        print(f"{'experts':28s} {cfg.moe.num_experts} per layer, {cfg.moe.top_k} active per token")
        if cfg.moe.dense_layers:  # Qwen's mlp_only_layers / decoder_sparse_step (`rljax.models.mlp_kinds`)
            print(f"{'dense MLP layers':28s} {list(cfg.moe.dense_layers)} of {cfg.num_layers}")
        print(f"{'active parameters':28s} {n - (cfg.num_params() - cfg.num_active_params()):,}")
    if args.export:
        print(f"exported to {save_hf(cfg, params, args.export)}")
    return 0


def _convert(args) -> int:
    import jax

    from rljax.errors import CheckpointError
    from rljax.models import is_gguf, load_gguf, resolve_checkpoint, save_hf
    from rljax.tokenizers import gguf_tokenizer

    path = resolve_checkpoint(args.gguf)
    if not is_gguf(path):
        raise CheckpointError(f"{args.gguf!r} is not a .gguf file or a packaged model's name; pass a GGUF file")
    cfg, params = load_gguf(path)
    tokenizer = gguf_tokenizer(path)
    out = save_hf(cfg, params, args.out_dir)
    written = tokenizer.save(out)
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"converted {path} ({cfg.model_type}, {n / 1e6:.1f}M params, f32) to {out}: config.json, "
          f"model.safetensors, {', '.join(written)}")
    return 0
