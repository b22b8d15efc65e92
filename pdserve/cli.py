"""The `pdserve` command. Subcommands: make-tiny-model, up, gateway, prefill, decode.

Each role's options are generated from its typed config dataclass (see `dataclass_args`), so
the CLI and the config never drift apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing


def dataclass_args(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    """Add one `--field-name` option per field of a dataclass (bool -> --x/--no-x). A field
    without a default is a required option; `metadata={"aliases": [...]}` adds other names."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        names = ["--" + prefix + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory())
        kind = hints[f.name]
        args = typing.get_args(kind)
        base = next((a for a in args if a is not type(None)), kind) if args else kind
        help_ = f.metadata.get("help", "") + ("" if required else f" (default: {default})")
        if base is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_)
        else:
            parser.add_argument(*names, dest=f.name, type=base if base in (int, float, str) else str,
                                default=default, required=required, help=help_)


def config_from_args(cls, args: argparse.Namespace):
    """The dataclass built from options parsed by `dataclass_args` (ValueError on bad values)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.metadata.get("cli") is not False})


def _make_tiny_model(args) -> int:
    from engine.tiny_model import make_tiny_model
    path = make_tiny_model(args.dir, seed=args.seed)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("make-tiny-model", help="write the tiny random Llama model used by default")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_make_tiny_model)
    # roles register themselves here (see pdserve/roles.py)
    try:
        from . import roles
    except ImportError:
        roles = None
    if roles is not None:
        roles.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
