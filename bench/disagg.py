"""Conditional disaggregation on the shipped chat trace: --disaggregation always / never /
auto on the SAME 1 prefill + 1 decode workers (the default model, SmolLM2-135M), the modes
alternating round by round at the same rate.

    python bench/disagg.py [--rounds 2] [--duration 60] [--rate-scale 1.4]
                           [--slo-ttft-ms 3000] [--slo-itl-ms 80] [--model PATH]

One Launcher starts the workers and a gateway (always); two more gateways (never, auto) are
started on the same workers, each on its own REST port, so the three differ only in the
mode. Per round, each mode in turn replays bench/traces/chat.jsonl with `pdserve bench`'s
measure() (pdserve/loadgen.py: streaming chat, greedy, ignore_eos, the trace's lengths; a
trace's equal hash_ids share text), --rate-scale x the trace's rate for --duration s of
arrivals. Each (round, mode) gets its own prompt seed: no run finds an earlier run's text in
a prefix cache. The workers get `pdserve up`'s thread counts (prefill 2, decode 1 on 2
cores). Prefills local / disaggregated are the gateway's pdserve:prefills_total deltas.

Why this rate and these SLOs: on this 2-core machine a chat prompt (543-1481 tokens) takes
the prefill worker about 0.5-1.5 s; the decode worker computing it itself takes longer (one
thread) and stalls its running streams meanwhile, while the handover costs ~0.2 s. At
~0.5 req/s (1.4 x the trace's 0.37) the prefill worker is busy about half the time, so the
queue matters for always, the stalls for never; TTFT <= 3 s and ITL <= 80 ms sit between
what the two modes reach there, so attainment separates them (a rate both meet or both miss
everywhere would show nothing).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench import measure, parse  # noqa: E402
from pdserve.launcher import Launcher, free_port  # noqa: E402
from pdserve.up import UpConfig, worker_args  # noqa: E402

MODES = ("always", "never", "auto")
TRACE = ROOT / "bench" / "traces" / "chat.jsonl"


def log(*a) -> None:
    print(*a, flush=True)


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not ready in {timeout_s:.0f} s")
        time.sleep(0.5)


def gateway(model: str, launcher: Launcher, mode: str, log_dir: Path):
    """Another gateway on the launcher's workers with --disaggregation `mode`."""
    port = free_port()
    pool = {r: ",".join(c.address for c in launcher.workers(r)) for r in ("prefill", "decode")}
    argv = [sys.executable, "-m", "pdserve.cli", "gateway", "--model", model, "--prefill",
            pool["prefill"], "--decode", pool["decode"], "--host", "127.0.0.1",
            "--grpc-port", "0", "--http-port", str(port), "--disaggregation", mode]
    proc = subprocess.Popen(argv, stdout=open(log_dir / f"gateway-{mode}.log", "ab"),
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/v1/models", 120)
    return proc, base


def prefills(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    out = {"local": 0.0, "disaggregated": 0.0}
    for labels, v in re.findall(r'^pdserve:prefills_total\{([^}]*)\} (\S+)$', text, re.M):
        if "worker=" not in labels:
            out[re.search(r'kind="(\w+)"', labels).group(1)] += float(v)
    return out


def run(base: str, args, seed: int) -> dict:
    before = prefills(base)
    bench_args = parse(["--url", base, "--endpoint", "chat", "--trace", str(TRACE),
                        "--rate-scale", str(args.rate_scale), "--duration", str(args.duration),
                        "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms),
                        "--seed", str(seed), "--timeout", "300", "--no-progress"])
    summary, _, _ = measure(bench_args)
    after = prefills(base)
    summary["local"] = int(after["local"] - before["local"])
    summary["disaggregated"] = int(after["disaggregated"] - before["disaggregated"])
    return summary


COLS = (("slo_attainment", "SLO attainment", "{:.3f}"), ("goodput_rps", "goodput req/s", "{:.3f}"),
        ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"), ("ttft_p90_ms", "TTFT p90 ms", "{:.0f}"),
        ("itl_p50_ms", "ITL p50 ms", "{:.1f}"), ("itl_p90_ms", "ITL p90 ms", "{:.1f}"),
        ("completed", "completed", "{}"), ("errors", "errors", "{}"),
        ("rejected_429", "429s", "{}"), ("local", "local", "{}"),
        ("disaggregated", "disagg.", "{}"))


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| mode | round | " + " | ".join(c[1] for c in COLS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in COLS) + " |"]
    for mode in MODES:
        rows = results[mode]
        for i, s in enumerate(rows):
            lines.append(f"| {mode} | {i + 1} | " + " | ".join(
                "n/a" if s.get(k) is None else f.format(s[k]) for k, _, f in COLS) + " |")
        tot = {k: sum(s[k] for s in rows) for k in ("completed", "errors", "rejected_429",
                                                   "local", "disaggregated")}
        att = sum(s["slo_attainment"] * s["requests"] for s in rows) / max(sum(s["requests"] for s in rows), 1)
        gp = sum(s["goodput_rps"] for s in rows) / len(rows)
        lines.append(f"| **{mode}** | all | {att:.3f} | {gp:.3f} | | | | | {tot['completed']} | "
                     f"{tot['errors']} | {tot['rejected_429']} | {tot['local']} | {tot['disaggregated']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--rate-scale", type=float, default=1.4, help="x the trace's arrival rate")
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=80.0)
    ap.add_argument("--model", default="", help="default: SmolLM2-135M-Instruct (pdserve up's)")
    args = ap.parse_args()
    from pdserve.default_model import resolve_default_model
    model = args.model or str(resolve_default_model())
    log_dir = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    pre, dec = worker_args(UpConfig())
    launcher = Launcher(model, 1, 1, http_port=free_port(), log_dir=log_dir, prefill_args=pre,
                        decode_args=dec, gateway_args=["--disaggregation", "always"])
    extra = []
    try:
        launcher.start(600)
        bases = {"always": f"http://127.0.0.1:{launcher.http_port}"}
        for mode in ("never", "auto"):
            proc, bases[mode] = gateway(launcher.model_dir, launcher, mode, log_dir)
            extra.append(proc)
        log(f"model {Path(model).name}; 1 prefill ({' '.join(pre)}) + 1 decode ({' '.join(dec)}); "
            f"trace {TRACE.name} x{args.rate_scale:g} rate, {args.duration:g} s of arrivals per run; "
            f"SLOs TTFT <= {args.slo_ttft_ms:g} ms, ITL <= {args.slo_itl_ms:g} ms; "
            f"{args.rounds} rounds, modes alternating {', '.join(MODES)}")
        results = {m: [] for m in MODES}
        for r in range(args.rounds):
            for i, mode in enumerate(MODES):
                s = run(bases[mode], args, seed=1000 * (r + 1) + i)
                results[mode].append(s)
                log(f"round {r + 1} {mode}: " + json.dumps(
                    {k: s.get(k) for k, _, _ in COLS} | {"requests": s["requests"]}))
        log(table(results))
        return 0
    finally:
        for p in extra:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        launcher.stop()


if __name__ == "__main__":
    sys.exit(main())
