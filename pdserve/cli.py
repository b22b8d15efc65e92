"""The `pdserve` command. Subcommands: make-tiny-model, up, gateway, prefill, decode, eval, bench,
profile, plan, planner.

Each role's options are generated from its typed config dataclass
(`services.cli_args.dataclass_args`), so the CLI and the config never drift apart. A role's
server module (which may import torch) is imported only when that role runs.
"""
from __future__ import annotations

import argparse
import os
import sys

from decode_worker.config import DecodeWorkerConfig
from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS
from gateway.config import GatewayConfig
from prefill_worker.config import PrefillWorkerConfig
from services.cli_args import add_role_args, config_from_args, dataclass_args, role_config

from . import bench as bench_command
from . import profile as profile_command
from . import up as up_command
from .processes import die_with_parent


def _make_tiny_model(args) -> int:
    from engine.tiny_model import make_tiny_model
    size = {"vocab_size": args.vocab_size} if args.vocab_size else {}
    path = make_tiny_model(args.dir, seed=args.seed, **size)
    print(path)
    return 0


def _run_gateway(cfg: GatewayConfig) -> int:
    from gateway.auth import API_KEY_ENV
    cfg.api_key = cfg.api_key or os.environ.get(API_KEY_ENV, "")   # a key kept out of `ps`
    if not cfg.model and not cfg.models_file:   # the default model, as `pdserve up` resolves it
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


def _run_eval(args) -> int:
    from . import eval as evaluation
    return evaluation.main(args)


def _run_up(args) -> int:
    try:
        cfg = config_from_args(up_command.UpConfig, args)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"pdserve up: {e}")
    if cfg.autoscale:                      # the simulator: only when it is asked for
        from .autoscale_up import UpAutoscaler
        return up_command.main(cfg, UpAutoscaler)
    return up_command.main(cfg)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("--parent-pid", type=int, default=0, help="`pdserve up` sets it for the "
                   "processes it starts: the launcher's pid; this process gets SIGTERM when "
                   "that one dies (0: none)")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("make-tiny-model", help="write the tiny random Llama model used by default",
                       allow_abbrev=False)
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--vocab-size", type=int, default=0,
                   help="tokens in the vocabulary (0: the default model's, 1024)")
    t.set_defaults(func=_make_tiny_model)
    for role, (help_, cls, runner) in ROLES.items():
        r = sub.add_parser(role, help=help_, allow_abbrev=False)
        add_role_args(r, cls)
        r.set_defaults(func=lambda args, cls=cls, runner=runner: runner(role_config(cls, args)))
    up = sub.add_parser("up", help="run gateway + N prefill + M decode workers locally",
                        allow_abbrev=False)
    dataclass_args(up, up_command.UpConfig)
    up.set_defaults(func=_run_up)
    profile_command.add_parser(sub)
    ev = sub.add_parser("eval", help="accuracy checks on your own data",
                        allow_abbrev=False).add_subparsers(
        dest="check", required=True)
    pp = ev.add_parser("perplexity", help="perplexity of a text file (sliding windows)",
                       allow_abbrev=False)
    pp.add_argument("--model", default="", help="model directory or .gguf file (with --url: "
                    "not needed; given, only its tokenizer is used)")
    pp.add_argument("--data", required=True, help="a UTF-8 text file")
    pp.add_argument("--context", type=int, default=1024, help="tokens per window")
    pp.add_argument("--stride", type=int, default=0, help="tokens between windows (0: context/2)")
    pp.add_argument("--limit", type=int, default=0, help="score only the first N tokens (0: all)")
    pp.add_argument("--url", default="", help="a running server (http://host:port): score "
                    "through its /v1/completions (echo + logprobs) instead of a local engine")
    pp.add_argument("--served-model-name", default="", help="with --url: the model id "
                    "(default: the first of /v1/models)")
    pp.add_argument("--device", default="cpu", help="local engine's torch device")
    pp.add_argument("--dtype", default="auto", help="local engine's dtype")
    pp.add_argument("--quantization", nargs="+", choices=QUANTIZATIONS, help="weight variants to "
                    "compare: one table with perplexity, greedy agreement, memory and decode "
                    "speed against the unquantized model (local engine only)")
    pp.add_argument("--kv-cache-dtype", nargs="+", choices=KV_CACHE_DTYPES,
                    help="KV cache variants, crossed with --quantization")
    pp.set_defaults(func=_run_eval)
    bench_command.add_parser(sub)
    from .planner_k8s import add_parser as planner_parser
    planner_parser(sub)
    from .plan_cli import LENGTHS_HELP, add_arguments as plan_arguments
    plan_arguments(sub.add_parser("plan", allow_abbrev=False, help="size a deployment: "
                                  "P and D counts and settings for TTFT/ITL SLOs, simulated",
                                  description="Search prefill/decode counts and per-worker "
                                  f"settings with the simulator. Lengths: {LENGTHS_HELP}."))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    die_with_parent(args.parent_pid)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
