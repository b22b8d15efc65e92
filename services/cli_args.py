"""Config dataclass <-> command-line options, so a role's CLI and its config never drift apart.

`dataclass_args` adds one `--field-name` option per field. A field whose type is itself a
config dataclass (a worker's `engine: EngineOptions`, which nests `cache` and `scheduler`)
adds its fields the same way, flattened: `--block-size`, not `--engine-cache-block-size`, so
every option name must be unique across the tree (argparse rejects a clash when the parser is
built). `config_from_args` builds the dataclass tree back from the parsed options;
`config_argv` writes a config's non-default values as options again (the launcher passes
`pdserve up`'s engine options to each worker that way). `pdserve gateway|prefill|decode|up`
and `python -m prefill_worker.server` all use them.

Per-field metadata: "help"; "aliases" (other option names, e.g. `--model` for `--model-dir`);
"cli": False keeps a field off the command line (it takes its default).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import typing


def _options(cls):
    """(field, its type without Optional) for each field of `cls` on the command line."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        yield f, base


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    """Add one `--field-name` option per field of a dataclass (bool -> --x/--no-x), nested
    config dataclasses flattened. A field without a default is a required option."""
    for f, base in _options(cls):
        if dataclasses.is_dataclass(base):
            dataclass_args(parser, base)
            continue
        names = [_flag(f), *f.metadata.get("aliases", ())]
        default = _default(f)
        required = default is dataclasses.MISSING
        default = None if required else default
        help_ = f.metadata.get("help", "") + ("" if required else f" (default: {default})")
        if base is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_)
        else:
            parser.add_argument(*names, dest=f.name, type=base if base in (int, float, str) else str,
                                default=default, required=required, help=help_)


def config_from_args(cls, args: argparse.Namespace):
    """The dataclass (nested ones included) built from options parsed by `dataclass_args`
    (ValueError on bad values, raised by the dataclass that checks them)."""
    return cls(**{f.name: config_from_args(base, args) if dataclasses.is_dataclass(base)
                  else getattr(args, f.name) for f, base in _options(cls)})


def config_argv(config) -> list[str]:
    """The options that rebuild `config` through `dataclass_args` + `config_from_args`: one
    per field whose value is not its default (nested dataclasses flattened)."""
    argv = []
    for f, base in _options(type(config)):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(base):
            argv += config_argv(value)
        elif value != _default(f):
            if value is None:
                raise ValueError(f"{f.name}=None cannot be written as an option")
            if base is bool:
                argv.append(_flag(f) if value else "--no-" + _flag(f)[2:])
            else:
                argv += [_flag(f), str(value)]
    return argv


def check_ports(**ports: int) -> None:
    """Every port option means the same: a port number, 0 for off (an optional listener:
    --http-port, --metrics-port, --health-port) or any free port (one that cannot be off:
    --grpc-port, --port). ValueError naming the option otherwise; -1 (the old "off" of
    `pdserve up --http-port`) says what to give instead."""
    for name, port in ports.items():
        flag = "--" + name.replace("_", "-")
        if port == -1:
            raise ValueError(f"{flag} -1: give 0 for off (-1 no longer means off)")
        if not 0 <= port < 65536:
            raise ValueError(f"{flag} must be a port in 0-65535 (0: off or any free), got {port}")


def add_role_args(parser: argparse.ArgumentParser, cls) -> None:
    """A server role's options: its config's, and --log-level."""
    dataclass_args(parser, cls)
    parser.add_argument("--log-level", default="INFO")


def role_config(cls, args: argparse.Namespace):
    """Set up logging and build the role's config from options parsed by `add_role_args`;
    a bad value exits with a one-line message naming it."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return config_from_args(cls, args)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"pdserve: bad configuration: {e}")


def config_from_argv(cls, argv: list[str] | None, description: str):
    """A worker's config from the command line (`python -m prefill_worker.server`): the
    options `pdserve prefill|decode` has."""
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    add_role_args(p, cls)
    return role_config(cls, p.parse_args(argv))
