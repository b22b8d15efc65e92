"""`pdserve gateway | prefill | decode | up`: one role per process, options from its config.

Each role's module is imported when its subcommand is built; a role whose package is not
there (yet) gets a subcommand that says so instead of breaking the whole CLI.
"""
from __future__ import annotations

import importlib
import logging

from .cli import config_from_args, dataclass_args

# role -> (config module, config class, server module)
ROLES = {
    "gateway": ("gateway.config", "GatewayConfig", "gateway.grpc_server"),
    "prefill": ("prefill_worker.config", "PrefillWorkerConfig", "prefill_worker.server"),
    "decode": ("decode_worker.config", "DecodeWorkerConfig", "decode_worker.server"),
}
_HELP = {"gateway": "the public gRPC (and REST) gateway", "prefill": "a prefill worker",
         "decode": "a decode worker"}


def register(sub) -> None:
    for role, (cfg_mod, cfg_cls, server_mod) in ROLES.items():
        p = sub.add_parser(role, help=_HELP[role])
        try:
            cls = getattr(importlib.import_module(cfg_mod), cfg_cls)
        except (ImportError, AttributeError) as e:
            p.set_defaults(func=lambda args, e=e, role=role: _missing(role, e))
            continue
        dataclass_args(p, cls)
        p.add_argument("--log-level", default="INFO")
        p.set_defaults(func=lambda args, cls=cls, server_mod=server_mod: _run_role(args, cls, server_mod))
    up = sub.add_parser("up", help="run gateway + N prefill + M decode workers locally")
    from .launcher import add_up_args, main as up_main
    add_up_args(up)
    up.set_defaults(func=up_main)


def _run_role(args, cls, server_mod: str) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(cls, args)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"pdserve: bad configuration: {e}")
    return importlib.import_module(server_mod).run(cfg) or 0


def _missing(role: str, e: Exception) -> int:
    raise SystemExit(f"pdserve {role}: not available in this build ({e})")
