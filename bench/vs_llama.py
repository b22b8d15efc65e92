"""pdserve (`pdserve up`, the default model) beside llama.cpp's own `llama-server` on the same
GGUF and the same cores, driven by the same client, rounds alternating server by server
(issue 34's fair peer; the servers: bench/vs_llama_servers.py).

    python bench/vs_llama.py [--cpus 0,1] [--rounds 2] [--concurrency 1,4,16,32,64]
        [--requests 3,4,16,32,64] [--pdserve NAME=ARGS ...] [--llama-threads 2] [--log FILE]
    python bench/vs_llama.py --quick          # a small run that checks every path (minutes)

The client: pdserve.loadgen (that of `pdserve bench`): streaming /v1/chat/completions, greedy,
max_tokens --output-tokens with ignore_eos (every request makes exactly that many, counted from
`usage`), distinct prompts cut from the GPL-3 text at distinct offsets (so no server gets a
prefix-cache hit beyond the chat template's system prompt), ~--prompt-tokens tokens each after
the chat template (the tables print the prompt tokens each server reported).

Sections (each printed as a table, then the issue's targets with the measured ratios):
  (1) a closed loop of c clients, --requests of them per level: output tok/s (usage tokens /
      first sent to last done), TTFT p50, ITL p50 / p90 over every gap between content
      chunks, refused (429), errors; llama-server restarted per level with --parallel c
      (as many slots as streams) and -c max(4096, 1024 c)
  (2) prefill: a ~1k-token prompt, max_tokens 1: prompt tokens / TTFT for both; llama-server's
      own timings.prompt_per_second; pdserve's own prefill compute (usage.pdserve phases)
  (3) TTFT of a ~64-token prompt (median of --ttft-reps per round)
  (4) one stream: served decode tok/s (1 / a request's mean ITL) against the offline engine's
      (a subprocess of this script: LLM on the same model at the decode worker's --threads,
      read back from its command line, same prompt length and tokens, first to last token)
Rounds alternate server by server within each level (order reversed every round); every
figure is the median over rounds. The idle server stays up meanwhile: its CPU seconds during
the other's measurement are printed (it should be ~0). pdserve up's spawn-to-ready seconds
are the start-up row.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vs_llama_report import Report  # noqa: E402
from bench.vs_llama_servers import LlamaServer, PdserveUp  # noqa: E402
from pdserve import loadgen  # noqa: E402
from pdserve.launcher import free_port  # noqa: E402
from sim.stats import pct  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")
ROOT = Path(__file__).resolve().parents[1]


class Prompts:
    """Distinct prompts of ~`total` tokens after the chat template: the k-th starts at token
    13 k of the text (wrapping with a numbered prefix), so none shares a prefix with another."""

    def __init__(self, model: str):
        from engine.tokenizer import Tokenizer
        self.tok = Tokenizer.from_dir(model)
        self.ids = self.tok.encode(TEXT.read_text(), add_special_tokens=False)
        empty = self.tok.apply_chat_template([{"role": "user", "content": ""}])
        self.overhead = len(self.tok.encode(empty, add_special_tokens=False))
        self.k = 0

    def take(self, total: int, n: int = 1) -> list[str]:
        content = max(8, total - self.overhead)
        room = len(self.ids) - content
        out = []
        for _ in range(n):
            at, lap = (13 * self.k) % room, (13 * self.k) // room
            text = self.tok.decode(self.ids[at:at + content])
            out.append(f"({lap}) {text}" if lap else text)
            self.k += 1
        return out

    def chat_ids(self, prompt: str) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tok.encode(text, add_special_tokens=False)


def target(server, max_tokens_timeout: float, extra=None) -> loadgen.Target:
    return loadgen.Target(server.base, server.model, endpoint="chat", ignore_eos=True,
                          keep_gaps=True, timeout_s=max_tokens_timeout, extra=extra or {})


async def closed(server, prompts: list[str], c: int, max_tokens: int, warm: str) -> dict:
    """A closed loop of `c` clients over `prompts` (after one short warm-up request)."""
    tokens = len(prompts) * max_tokens
    t = target(server, 60 + tokens / 5)           # a bound far past any plausible run
    async with loadgen.client(t, 2) as http:
        await loadgen.send(http, t, loadgen.Job(warm, 4))
    jobs = iter(loadgen.Job(p, max_tokens) for p in prompts)
    records, window = await loadgen.closed_loop(
        t, jobs, concurrency=c, duration_s=float("inf"), deadline_s=60 + tokens / 5,
        max_requests=None, progress=loadgen.Progress(len(prompts), every_s=15.0))
    return summarize(records, window)


def summarize(records: list[dict], window: float) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    gaps = [g for r in ok for g in r.get("gaps_s", [])]
    itl = [r["itl_s"] for r in ok if r["itl_s"]]
    toks = sum(r["output_tokens"] for r in ok)
    return {"tok_s": toks / window if window > 0 else float("nan"),
            "ttft_p50": pct([r["ttft_s"] for r in ok], 50), "itl_p50": pct(gaps, 50),
            "itl_p90": pct(gaps, 90), "decode_tok_s": 1 / statistics.median(itl) if itl else float("nan"),
            "refused": sum(r["status"] == "rejected" for r in records),
            "errors": sum(r["status"] == "error" for r in records), "requests": len(records),
            "first_error": next((r["error"] for r in records if r["status"] != "ok"), ""),
            "prompt_tokens": statistics.median([r["prompt_tokens"] or 0 for r in ok]) if ok else 0,
            "tokens_per_chunk": toks / max(1, sum(r.get("chunks", 0) for r in ok)),
            "usage": all(r["tokens_from_usage"] for r in ok)}


async def single(server, prompt: str, max_tokens: int, extra=None) -> dict:
    t = target(server, 600, extra)
    async with loadgen.client(t, 2) as http:
        return await loadgen.send(http, t, loadgen.Job(prompt, max_tokens))


def prefill_one(server, prompt: str) -> dict:
    """One ~1k-token prompt, one output token: TTFT-derived and the server's own rate."""
    mine = isinstance(server, PdserveUp)
    r = asyncio.run(single(server, prompt, 1, {"pdserve": {"timings": True}} if mine else None))
    if r["status"] != "ok":
        return {"error": r["error"]}
    n, tim = r["prompt_tokens"] or 0, r.get("timings") or {}
    own = tim.get("prompt_per_second")
    phases = tim.get("ttft_phases_ms") or {}
    compute_ms = phases.get("prefill_compute") or phases.get("local_prefill")
    if compute_ms:
        own = n / (compute_ms / 1e3)
    return {"ttft": r["ttft_s"], "prompt_tokens": n, "pp_ttft": n / r["ttft_s"], "pp_own": own}


def offline_engine(model: str, threads: int, prompt_ids: list[int], tokens: int, reps: int,
                   cpus: str) -> list[float]:
    """The offline engine's one-stream decode tok/s, `reps` times, in a fresh process."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--offline-engine", model,
            "--threads", str(threads), "--output-tokens", str(tokens), "--reps", str(reps),
            "--prompt-ids", ",".join(map(str, prompt_ids)), "--cpus", cpus]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:        # bound: the load + every token at 1 tok/s (a contended 2-thread run can crawl)
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120 + reps * tokens,
                             env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"offline engine ({threads} threads): no result in {120 + reps * tokens} s", flush=True)
        return []
    if out.returncode != 0:
        print(f"offline engine failed: {out.stderr[-500:]}", flush=True)
        return []
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def offline_main(a) -> int:
    import torch

    from engine import LLM
    from pdserve.eval import _decode_tok_s
    torch.set_num_threads(a.threads)
    llm = LLM(a.offline_engine)
    ids = [int(x) for x in a.prompt_ids.split(",")]
    _decode_tok_s(llm, ids[:8], 8)                                   # warm-up
    print(json.dumps({"tok_s": [_decode_tok_s(llm, ids, a.output_tokens) for _ in range(a.reps)]}))
    return 0


def decode_threads(server: PdserveUp) -> int:
    """The decode worker's --threads, read from its command line."""
    for pid in server.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"decode" in argv and b"--threads" in argv:
            return int(argv[argv.index(b"--threads") + 1])
    raise RuntimeError(f"{server.name}: no decode worker with --threads found")


class Bench:
    """The run: servers, prompts, rounds; every measurement goes to `self.report`."""

    def __init__(self, a, model: str, log_dir: Path):
        self.a, self.model, self.t0 = a, model, time.monotonic()
        self.prompts = Prompts(model)
        self.llama = LlamaServer(log_dir, a.llama_bin, model, a.llama_threads, free_port(),
                                 a.llama_args.split())
        self.pds = [PdserveUp(log_dir, n, args, free_port()) for n, args in a.pdserve]
        self.report = Report([p.name for p in self.pds], self.llama.name, a)
        self.steps, self.total = 0, 0

    def say(self, what: str) -> None:
        self.steps += 1
        el = time.monotonic() - self.t0
        eta = el / self.steps * (self.total - self.steps) if self.steps else 0
        print(f"[{self.steps}/{self.total} {el:.0f}s, ~{eta:.0f}s left] {what}", flush=True)

    def order(self, r: int) -> list:
        servers = [self.llama, *self.pds]
        return servers if r % 2 == 0 else servers[::-1]

    def idle_cpu(self, busy) -> dict:
        return {s.name: s.cpu_s() for s in [self.llama, *self.pds] if s is not busy}

    def level(self, c: int, n: int) -> None:
        self.llama.start(c, max(4096, 1024 * c))
        if c == 1:
            self.report.startup(self.llama.name, self.llama.ready_s, "")
        for r in range(self.a.rounds):
            for s in self.order(r):
                before = self.idle_cpu(s)
                res = asyncio.run(closed(s, self.prompts.take(self.a.prompt_tokens, n), c,
                                         self.a.output_tokens, self.prompts.take(16)[0]))
                res["idle_cpu_s"] = {k: v2 - before[k] for k, v2 in self.idle_cpu(s).items()}
                self.report.level(c, s.name, res)
                self.say(f"c={c} round {r + 1} {s.name}: {res['tok_s']:.1f} tok/s, TTFT p50 "
                         f"{res['ttft_p50'] * 1e3:.0f} ms, ITL p50/p90 {res['itl_p50'] * 1e3:.1f}/"
                         f"{res['itl_p90'] * 1e3:.1f} ms, refused {res['refused']}, errors "
                         f"{res['errors']} {res['first_error'][:80]}; idle peers' CPU "
                         + ", ".join(f"{k} {v:.2f}s" for k, v in res["idle_cpu_s"].items()))

    def one_stream_extras(self, r: int) -> None:
        """Round r of sections (2), (3) and (4), llama-server at --parallel 1."""
        for s in self.order(r):
            for p in self.prompts.take(self.a.prefill_tokens, self.a.prefill_reps):
                self.report.prefill(s.name, prefill_one(s, p))
            ttft = [asyncio.run(single(s, p, 2))["ttft_s"] or float("nan") for p in
                    self.prompts.take(self.a.short_tokens, self.a.ttft_reps)]
            self.report.ttft(s.name, ttft)
            self.say(f"round {r + 1} {s.name}: prefill {self.report.last_prefill(s.name)}, "
                     f"TTFT {self.a.short_tokens}-token median {statistics.median(ttft) * 1e3:.1f} ms")
        for s in self.pds:
            th = decode_threads(s)
            ids = self.prompts.chat_ids(self.prompts.take(self.a.prompt_tokens)[0])
            tok_s = offline_engine(self.model, th, ids, self.a.output_tokens, 3, self.a.cpus)
            self.report.offline(s.name, th, tok_s)
            self.say(f"round {r + 1} offline engine at {s.name}'s {th} decode thread(s): "
                     + ", ".join(f"{x:.1f}" for x in tok_s) + " tok/s")

    def run(self) -> None:
        levels = list(zip(self.a.levels, self.a.requests))
        self.total = len(self.pds) + len(levels) * self.a.rounds * (1 + len(self.pds)) \
            + self.a.rounds * (1 + 2 * len(self.pds))
        for p in self.pds:
            p.start()
            self.report.startup(p.name, p.ready_s, p.ready_text)
            self.say(f"{p.name} ready in {p.ready_s:.1f} s: {p.ready_text}")
        try:
            for c, n in levels:
                self.level(c, n)
                if c == 1:
                    for r in range(self.a.rounds):
                        self.one_stream_extras(r)
            self.report.affinity({s.name: s.affinity() for s in [self.llama, *self.pds]})
        finally:
            for s in [self.llama, *self.pds]:
                s.stop()


def llama_binary() -> str:
    """bench/build_llama_server.sh's cached binary (never builds: that takes ~10 minutes)."""
    import platform
    import re
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "pdserve/llama-server" / f"{platform.machine()}-{re.sub('[^A-Za-z0-9]', '_', cpu)}" / "llama-server"
    if not path.is_file():
        raise SystemExit(f"no llama-server at {path}: build it first (bench/build_llama_server.sh)")
    return str(path)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--cpus", default="0,1", help="every process of both servers runs on these cores")
    a("--rounds", type=int, default=2)
    a("--concurrency", default="1,4,16,32,64")
    a("--requests", default="3,4,16,32,64", help="requests per concurrency level")
    a("--prompt-tokens", type=int, default=96)
    a("--output-tokens", type=int, default=128)
    a("--prefill-tokens", type=int, default=1024)
    a("--prefill-reps", type=int, default=2)
    a("--short-tokens", type=int, default=64)
    a("--ttft-reps", type=int, default=5)
    a("--pdserve", action="append", default=[], metavar="NAME=ARGS",
      help="a pdserve up variant (repeatable): its name and extra `pdserve up` arguments, "
           "e.g. 'd2=--decode-threads 2' (default: one, 'pdserve', up's defaults)")
    a("--llama-threads", type=int, default=0, help="llama-server -t (0: len(--cpus))")
    a("--llama-args", default="", help="more llama-server arguments, e.g. '--poll 0' (its "
      "threads then sleep instead of spinning: on a machine shared with other work)")
    a("--llama-bin", default="", help="llama-server (default: bench/build_llama_server.sh's)")
    a("--model", default="", help="a GGUF file (default: pdserve's default model)")
    a("--quick", action="store_true", help="levels 1,4,16, few requests, one round")
    a("--log", default="", help="also write everything printed to this file")
    a("--offline-engine", default="", help=argparse.SUPPRESS)
    a("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a("--reps", type=int, default=3, help=argparse.SUPPRESS)
    a("--prompt-ids", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.rounds = "1,4,16", "2,4,16", 1
        args.output_tokens, args.prefill_reps, args.ttft_reps = 32, 1, 2
    args.levels = [int(x) for x in args.concurrency.split(",")]
    args.requests = [int(x) for x in args.requests.split(",")]
    if len(args.levels) != len(args.requests):
        ap.error("--concurrency and --requests need as many values")
    args.pdserve = [(v.partition("=")[0], v.partition("=")[2].split()) for v in args.pdserve] \
        or [("pdserve", [])]
    args.llama_threads = args.llama_threads or len(args.cpus.split(","))
    return args


def main(argv=None) -> int:
    a = parse(argv)
    os.sched_setaffinity(0, [int(x) for x in a.cpus.split(",")])   # both trees inherit it
    if a.offline_engine:
        return offline_main(a)
    if a.log:
        from bench.vs_llama_report import tee_stdout
        tee_stdout(a.log)
    if not a.model:
        from pdserve.default_model import resolve_default_model
        a.model = str(resolve_default_model())
    else:
        a.pdserve = [(n, ["--model", a.model, *args]) for n, args in a.pdserve]
    a.llama_bin = a.llama_bin or llama_binary()
    log_dir = Path(tempfile.mkdtemp(prefix="vs-llama-"))
    bench = Bench(a, a.model, log_dir)
    print(bench.report.header(bench.llama.version(), log_dir), flush=True)
    try:
        bench.run()
    finally:                     # what was measured is printed even when a step failed
        print(bench.report.tables(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
