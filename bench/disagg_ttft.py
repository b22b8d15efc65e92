"""TTFT and output tokens/s: disaggregated (gateway -> P -> UCX -> D) vs one engine doing both.

    python bench/disagg_ttft.py [--model DIR] [--requests 128] [--concurrency 16]
                                [--prompt-len 96] [--output-len 64] [--device cpu]

Both sides get the same prompts (random token ids, fixed seed), greedy sampling, ignore_eos,
the same concurrency. The disaggregated side is `pdserve up` (1 prefill + 1 decode worker +
gateway, separate processes, one torch thread each) driven over gRPC; the baseline is an
in-process `engine.AsyncEngine` with one torch thread. Each side gets one warm-up request
first. Prints a markdown table with the ratio disaggregated / single.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def run_load(one, prompts, concurrency: int) -> dict:
    """one(prompt) -> (ttft_s, n_tokens); returns the metrics of the whole run."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(p):
        async with sem:
            return await one(p)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(bounded(p) for p in prompts))
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    return {"ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
            "out_tok_s": sum(r[1] for r in results) / wall, "wall_s": wall}


async def bench_disagg(model: str, prompts, args) -> dict:
    import grpc
    from pdserve.launcher import Launcher
    from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    worker_args = ["--device", args.device]
    launcher = Launcher(model, 1, 1, log_dir=Path(tempfile.mkdtemp(prefix="disagg-bench-")),
                        prefill_args=worker_args, decode_args=worker_args)
    await asyncio.to_thread(launcher.start, 180.0)
    try:
        async with grpc.aio.insecure_channel(launcher.grpc_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)

            async def one(ids):
                req = generation_pb2.GenerateRequest(
                    token_ids=common_pb2.TokenIds(ids=ids),
                    sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                                       ignore_eos=True),
                    stream_options=generation_pb2.StreamOptions(stream=True))
                t0, ttft, n = time.perf_counter(), None, 0
                async for msg in stub.Generate(req, timeout=120):
                    if ttft is None and msg.token_ids:
                        ttft = time.perf_counter() - t0
                    n += len(msg.token_ids)
                return ttft, n
            await one(prompts[0][:8])
            return await run_load(one, prompts, args.concurrency)
    finally:
        await asyncio.to_thread(launcher.stop)


async def bench_single(model: str, prompts, args) -> dict:
    import torch
    from engine import LLMEngine, SamplingParams
    from engine.async_engine import AsyncEngine

    torch.set_num_threads(1)
    ae = AsyncEngine(LLMEngine.from_model_dir(model, device=args.device))
    ae.start()
    counter = iter(range(10**9))
    try:
        async def one(ids):
            rid = f"b{next(counter)}"
            t0, ttft, n = time.perf_counter(), None, 0
            await ae.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                                          ignore_eos=True))
            async for out in ae.stream(rid):
                if ttft is None and out.new_token_ids:
                    ttft = time.perf_counter() - t0
                n += len(out.new_token_ids)
            return ttft, n
        await one(prompts[0][:8])
        return await run_load(one, prompts, args.concurrency)
    finally:
        await ae.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.model:
        model = args.model
    else:
        from engine.tiny_model import ensure_default_model
        model = str(ensure_default_model())
    import json
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    # lengths spread around --prompt-len; random ids so no two prompts share a prefix
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.prompt_len // 2,
                                                                   args.prompt_len * 3 // 2))]
               for _ in range(args.requests)]
    disagg = asyncio.run(bench_disagg(model, prompts, args))
    single = asyncio.run(bench_single(model, prompts, args))
    print(f"\n{args.requests} requests, concurrency {args.concurrency}, prompt "
          f"{args.prompt_len // 2}-{args.prompt_len * 3 // 2} tokens, output {args.output_len} "
          f"tokens, greedy, model {Path(model).name}, device {args.device}\n")
    print("| metric | disaggregated (gateway->P->UCX->D) | single engine (in-process) | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for key, label in (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"),
                       ("out_tok_s", "output tokens/s"), ("wall_s", "wall time (s)")):
        a, b = disagg[key], single[key]
        print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
