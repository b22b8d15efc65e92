"""Config dataclass -> command-line options, so a role's CLI and its config never drift apart.

`dataclass_args` adds one `--field-name` option per field (nested config dataclasses add
their fields too, flattened); `config_from_args` builds the dataclass back from the parsed
options. `pdserve gateway|prefill|decode|up` and `python -m prefill_worker.server` all use it.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
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


def config_from_argv(cls, argv: list[str] | None, description: str):
    """Build a worker's config from the command line (`python -m prefill_worker.server`);
    the options are the ones `pdserve prefill|decode` has."""
    p = argparse.ArgumentParser(description=description)
    dataclass_args(p, cls)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return config_from_args(cls, args)
