"""Goodput under overload: 1 prefill + 1 decode (`pdserve up`'s Launcher, tiny model),
open-loop Poisson arrivals at multiples of the measured capacity, admission control off
(today's behaviour, run first) and on (the gateway's --slo-ttft-ms/--slo-itl-ms).

    python bench/goodput.py [--rates 0.5,1,1.5,2,3] [--duration 30] [--slo-factor 5]
                            [--prompt-tokens 64] [--output-tokens 32] [--capacity-clients 32]

Per system (off, then on), started fresh, same processes and thread counts (every worker
one torch thread; the gateway and this client are one Python process each):
  1. unloaded: 20 requests one at a time -> TTFT p50 and ITL p50 (off system only: they set
     the SLOs, SLO = --slo-factor x the unloaded p50, for both systems)
  2. capacity: a closed loop of --capacity-clients clients for --duration s -> completed
     requests/s (off system only: the rates are multiples of it, for both systems)
  3. per rate: Poisson arrivals for --duration s, each a streaming /v1/completions request
     (greedy, ignore_eos, max_tokens = --output-tokens, distinct prompts; pdserve.loadgen's
     client, as `pdserve bench` sends them); then every request is awaited (client timeout
     120 s). Per request: TTFT (first text chunk), ITL ((last chunk - first chunk) /
     (completion_tokens - 1), tokens from `usage`), status. Percentiles: sim.stats.pct.
     goodput = requests that completed meeting both SLOs / arrival window (s).
A 429 is a refusal (the client does not retry); 5xx and transport errors are counted apart.
The gateway with admission on is given the same SLOs the goodput is judged by.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import prompts, wait_http

from pdserve import loadgen
from pdserve.launcher import Launcher, free_port
from sim.stats import pct

CLIENT_TIMEOUT_S = 120.0
# With 2+ cores, the client and the gateway (whose work grows with arrivals, refused ones
# included) share core 0 and both workers core 1, so the capacity the workers offer does
# not shrink as the arrival rate grows (it did when all shared both cores).
PIN = len(os.sched_getaffinity(0)) >= 2


def as_result(r: dict, max_tokens: int) -> dict:
    """pdserve.loadgen's record in this script's terms: status 200 / 429 / 5xx / a reason."""
    if r["status"] == "rejected":
        return {"status": 429, "retry_after": r["retry_after"], "latency": r["e2e_s"]}
    if r["status"] == "error":
        return {"status": r["http_status"] if r["http_status"] and r["http_status"] != 200
                else (r["error"].split(":")[0] if r["http_status"] is None else r["error"][:80])}
    if r["output_tokens"] != max_tokens:
        return {"status": f"incomplete ({r['output_tokens']} tokens)"}
    return {"status": 200, "ttft": r["ttft_s"], "itl": r["itl_s"] or 0.0}


class Client:
    def __init__(self, base: str, model: str, ps: list[str], max_tokens: int):
        self.target = loadgen.Target(base, model, timeout_s=CLIENT_TIMEOUT_S)
        self.ps, self.max_tokens = ps, max_tokens
        self.next = 0
        self.http = None

    async def close(self) -> None:
        await self.http.aclose()
        self.http = None

    def prompt(self) -> str:
        self.next += 1
        return self.ps[self.next % len(self.ps)]

    async def one(self) -> dict:
        if self.http is None:        # made in the running loop (each asyncio.run has its own)
            self.http = loadgen.client(self.target, 4000)
        r = await loadgen.send(self.http, self.target, loadgen.Job(self.prompt(), self.max_tokens))
        return as_result(r, self.max_tokens)

    async def unloaded(self, n: int = 20) -> tuple[float, float]:
        rs = [await self.one() for _ in range(n)]
        ok = [r for r in rs if r["status"] == 200]
        assert len(ok) == n, rs
        return pct(sorted(r["ttft"] for r in ok), 50), pct(sorted(r["itl"] for r in ok), 50)

    async def capacity(self, clients: int, duration: float) -> float:
        done, stop = [], time.perf_counter() + duration
        t0 = time.perf_counter()

        async def loop():
            while time.perf_counter() < stop:
                r = await self.one()
                if r["status"] == 200:
                    done.append(time.perf_counter())
        await asyncio.gather(*(loop() for _ in range(clients)))
        return len(done) / (time.perf_counter() - t0)

    async def open_loop(self, rate: float, duration: float, seed: int) -> list[dict]:
        rng = random.Random(seed)
        tasks, t0 = [], time.perf_counter()
        t = rng.expovariate(rate)
        while t < duration:
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            tasks.append(asyncio.create_task(self.one()))
            t += rng.expovariate(rate)
        return await asyncio.gather(*tasks)


def summarize(rs: list[dict], duration: float, slo_ttft: float, slo_itl: float) -> dict:
    ok = [r for r in rs if r["status"] == 200]
    good = [r for r in ok if r["ttft"] <= slo_ttft and r["itl"] <= slo_itl]
    s429 = [r for r in rs if r["status"] == 429]
    return {"sent": len(rs), "ok": len(ok), "good": len(good), "goodput": len(good) / duration,
            "share_429": len(s429) / max(1, len(rs)),
            "retry_after_s": sorted({int(r["retry_after"]) for r in s429 if r["retry_after"]}),
            "s429_without_retry_after": sum(1 for r in s429 if not r["retry_after"]),
            "s429_latency_p50": pct(sorted(r["latency"] for r in s429), 50),
            "5xx": sum(1 for r in rs if isinstance(r["status"], int) and r["status"] >= 500),
            "other": dict(collections.Counter(
                str(r["status"]) for r in rs if not isinstance(r["status"], int)
                or r["status"] not in (200, 429) and r["status"] < 500)),
            "ttft_p50": pct(sorted(r["ttft"] for r in ok), 50),
            "ttft_p90": pct(sorted(r["ttft"] for r in ok), 90),
            "itl_p50": pct(sorted(r["itl"] for r in ok), 50),
            "itl_p90": pct(sorted(r["itl"] for r in ok), 90)}


async def calibrate(c: Client, args) -> tuple[tuple[float, float], float]:
    """((TTFT SLO, ITL SLO), capacity in requests/s), measured on the system `c` talks to."""
    try:
        ttft, itl = await c.unloaded()
        slo = (args.slo_factor * ttft, args.slo_factor * itl)
        log(f"unloaded p50: TTFT {ttft * 1e3:.1f} ms, ITL {itl * 1e3:.2f} ms -> SLOs "
            f"({args.slo_factor:g}x): TTFT {slo[0] * 1e3:.1f} ms, ITL {slo[1] * 1e3:.2f} ms")
        cap = await c.capacity(args.capacity_clients, args.duration)
        log(f"capacity ({args.capacity_clients} closed-loop clients): {cap:.1f} requests/s")
        return slo, cap
    finally:
        await c.close()


async def sweep(c: Client, mode: str, mults: list[float], cap: float,
                slo: tuple[float, float], duration: float) -> dict[float, dict]:
    """Each rate (a multiple of `cap`) for `duration` s of arrivals, summarized."""
    try:
        await c.unloaded(5)          # warm-up
        out = {}
        for i, m in enumerate(mults):
            rs = await c.open_loop(m * cap, duration, seed=i)
            out[m] = summarize(rs, duration, *slo)
            log(f"admission {mode}, {m:g}x ({m * cap:.1f}/s): {json.dumps(out[m])}")
            await asyncio.sleep(2)   # let the previous rate's stragglers go
        return out
    finally:
        await c.close()


def system(model_dir: str, gateway_args: list[str], log_dir: str):
    port = free_port()
    launcher = Launcher(model_dir, 1, 1, http_port=port, log_dir=Path(log_dir),
                        gateway_args=gateway_args)
    launcher.start(300)
    if PIN:     # the workers on a core of their own: arrivals cost them no CPU
        for c in launcher.children:
            subprocess.run(["taskset", "-a", "-cp", "0" if c.role == "gateway" else "1",
                            str(c.pid)], check=True, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", None, 60)
    return launcher, base


def log(*a) -> None:
    print(*a, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="0.5,1,1.5,2,3", help="multiples of the capacity")
    ap.add_argument("--duration", type=float, default=30.0,
                    help="seconds of arrivals per rate (12 s windows swung by 20%% between runs)")
    ap.add_argument("--slo-factor", type=float, default=5.0)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--capacity-clients", type=int, default=32)
    args = ap.parse_args()
    if PIN:
        os.sched_setaffinity(0, {0})
    from engine.tiny_model import ensure_default_model
    model_dir = str(ensure_default_model())
    ps = prompts(model_dir, 500, args.prompt_tokens)
    mults = [float(x) for x in args.rates.split(",")]
    log_dir = tempfile.mkdtemp(prefix="bench-goodput-")
    log(f"# goodput: 1 prefill + 1 decode, tiny model, prompts {args.prompt_tokens} tokens, "
        f"{args.output_tokens} output tokens, {args.duration:.0f}s of arrivals per rate; logs {log_dir}")
    log(f"# started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
        + ("client + gateway on core 0, workers on core 1" if PIN else "not pinned"))
    results: dict[str, dict[float, dict]] = {}
    slo = cap = None
    for mode in ("off", "on"):
        gw_args = [] if mode == "off" else ["--slo-ttft-ms", f"{slo[0] * 1e3:.1f}",
                                            "--slo-itl-ms", f"{slo[1] * 1e3:.2f}"]
        launcher, base = system(model_dir, gw_args, f"{log_dir}/{mode}")
        try:
            client = Client(base, httpx.get(base + "/v1/models").json()["data"][0]["id"], ps,
                            args.output_tokens)
            if mode == "off":
                slo, cap = asyncio.run(calibrate(client, args))
            results[mode] = asyncio.run(sweep(client, mode, mults, cap, slo, args.duration))
        finally:
            launcher.stop()
    peak = max(r["goodput"] for m in results.values() for r in m.values())
    log()
    log(f"SLOs: TTFT {slo[0] * 1e3:.1f} ms, ITL {slo[1] * 1e3:.2f} ms ({args.slo_factor:g}x the "
        f"unloaded p50s); capacity {cap:.1f} requests/s; peak goodput {peak:.1f} requests/s")
    log()
    log("| load | arrivals/s | admission | goodput/s | % of peak | completed | 429 | 5xx+other "
        "| TTFT p50/p90 ms | ITL p50/p90 ms |")
    log("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in mults:
        for mode in ("off", "on"):
            r = results[mode][m]
            log(f"| {m:g}x | {m * cap:.1f} | {mode} | {r['goodput']:.1f} | {100 * r['goodput'] / peak:.0f}% "
                f"| {r['ok']}/{r['sent']} | {100 * r['share_429']:.0f}% | {r['5xx'] + sum(r['other'].values())} "
                f"| {r['ttft_p50'] * 1e3:.0f}/{r['ttft_p90'] * 1e3:.0f} "
                f"| {r['itl_p50'] * 1e3:.1f}/{r['itl_p90'] * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
