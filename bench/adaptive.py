"""Adaptive serving at a fixed worker budget: `pdserve up --autoscale --max-workers 2`
against a fixed 1P1D, on the chat trace at a rate that changes over time (low, high, low).

    python bench/adaptive.py [--model M] [--rates 0.05,0.2,0.05] [--phase-s 90,90,90]
                             [--slo-ttft-ms 8000] [--slo-itl-ms 150] [--interval-s 3]
                             [--rounds 1]

The defaults fit this 2-core VM shared with other sessions (a chat prompt's prefill took
~3.5 s at load average 12; at 0.5 req/s the fixed 1P1D refused a third of the requests):
about 11 minutes for one round.

  1. the requests: bench/traces/chat.jsonl's records (lengths, shared-prefix block ids)
     in order, cycled, re-timed as Poisson arrivals at each phase's rate; one trace file
     both systems replay with `pdserve bench --trace` (same prompts, same arrival times)
  2. each round, in alternating order: the fixed system (`pdserve up --prefill 1 --decode
     1`) and the autoscaled one (`pdserve up --autoscale --prefill 0 --decode 1
     --max-workers 2`: it starts with one colocated worker, the smallest shape at no load);
     both with the gateway's default --disaggregation auto and the same SLOs for the plan
     and the bench's goodput
  3. worker-seconds: the workers alive, sampled every second from the load's start to its
     last answer (the autoscaled system's from its /plan `current`, a retiring worker
     counted until it is gone; the fixed system's: 2 throughout)
  4. one table: goodput, SLO attainment, TTFT/ITL p90, worker-seconds, failed (errors +
     429s), the autoscaler's changes; the ratios autoscaled / fixed below it

Target (issue 30): autoscaled goodput >= 1.3x fixed at the same budget, or the same goodput
with >= 25% fewer worker-seconds, and zero failed requests.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench import measure, parse  # noqa: E402
from pdserve.processes import free_port  # noqa: E402
from sim.trace import read_trace, write_trace  # noqa: E402

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f} s] {msg}", flush=True)


def stepped_trace(src: str, rates: list[float], phases: list[float], seed: int, out: Path) -> int:
    """The source trace's records, cycled, at Poisson arrivals of each phase's rate."""
    recs = read_trace(src)
    rng, t, start, n, rows = random.Random(seed), 0.0, 0.0, 0, []
    for rate, span in zip(rates, phases):
        t = start + rng.expovariate(rate)
        while t < start + span:
            rows.append(replace(recs[n % len(recs)], timestamp_ms=round(t * 1000.0, 3)))
            n += 1
            t += rng.expovariate(rate)
        start += span
    write_trace(out, rows)
    return len(rows)


class System:
    """One `pdserve up`, its lines read by a thread (the autoscaler's changes among them)."""

    def __init__(self, name: str, argv: list[str], log: Path):
        self.name, self.http = name, free_port()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", "--grpc-port", "0", "--http-port",
             str(self.http), *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.plan_url = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()
            if m := re.search(r"^pdserve autoscale: plan=(\S+)", line):
                self.plan_url = m.group(1)
            if line.startswith("pdserve ready:"):
                self.ready.set()

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{self.name} did not start:\n" + "".join(self.lines[-30:]))
        time.sleep(2.0)                   # the autoscaler's line comes just after "ready"

    def workers(self) -> int:
        """Workers alive now: the plan's current shape (+ one retiring), else the fixed 2."""
        if not self.plan_url:
            return 2
        try:
            with urllib.request.urlopen(self.plan_url, timeout=5) as r:
                cur = json.loads(r.read())["current"]
        except OSError:
            return -1
        retiring = sum(1 for x in self.lines if "retiring " in x) - \
            sum(1 for x in self.lines if " retired: " in x)
        return cur["prefill"] + cur["decode"] + max(0, retiring)

    def changes(self) -> list[str]:
        return [x.split("autoscale: ", 1)[1].split(":")[0].strip()
                for x in self.lines if "pdserve up: autoscale: " in x]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def run(system: System, trace: Path, args) -> dict:
    system.wait_ready()
    samples, stop = [], threading.Event()

    def sample():
        while not stop.wait(1.0):
            samples.append(system.workers())
    threading.Thread(target=sample, daemon=True).start()
    began = time.monotonic()
    summary, _run, records = measure(parse([
        "--url", f"http://127.0.0.1:{system.http}", "--trace", str(trace), "--endpoint", "chat",
        "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms),
        "--warmup", "0", "--no-progress", "--seed", "7", "--timeout", "600"]))
    wall = time.monotonic() - began
    stop.set()
    known = [s for s in samples if s >= 0]
    mean_workers = sum(known) / len(known) if known else float("nan")
    return {**summary, "wall_s": wall, "worker_s": mean_workers * wall,
            "changes": system.changes(), "failed": summary["errors"] + summary["rejected_429"]}


def table(rows: list[tuple[str, int, dict]]) -> str:
    head = ("| system | round | requests | failed | goodput req/s | SLO attainment | TTFT p90 ms "
            "| ITL p90 ms | worker-s | wall s | changes |")
    out = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name, rnd, r in rows:
        out.append(f"| {name} | {rnd} | {r['requests']} | {r['failed']} | {r['goodput_rps']:.4f} "
                   f"| {r['slo_attainment']:.3f} | {r['ttft_p90_ms'] or 0:.0f} | "
                   f"{r['itl_p90_ms'] or 0:.1f} | {r['worker_s']:.0f} | {r['wall_s']:.0f} | "
                   f"{', '.join(r['changes']) or '-'} |")
    return "\n".join(out)


def ratios(rows) -> str:
    fixed = [r for n, _, r in rows if n == "fixed 1P1D"]
    auto = [r for n, _, r in rows if n != "fixed 1P1D"]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)      # noqa: E731
    g = mean(auto, "goodput_rps") / max(mean(fixed, "goodput_rps"), 1e-9)
    w = 1 - mean(auto, "worker_s") / max(mean(fixed, "worker_s"), 1e-9)
    failed = sum(r["failed"] for _, _, r in rows)
    met = (g >= 1.3 or (g >= 0.97 and w >= 0.25)) and failed == 0
    return (f"autoscaled / fixed: goodput x{g:.2f}, worker-seconds {100 * w:.0f}% fewer, "
            f"failed {failed} in all -> target {'met' if met else 'NOT met'} (goodput >= 1.3x, "
            "or the same goodput with >= 25% fewer worker-seconds, zero failed)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--trace", default=str(ROOT / "bench/traces/chat.jsonl"))
    ap.add_argument("--rates", default="0.05,0.2,0.05")
    ap.add_argument("--phase-s", default="90,90,90")
    ap.add_argument("--slo-ttft-ms", type=float, default=8000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=150.0)
    ap.add_argument("--interval-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="/tmp/pdserve-adaptive")
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    phases = [float(x) for x in args.phase_s.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "stepped.jsonl"
    n = stepped_trace(args.trace, rates, phases, 1, trace)
    say(f"{n} requests: rates {rates} req/s over phases {phases} s; SLO TTFT "
        f"{args.slo_ttft_ms:g} ms, ITL {args.slo_itl_ms:g} ms; machine load "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model = ["--model", args.model] if args.model else []
    slo = ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms)]
    kinds = {"fixed 1P1D": [*model, "--prefill", "1", "--decode", "1"],
             "autoscale (max 2)": [*model, "--autoscale", "--prefill", "0", "--decode", "1",
                                   "--max-workers", "2", "--autoscale-interval-s",
                                   str(args.interval_s), *slo]}
    rows = []
    for rnd in range(1, args.rounds + 1):
        order = list(kinds) if rnd % 2 else list(reversed(kinds))
        for name in order:
            say(f"round {rnd}: {name}: pdserve up {' '.join(kinds[name])}")
            system = System(name, kinds[name], out / f"{name.split()[0]}-{rnd}.log")
            try:
                r = run(system, trace, args)
            finally:
                system.stop()
            rows.append((name, rnd, r))
            say(f"round {rnd}: {name}: goodput {r['goodput_rps']:.4f} req/s, attainment "
                f"{r['slo_attainment']:.3f}, {r['worker_s']:.0f} worker-s, failed {r['failed']}, "
                f"changes {r['changes']}")
    print()
    print(table(rows))
    print()
    print(ratios(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
