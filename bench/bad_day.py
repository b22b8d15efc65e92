"""The bad day on the real default model: overload, a burst, and workers killed under load,
against `pdserve up`'s own supervisor, with what each client saw counted.

    python bench/bad_day.py [--model FILE.gguf] [--prefill 2] [--decode 2] [--overload-s 60]
                            [--cases capacity,overload,burst,kill-prefill,kill-decode]

The system is started as `pdserve up` starts it (its threads per role, the internal token,
the supervisor). Cases (one system, in order; every KV block must be back after each):
    capacity      closed loop of --capacity-streams (16) for --capacity-s: the completion rate
                  it sustains
    overload 3x   open-loop Poisson at 3x that rate for --overload-s
    burst         100 short streams at once
    kill prefill  24 long prompts sent together, the busiest prefill worker SIGKILLed 1 s later
    kill decode   40 streams, the busiest decode worker SIGKILLed once every stream has tokens
                  (or ended: a refused one)

Every request is a streaming /v1/chat/completions (greedy, ~100-token prompts cut from the
GPL-3 text; long prompts ~1,000 tokens). A request ends as: completed (a final chunk and
[DONE]), 429 (with or without Retry-After), 5xx or another status before any byte, or
"failed after 200": an error chunk or a cut stream after the client had its 200. Migrated is
the gateway's count of KV fallbacks "migrate" (pdserve:kv_transfer_fallbacks_total) during the
case; leaked is the number of KV blocks not back in the pools 30 s after the case ended.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.real_model import TEXT, pct  # noqa: E402
from pdserve.launcher import Launcher, free_port  # noqa: E402

CASES = ("capacity", "overload", "burst", "kill-prefill", "kill-decode")


def make_prompts(model: str, n: int, tokens: int, seed: int) -> list[str]:
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model)
    ids = tok.encode(TEXT.read_text(), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = rng.randrange(0, len(ids) - tokens)
        out.append("Summarize in one sentence: " + tok.decode(ids[i:i + tokens]))
    return out


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
              started: asyncio.Event | None = None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        return await _stream(client, url, body, t0, started)
    finally:
        if started is not None:
            started.set()              # has tokens, or ended (refused, failed): a fault waits for it


async def _stream(client, url, body, t0, started):
    """one()'s request: the kinds of ending its docstring names."""
    got_200, tokens, done = False, 0, False
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                try:
                    why = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    why = body
                return {"kind": str(r.status_code), "retry_after": "retry-after" in r.headers,
                        "why": f"{r.status_code}: {why}"[:160], "s": time.perf_counter() - t0}
            got_200 = True
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return {"kind": "after_200", "why": str(chunk["error"])[:160],
                            "s": time.perf_counter() - t0}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if started is not None and any((c.get("delta") or {}).get("content")
                                               for c in chunk.get("choices") or []):
                    started.set()
    except httpx.HTTPError as e:
        return {"kind": "after_200" if got_200 else "conn", "why": f"{type(e).__name__}: {e}"[:160],
                "s": time.perf_counter() - t0}
    if not done:
        return {"kind": "after_200", "why": "stream ended without [DONE]", "s": time.perf_counter() - t0}
    return {"kind": "ok", "tokens": tokens, "s": time.perf_counter() - t0}


class System:
    def __init__(self, model, num_prefill, num_decode, log_dir):
        self.port = free_port()
        from pdserve.up import UpConfig, worker_args
        from services.security import read_token
        prefill_args, decode_args = worker_args(UpConfig(prefill=num_prefill, decode=num_decode))
        self.launcher = Launcher(model, num_prefill, num_decode, http_port=self.port,  # as up
                                 log_dir=log_dir, restart_backoff_s=0.5, internal_token=True,
                                 prefill_args=prefill_args, decode_args=decode_args,
                                 gateway_args=["--health-interval-s", "0.5"])
        self.launcher.start(900)
        self.metadata = (("authorization", f"Bearer {read_token(self.launcher.token_file)}"),)
        self.stop = threading.Event()
        self.sup = threading.Thread(target=self.launcher.supervise, args=(self.stop, 0.1),
                                    daemon=True)
        self.sup.start()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1/chat/completions"
        self.model = httpx.get(self.base + "/v1/models", timeout=30).json()["data"][0]["id"]

    def close(self):
        self.stop.set()
        self.sup.join(30)
        self.launcher.stop()

    def stats(self, role: str) -> dict:
        from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
        stub_cls = prefill_pb2_grpc.PrefillWorkerStub if role == "prefill" else decode_pb2_grpc.DecodeWorkerStub
        out = {}
        for c in self.launcher.workers(role):
            if c.popen.poll() is None:
                try:
                    with self.launcher.probe_channel(c) as ch:
                        out[c.address] = stub_cls(ch).Stats(common_pb2.StatsRequest(), timeout=5,
                                                            metadata=self.metadata)
                except grpc.RpcError:
                    pass                   # restarting
        return out

    def held_blocks(self) -> int:
        s = {**self.stats("prefill"), **self.stats("decode")}
        return sum(x.total_kv_blocks - x.free_kv_blocks for x in s.values())

    def leaked(self, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            held = self.held_blocks()
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.5)            # bounded by the deadline

    def migrations(self) -> float:
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.base + "/metrics", timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name.endswith("kv_transfer_fallbacks_total") and s.labels.get("kind") == "migrate")

    def kill_busiest(self, role: str) -> str:
        s = self.stats(role)
        addr = max(s, key=lambda a: (s[a].num_running + s[a].num_waiting, a))
        c = next(c for c in self.launcher.workers(role) if c.address == addr)
        os.kill(c.pid, signal.SIGKILL)
        return addr


def row(name: str, results: list[dict], migrated: float, leaked: int, wall: float) -> dict:
    kinds = [r["kind"] for r in results]
    ok = [r for r in results if r["kind"] == "ok"]
    return {"case": name, "sent": len(results), "completed": len(ok),
            "429": kinds.count("429"),
            "429 w/o Retry-After": sum(1 for r in results if r["kind"] == "429" and not r["retry_after"]),
            "5xx": sum(1 for k in kinds if k.isdigit() and k.startswith("5")),
            "failed after 200": kinds.count("after_200"),
            "other": sum(1 for k in kinds if k not in ("ok", "429", "after_200") and not k.startswith("5")),
            "migrated": int(migrated), "e2e p50 s": pct(sorted(r["s"] for r in ok), 50),
            "e2e p90 s": pct(sorted(r["s"] for r in ok), 90),
            "tok/s": sum(r["tokens"] for r in ok) / wall if wall else 0.0, "leaked blocks": leaked,
            "why": Counter(_shape(r["why"]) for r in results if r["kind"] != "ok"
                           ).most_common(4)}


def _shape(why: str) -> str:
    """An error message without its numbers and ids, so alike ones are counted together."""
    return re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "N", why)[:120]


async def closed_loop(sys_, prompts, concurrency, duration_s, max_tokens):
    out, t0 = [], time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        async def worker(k):
            i = k
            while time.perf_counter() - t0 < duration_s:
                out.append(await one(c, sys_.url, sys_.model, prompts[i % len(prompts)], max_tokens))
                i += concurrency
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return out, time.perf_counter() - t0


async def open_loop(sys_, prompts, rate, duration_s, max_tokens, seed=1):
    rng = random.Random(seed)
    tasks, t0 = [], time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as c:
        i, t = 0, 0.0
        while t < duration_s:
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(c, sys_.url, sys_.model, prompts[i % len(prompts)], max_tokens)))
            i += 1
            t += rng.expovariate(rate)
        out = await asyncio.gather(*tasks)
    return list(out), time.perf_counter() - t0


async def together(sys_, prompts, max_tokens, fault=None):
    """All `prompts` at once; `fault(started)` runs alongside (started: one Event per stream)."""
    started = [asyncio.Event() for _ in prompts]
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as c:
        tasks = [asyncio.ensure_future(one(c, sys_.url, sys_.model, p, max_tokens, e))
                 for p, e in zip(prompts, started)]
        if fault is not None:
            await fault(started)
        out = await asyncio.gather(*tasks)
    return list(out), time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--capacity-s", type=float, default=30)
    ap.add_argument("--capacity-streams", type=int, default=16)
    ap.add_argument("--overload-s", type=float, default=60)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="the cases to run, in their order (overload runs capacity first: its rate)")
    args = ap.parse_args()
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    if not cases or cases - set(CASES):
        ap.error(f"--cases: choose from {','.join(CASES)}")
    if "overload" in cases:
        cases.add("capacity")
    if not args.model:
        from pdserve.default_model import resolve_default_model
        args.model = str(resolve_default_model())
    short = make_prompts(args.model, 400, 100, 1)
    long = make_prompts(args.model, 24, 1000, 2)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bad-day-"))
    print(f"starting pdserve: {args.prefill} prefill + {args.decode} decode on {Path(args.model).name} "
          f"(logs in {log_dir})", file=sys.stderr, flush=True)
    s = System(args.model, args.prefill, args.decode, log_dir)
    rows = []

    def case(name, coro):
        print(f"case: {name} ...", file=sys.stderr, flush=True)
        m0 = s.migrations()
        results, wall = asyncio.run(coro)
        r = row(name, results, s.migrations() - m0, s.leaked(), wall)
        rows.append(r)
        print(f"  {r}", file=sys.stderr, flush=True)
        return r

    try:
        if "capacity" in cases:
            cap = case(f"capacity ({args.capacity_streams} streams)",
                       closed_loop(s, short, args.capacity_streams, args.capacity_s, args.output_tokens))
        if "overload" in cases:
            rate = cap["completed"] / args.capacity_s
            case(f"overload 3x ({3 * rate:.2f} req/s for {args.overload_s:.0f} s)",
                 open_loop(s, short, 3 * rate, args.overload_s, args.output_tokens))
        if "burst" in cases:
            case("burst of 100 short streams", together(s, short[:100], args.output_tokens))

        async def kill_prefill(started):
            await asyncio.sleep(1.0)
            print(f"  SIGKILL prefill {s.kill_busiest('prefill')}", file=sys.stderr, flush=True)
        if "kill-prefill" in cases:
            case("kill prefill, 24 long prompts queued", together(s, long, 8, kill_prefill))
            time.sleep(5)              # the supervisor restarts it

        async def kill_decode(started):
            deadline = time.monotonic() + 300
            while not all(e.is_set() for e in started) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)   # until every stream has tokens or ended (bounded)
            print(f"  SIGKILL decode {s.kill_busiest('decode')}", file=sys.stderr, flush=True)
        if "kill-decode" in cases:
            case("kill decode under 40 streams", together(s, short[100:140], 64, kill_decode))
    finally:
        s.close()
    cols = ["case", "sent", "completed", "429", "429 w/o Retry-After", "5xx", "failed after 200",
            "other", "migrated", "e2e p50 s", "e2e p90 s", "tok/s", "leaked blocks"]
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    for r in rows:
        for why, n in r["why"]:
            print(f"{r['case']}: {n} x {why}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
