"""The `pdserve profile` command: measure what the simulator charges on THIS machine, or
refresh a profile from a running pdserve's metrics.

    pdserve profile --model M [engine options] --out FILE.json [--quick]
        the engine in this process (pdserve/profile_measure.py says how each cost is timed):
        prefill step time against chunk tokens and cached-prefix length, decode step time
        against batch size and total context, the KV handover against prompt length, the
        gateway's per-request prompt preparation, and the KV capacity (blocks) the options
        give one worker. Prefill (and the handover's gathers) run with the prefill threads,
        decode with the decode threads: by default the ones `pdserve up --prefill 1
        --decode 1` gives its workers on this machine (UpConfig.threads).
    pdserve profile --from-url URL --out FILE.json [--base OLD.json] [--window-s S]
        pdserve/profile_live.py: the decode and prefill points from the workers' live step
        metrics (two scrapes of the gateway's /metrics S seconds apart), the rest from --base.

The file is sim.profile.Profile's JSON (schema pdserve.profile/1).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from engine.config import EngineOptions
from services.cli_args import config_from_args, dataclass_args
from sim.profile import SCHEMA, Profile

from .profile_report import pdserve_version, print_summary

# (chunk tokens, cached-prefix tokens, decode batch sizes, context per sequence, handover
# prompt lengths, repeats): the full grid, and --quick's for tests
GRIDS = {
    "full": dict(chunks=(16, 64, 256, 1024, 2048), cached=(0, 1024), cached_chunks=(64, 512),
                 batches=(1, 4, 16, 64), contexts=(128, 1024), handover=(128, 512, 2048),
                 repeat=3, decode_steps=5),
    "quick": dict(chunks=(16, 32, 64), cached=(0, 32), cached_chunks=(16, 64),
                  batches=(1, 2, 4), contexts=(16, 64), handover=(32, 128), repeat=1,
                  decode_steps=3),
}


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure the step costs the planner's simulator uses",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    p.add_argument("--model", default="", help="HF model directory or .gguf file (empty: the "
                   "default model, SmolLM2-135M-Instruct, as `pdserve up` resolves it)")
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--quick", action="store_true", help="a small grid, one run per point (tests, "
                   "a first look): seconds on the tiny model")
    p.add_argument("--repeat", type=int, default=0, help="runs per point, the median kept "
                   "(0: 3, or 1 with --quick)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of both roles, as "
                   "the workers' --threads (0: what `pdserve up --prefill 1 --decode 1` gives "
                   "each role here)")
    p.add_argument("--prefill-threads", type=int, default=0, help="the prefill role's threads "
                   "(0: --threads, else up's share)")
    p.add_argument("--decode-threads", type=int, default=0, help="the decode role's threads "
                   "(0: --threads, else up's share)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--from-url", default="", help="refresh from a running pdserve instead: "
                   "its gateway's HTTP address (http://HOST:PORT, /metrics is read)")
    p.add_argument("--base", default="", help="with --from-url: the profile whose handover, "
                   "gateway, KV and machine parts are kept (its prefill/decode points outside "
                   "the live range too)")
    p.add_argument("--window-s", type=float, default=60.0, help="with --from-url: seconds "
                   "between the two scrapes whose difference is used (0: one scrape, "
                   "everything since the workers started, warm-up included)")
    p.add_argument("--min-steps", type=int, default=3, help="with --from-url: steps a live "
                   "bucket needs to become a point")
    dataclass_args(p, EngineOptions)
    p.set_defaults(func=main)


def role_threads(args) -> tuple[int, int]:
    """(prefill, decode) torch threads: the options, else `pdserve up`'s 1P1D share."""
    from .up import UpConfig
    up_p, up_d = UpConfig(prefill=1, decode=1).threads()
    base_p, base_d = (args.threads, args.threads) if args.threads > 0 else (up_p, up_d)
    return args.prefill_threads or base_p, args.decode_threads or base_d


def machine_info(prefill_threads: int, decode_threads: int) -> dict:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = list(range(os.cpu_count() or 1))
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "affinity": affinity,
            "threads": {"prefill": prefill_threads, "decode": decode_threads},
            "load_avg_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__,   # at the end
            "python": platform.python_version(), "host": platform.node()}


def main(args) -> int:
    if args.from_url:
        from .profile_live import refresh
        return refresh(args)
    try:
        options = config_from_args(EngineOptions, args)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"pdserve profile: {e}")
    prof = measure(args, options)
    prof.save(args.out)
    print_summary(prof, sys.stdout)
    print(f"wrote {args.out}")
    return 0


def _model_path(args) -> str:
    if args.model:
        return args.model
    from .default_model import resolve_default_model
    return str(resolve_default_model())


def measure(args, options: EngineOptions) -> Profile:
    import torch
    from engine.llm_engine import LLMEngine
    from . import profile_measure as pm
    grid = dict(GRIDS["quick" if args.quick else "full"])
    repeat = args.repeat or grid["repeat"]
    p_threads, d_threads = role_threads(args)
    model = _model_path(args)
    t_start, load_start = time.time(), round(os.getloadavg()[0], 2)
    clock = pm.StepClock()
    torch.set_num_threads(p_threads)
    engine = LLMEngine.from_model_dir(model, options, step_observers=[clock])
    plan = _plan(grid, engine)
    progress = pm.Progress(repeat * len(plan["prefill"]) + len(plan["decode"]) + len(plan["handover"]) + 1,
                           sys.stderr)
    m = pm.Measurer(engine, clock, repeat, progress, args.seed)
    phases, t = {}, time.perf_counter()

    def lap(name):
        nonlocal t
        phases[name] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
    m.warm_up(max(c for c, _ in plan["prefill"]), max(b for b, _ in plan["decode"]))
    lap("warm_up")
    prefill = m.prefill_points(plan["prefill"])
    lap("prefill")
    handover, transport = pm.handover_points(engine, plan["handover"], repeat, progress)
    lap("handover")
    torch.set_num_threads(d_threads)
    decode = [m.decode_point(b, ctx, max(repeat, grid["decode_steps"])) for b, ctx in plan["decode"]]
    lap("decode")
    gateway_s = pm.gateway_seconds(engine.tokenizer, max(repeat, 5)) if engine.tokenizer else 0.0
    progress.tick("gateway")
    lap("gateway")
    return Profile(
        schema=SCHEMA, pdserve_version=pdserve_version(), created_unix=round(t_start, 3),
        machine={**machine_info(p_threads, d_threads), "load_avg_1m_start": load_start},
        model=_model_info(engine, model),
        options=_options_info(engine, options, p_threads, d_threads, transport, phases, repeat),
        prefill=prefill, decode=decode, handover=handover, gateway_s=gateway_s,
        kv={"block_size": engine.kv.block_size, "num_blocks": engine.num_blocks},
        threads=p_threads)


def _plan(grid: dict, engine) -> dict:
    """The points this engine can take: chunks within the step budget, contexts within the
    model's length and the cache, batches within max_num_seqs."""
    sc, bs = engine.config.scheduler, engine.kv.block_size
    max_len = engine.config.model.max_model_len
    cap_tokens = engine.num_blocks * bs // 2            # room left for the prefix cache's churn
    prefill = [(n, c) for c in grid["cached"] for n in (grid["chunks"] if c == 0 else grid["cached_chunks"])
               if n <= sc.max_num_batched_tokens and c + n < min(max_len, cap_tokens) and c % bs == 0]
    decode = [(b, ctx) for ctx in grid["contexts"] for b in grid["batches"]
              if b <= sc.max_num_seqs and ctx + grid["decode_steps"] + 8 < max_len
              and ctx + b * (2 * bs + grid["decode_steps"] + 8) < cap_tokens]
    handover = [n for n in grid["handover"] if n < max_len and n <= cap_tokens]
    if not prefill or not decode:
        raise SystemExit("pdserve profile: the options leave no point to measure (a step budget, "
                         "context or KV cache this small?)")
    return {"prefill": prefill, "decode": decode, "handover": handover or [bs]}


def _model_info(engine, path: str) -> dict:
    mc = engine.config.model
    return {"path": path, "id": mc.name, "architecture": mc.architecture, "layers": mc.num_layers,
            "quantization": engine.config.quantization, "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_dtype": str(engine.config.kv_torch_dtype).removeprefix("torch."),
            "max_model_len": mc.max_model_len, "vocab_size": mc.vocab_size}


def _options_info(engine, options, p_threads, d_threads, transport, phases, repeat) -> dict:
    sc, cc = engine.config.scheduler, engine.config.cache
    return {"threads": p_threads, "prefill_threads": p_threads, "decode_threads": d_threads,
            "block_size": cc.block_size, "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "enable_prefix_caching": cc.enable_prefix_caching,
            "kv_cache_memory_gb": cc.kv_cache_memory_gb, "device": options.device,
            "kernel_backend": engine.config.kernel_backend, "repeat": repeat,
            "profile_seconds": round(sum(phases.values()), 1), "phase_seconds": phases,
            "methods": {"prefill": "in-process engine, one step per point (step observer)",
                        "decode": "in-process engine, median of timed decode steps",
                        "handover": f"kvtransfer KVSender->KVReceiver over {transport}, all "
                                    "layers back to back (upper bound: no compute overlap)",
                        "gateway": "gateway.prompt.chat_prompt_ids on a ~500-token chat "
                                   "message (template + tokenize; routing not included)"}}
