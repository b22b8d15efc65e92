"""The `pdserve` command. Subcommands: make-tiny-model, up, gateway, prefill, decode.

Each role's options are generated from its typed config dataclass
(`services.cli_args.dataclass_args`), so the CLI and the config never drift apart. A role's
server module (which may import torch) is imported only when that role runs.
"""
from __future__ import annotations

import argparse
import sys

from decode_worker.config import DecodeWorkerConfig
from gateway.config import GatewayConfig
from prefill_worker.config import PrefillWorkerConfig
from services.cli_args import add_role_args, config_from_args, dataclass_args, role_config

from . import launcher


def _make_tiny_model(args) -> int:
    from engine.tiny_model import make_tiny_model
    path = make_tiny_model(args.dir, seed=args.seed)
    print(path)
    return 0


def _run_gateway(cfg: GatewayConfig) -> int:
    if not cfg.model:                       # the default model, as `pdserve up` resolves it
        from .default_model import resolve_default_model
        cfg.model = str(resolve_default_model())
    from gateway import grpc_server
    return grpc_server.run(cfg) or 0


def _run_prefill(cfg: PrefillWorkerConfig) -> int:
    from prefill_worker.server import ROLE
    from services.worker_server import run
    return run(cfg, ROLE) or 0


def _run_decode(cfg: DecodeWorkerConfig) -> int:
    from decode_worker.server import ROLE
    from services.worker_server import run
    return run(cfg, ROLE) or 0


ROLES = {  # subcommand -> (help, config class, runner)
    "gateway": ("the public gRPC (and REST) gateway", GatewayConfig, _run_gateway),
    "prefill": ("a prefill worker", PrefillWorkerConfig, _run_prefill),
    "decode": ("a decode worker", DecodeWorkerConfig, _run_decode),
}


def _run_up(args) -> int:
    try:
        cfg = config_from_args(launcher.UpConfig, args)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"pdserve up: {e}")
    return launcher.main(cfg)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("make-tiny-model", help="write the tiny random Llama model used by default")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_make_tiny_model)
    for role, (help_, cls, runner) in ROLES.items():
        r = sub.add_parser(role, help=help_)
        add_role_args(r, cls)
        r.set_defaults(func=lambda args, cls=cls, runner=runner: runner(role_config(cls, args)))
    up = sub.add_parser("up", help="run gateway + N prefill + M decode workers locally")
    dataclass_args(up, launcher.UpConfig)
    up.set_defaults(func=_run_up)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
