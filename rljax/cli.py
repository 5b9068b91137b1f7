"""The `rljax` command line: a thin layer over the functional API.

Each subcommand lives beside the concern it drives, in a module with
`register(subparsers)` that adds its parser and sets `func`. Heavy imports stay inside the
command functions so `rljax --help` is instant. Every command runs quiet (`rljax.quiet`: library
notices a user cannot act on are dropped) unless `--verbose` stands anywhere on the line.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rljax.errors import RljaxError
from rljax.quiet import quiet

# One line per subcommand module, in the order `rljax --help` lists them.
_COMMAND_MODULES = [
    "rljax.train.command",
    "rljax.plan.command",
    "rljax.models.command",
    "rljax.sampling.command",
]
# Subcommands that set the environment before jax is first imported (building the parser imports
# it): name -> module with `prepare(argv)`. `rljax plan` sets the simulated device count.
_PREPARE = {"plan": "rljax.plan.command"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rljax", description="JAX-native reinforcement learning for language models that reason.")
    parser.add_argument("--verbose", action="store_true",
                        help="keep library notices that are dropped by default (orbax's read-only warnings, "
                             "XLA's rematerialisation notices); may stand anywhere on the line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = "--verbose" in argv
    argv = [word for word in argv if word != "--verbose"]  # a global flag, accepted after the command too
    if verbose:
        return _main(argv)
    undo = quiet()
    try:
        return _main(argv)
    finally:
        undo()


def _main(argv: list[str]) -> int:
    if argv and argv[0] in _PREPARE and "jax" not in sys.modules:
        importlib.import_module(_PREPARE[argv[0]]).prepare(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a `nargs="*"` positional at the first option, so `a=1 --resume b=2` would leave
    # b=2 unparsed: key=value words after an option are overrides too, wherever they stand.
    if extra and isinstance(getattr(args, "overrides", None), list) \
            and all("=" in word and not word.startswith("-") for word in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except RljaxError as err:
        print(f"rljax {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rljax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
