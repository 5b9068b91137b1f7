"""`rljax inspect`: load a HF checkpoint, print its config and size, optionally re-export it."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("inspect", help="load a Hugging Face checkpoint and print its config and size")
    p.add_argument("checkpoint", help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--export", metavar="DIR", help="also write it back out as a HF directory")
    p.set_defaults(func=_inspect)


def _inspect(args) -> int:
    import dataclasses

    import jax

    from rljax.models import load_hf, save_hf

    cfg, params = load_hf(args.checkpoint)
    n = sum(x.size for x in jax.tree.leaves(params))
    for field in dataclasses.fields(cfg):
        print(f"{field.name:28s} {getattr(cfg, field.name)}")
    print(f"{'parameters':28s} {n:,}")
    if args.export:
        print(f"exported to {save_hf(cfg, params, args.export)}")
    return 0
