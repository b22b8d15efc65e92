"""`pdserve bench --url URL`: load any OpenAI-compatible server (pdserve, llama.cpp's
llama-server, vLLM) and report TTFT / ITL / end-to-end percentiles, throughput and goodput.

Load, one of:
  --concurrency N   closed loop: N clients, each sending its next request when its last ended
  --rate R          open loop: Poisson arrivals at R requests/s (seeded)
  --trace FILE      open loop: a Mooncake JSONL trace replayed at its timestamps (sim/trace.py),
                    rescaled by --rate-scale (x as many requests per second) / --time-scale
Every request is a streaming /v1/completions (--endpoint chat: /v1/chat/completions) call,
greedy, ignore_eos (dropped if the server refuses it), max_tokens = the output length. Prompts
are synthesised (pdserve/bench_prompts.py): exact token lengths by the server's /tokenize,
approximate (and marked) without one; a trace's equal hash_ids share text.

The figures are sim/stats.py's (`summarize`), the same the simulator predicts: latency
percentiles over completed requests (linear interpolation, numpy's default), ITL = a request's
mean gap between its first and last token, duration_s = the run's window (first request sent
to last one finished), throughput = output tokens / duration_s, goodput = requests meeting
every SLO given / duration_s. A 429 is counted (rejected_429), never retried; any other failure
(5xx, transport, an error chunk, the client timeout) is an error.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys

from sim.stats import SUMMARY_KEYS, summarize
from sim.trace import read_trace

DEFAULT_DURATION_S = 60.0


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="load an OpenAI-compatible server; latency and goodput",
                       description=__doc__.split("\n\n")[0], allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    a = b.add_argument
    a("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000 (no /v1)")
    a("--model", default="", help="the model id to request (default: the first of /v1/models)")
    a("--endpoint", choices=("completions", "chat"), default="completions",
      help="/v1/completions (default) or /v1/chat/completions (the chat template's tokens "
           "then come on top of the prompt length)")
    mode = b.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop with N clients")
    mode.add_argument("--rate", type=float, help="open loop, Poisson arrivals per second")
    mode.add_argument("--trace", help="open loop, a Mooncake JSONL trace file")
    a("--rate-scale", type=float, default=1.0, help="--trace: requests per second times this "
      "(timestamps divided by it)")
    a("--time-scale", type=float, default=1.0, help="--trace: timestamps times this")
    a("--duration", type=float, default=0.0, help="seconds of load: arrivals stop (open loop) "
      f"or clients stop sending (closed loop) after it (default: the whole trace; else "
      f"{DEFAULT_DURATION_S:.0f} s)")
    a("--num-requests", type=int, default=0, help="send at most N requests (0: no bound)")
    a("--input-tokens", type=int, default=256, help="--rate/--concurrency: prompt tokens")
    a("--output-tokens", type=int, default=64, help="--rate/--concurrency: tokens to generate")
    a("--slo-ttft-ms", type=float, default=0.0, help="goodput: TTFT bound (0: none)")
    a("--slo-itl-ms", type=float, default=0.0, help="goodput: ITL bound (0: none)")
    a("--api-key", default="", help="sent as a Bearer token (default: env OPENAI_API_KEY)")
    a("--timeout", type=float, default=300.0, help="seconds per request, connect to [DONE]")
    a("--warmup", type=int, default=1, help="requests sent (and not counted) before the run")
    a("--seed", type=int, default=0, help="arrivals and prompt text")
    a("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    a("--json", action="store_true", help="print one JSON object instead of the table")
    a("--records", default="", metavar="FILE.jsonl", help="also write every request's record "
      "(ttft_s, itl_s, e2e_s, output_tokens, status, sent_s, http_status, error, ...) there")
    a("--no-progress", action="store_true", help="no progress line on stderr")
    b.set_defaults(func=main)
    return b


def _get_json(base: str, path: str, headers: dict, timeout: float):
    import httpx
    r = httpx.get(base.rstrip("/") + path, headers=headers, timeout=timeout)
    r.raise_for_status()
    return r.json()


def served_model(base: str, headers: dict, timeout: float) -> str:
    data = _get_json(base, "/v1/models", headers, timeout).get("data") or []
    if not data:
        raise SystemExit(f"pdserve bench: {base}/v1/models lists no model; pass --model")
    return data[0]["id"]


def poisson_arrivals(rate: float, duration_s: float, limit: int, seed: int) -> list[float]:
    if not rate > 0:
        raise SystemExit("pdserve bench: --rate must be > 0")
    rng, out, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s or (limit and len(out) >= limit):
            return out
        out.append(t)


def trace_jobs(args, builder):
    """The trace's requests arriving within --duration as jobs (arrival from the first
    record, rescaled) and the arrival window."""
    from .loadgen import Job
    recs = read_trace(args.trace)
    if not recs:
        raise SystemExit(f"pdserve bench: {args.trace} holds no request")
    if not (args.rate_scale > 0 and args.time_scale > 0):
        raise SystemExit("pdserve bench: --rate-scale and --time-scale must be > 0")
    recs = recs[:args.num_requests] if args.num_requests else recs
    t0 = min(r.timestamp_ms for r in recs)
    scale = args.time_scale / args.rate_scale / 1000.0
    at = [(r.timestamp_ms - t0) * scale for r in recs]
    span = math.nextafter(max(at), math.inf)
    duration = min(args.duration, span) if args.duration else span
    jobs = [Job(builder.build(r.hash_ids, r.input_length, i), r.output_length, a)
            for i, (r, a) in enumerate(zip(recs, at)) if a < duration]
    return jobs, duration


def synthetic_jobs(args, builder, count: int, arrivals: list[float] | None):
    from .loadgen import Job
    if args.input_tokens < 1 or args.output_tokens < 1:
        raise SystemExit("pdserve bench: --input-tokens and --output-tokens must be >= 1")
    for i in range(count):
        at = arrivals[i] if arrivals else 0.0
        yield Job(builder.build((), args.input_tokens, i), args.output_tokens, at)


def _closed_deadline(args, duration: float) -> float:
    """The closed loop's deadline: its duration and two request timeouts, or (bounded by
    --num-requests alone) one timeout per request a client sends in turn, and one more."""
    if math.isfinite(duration):
        return duration + 2 * args.timeout
    return (-(-args.num_requests // args.concurrency) + 1) * args.timeout


def load(args, target, builder) -> tuple[list[dict], float, str]:
    """Run the chosen load; (records, window_s, a description of the load)."""
    from .loadgen import Progress, closed_loop, open_loop
    show = not args.no_progress
    if args.concurrency is not None:
        if args.concurrency < 1:
            raise SystemExit("pdserve bench: --concurrency must be >= 1")
        duration = args.duration or (math.inf if args.num_requests else DEFAULT_DURATION_S)
        count = args.num_requests or 10 ** 9
        for i in range(3):         # the real-count checks (bench_prompts) before the clock starts
            builder.build((), args.input_tokens, -1 - i)
        jobs = synthetic_jobs(args, builder, count, None)
        rec, window = asyncio.run(closed_loop(
            target, jobs, concurrency=args.concurrency, duration_s=duration,
            deadline_s=_closed_deadline(args, duration), max_requests=args.num_requests or None,
            progress=Progress(args.num_requests or None, show)))
        return rec, window, f"closed loop, {args.concurrency} clients"
    if args.rate is not None:
        duration = args.duration or DEFAULT_DURATION_S
        arrivals = poisson_arrivals(args.rate, duration, args.num_requests, args.seed)
        jobs = list(synthetic_jobs(args, builder, len(arrivals), arrivals))
        what = f"Poisson {args.rate:g} req/s for {duration:g} s"
    else:
        jobs, duration = trace_jobs(args, builder)
        what = (f"trace {os.path.basename(args.trace)} x{args.rate_scale:g} rate, "
                f"{len(jobs)} requests over {duration:.1f} s")
    rec, window = asyncio.run(open_loop(target, jobs, duration_s=duration,
                                        deadline_s=duration + args.timeout,
                                        progress=Progress(len(jobs), show)))
    return rec, window, what


def warm_up(args, target) -> None:
    """`--warmup` short requests; a 4xx naming ignore_eos drops that field for the run."""
    from .loadgen import Job, client, send

    async def go():
        async with client(target, 2) as http:
            for _ in range(args.warmup):
                r = await send(http, target, Job(" the", 2))
                if r["status"] == "error" and "ignore_eos" in r["error"] and target.ignore_eos:
                    target.ignore_eos = False
                    r = await send(http, target, Job(" the", 2))
                if r["status"] != "ok":
                    print(f"pdserve bench: warm-up request failed: {r['error']}", file=sys.stderr)
    if args.warmup > 0:
        asyncio.run(go())


ROWS = (("requests", "requests sent", ""), ("completed", "completed", ""),
        ("errors", "errors (5xx, transport, timeout)", ""), ("rejected_429", "rejected (429)", ""),
        ("duration_s", "duration", " s"), ("ttft_p50_ms", "TTFT p50", " ms"),
        ("ttft_p90_ms", "TTFT p90", " ms"), ("ttft_p99_ms", "TTFT p99", " ms"),
        ("itl_p50_ms", "ITL p50", " ms"), ("itl_p90_ms", "ITL p90", " ms"),
        ("e2e_p50_ms", "e2e p50", " ms"), ("e2e_p90_ms", "e2e p90", " ms"),
        ("throughput_tok_s", "output throughput", " tok/s"), ("goodput_rps", "goodput", " req/s"),
        ("slo_attainment", "SLO attainment", ""), ("tokens_from_usage", "tokens from usage", ""))


def _num(v) -> str:
    if not isinstance(v, float):
        return str(v)
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 100 else f"{v:.4g}"


def table(summary: dict, run: dict) -> str:
    lines = [f"pdserve bench: {run['url']} model {run['model']} ({run['endpoint']}); "
             f"{run['load']}; prompt lengths {run['prompt_lengths']}"]
    if run["slo"]:
        lines.append(f"SLOs: {run['slo']}")
    lines += ["| metric | value |", "| --- | --- |"]
    for key, label, unit in ROWS:
        v = summary[key]
        cell = "n/a" if v is None else _num(v) + unit
        if key == "tokens_from_usage" and not v:
            cell = "no (counted by stream chunks)"
        lines.append(f"| {label} | {cell} |")
    if run["error_samples"]:
        lines.append("first errors: " + "; ".join(run["error_samples"]))
    return "\n".join(lines)


def measure(args) -> tuple[dict, dict, list[dict]]:
    """One bench run (the parsed `pdserve bench` arguments, see `parse`): (the summary, a
    description of the run, the per-request records). bench/ scripts call it directly."""
    from .bench_prompts import PromptBuilder, ServerTokenizer
    from .loadgen import Target
    key = args.api_key or os.environ.get("OPENAI_API_KEY", "")
    target = Target(args.url.rstrip("/"), "", args.endpoint, key, args.timeout,
                    not args.no_ignore_eos)
    try:
        target.model = args.model or served_model(target.base, target.headers(), args.timeout)
    except Exception as e:  # noqa: BLE001 -- any failure to reach the server ends the run
        raise SystemExit(f"pdserve bench: cannot read {target.base}/v1/models: {e}")
    tok = ServerTokenizer(target.base, target.model, target.headers(), args.timeout)
    try:
        builder = PromptBuilder(tok.count, args.seed)
        exact = builder.calibrate()
        warm_up(args, target)
        records, window, what = load(args, target, builder)
    finally:
        tok.close()
    summary = summarize(records, window, args.slo_ttft_ms or None, args.slo_itl_ms or None)
    slo = ", ".join(s for s in (args.slo_ttft_ms and f"TTFT <= {args.slo_ttft_ms:g} ms",
                                args.slo_itl_ms and f"ITL <= {args.slo_itl_ms:g} ms") if s)
    run = {"url": target.base, "model": target.model, "endpoint": args.endpoint, "load": what,
           "prompt_lengths": "exact (server /tokenize)" if exact else
           "approximate (no /tokenize: words x tokens per word)", "prompt_tokens_exact": exact,
           "ignore_eos": target.ignore_eos, "slo": slo,
           "error_samples": sorted({r["error"] for r in records if r["error"]})[:3]}
    return summary, run, records


def parse(argv: list[str]) -> argparse.Namespace:
    """`pdserve bench` arguments (without the word bench) as `measure` takes them."""
    p = argparse.ArgumentParser(prog="pdserve", allow_abbrev=False)
    add_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["bench", *argv])


def main(args) -> int:
    summary, run, records = measure(args)
    if args.records:
        with open(args.records, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    if args.json:
        print(json.dumps({**{k: summary[k] for k in SUMMARY_KEYS}, "run": run}))
    else:
        print(table(summary, run))
    return 0
