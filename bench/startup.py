"""Start-up of `pdserve up` to its ready line, checkouts side by side, rounds alternating.

    python bench/startup.py [--rounds 3] [--variant NAME=DIR ...] [--model PATH] [-- up args]

Each variant is a pdserve checkout (default: this one, "this"); `--variant before=DIR` adds
another (e.g. `git archive main | tar -x -C DIR`). Each round starts every variant once, in
turn: `python -m pdserve.cli up --grpc-port 0 --http-port 0` (1P1D, the default model unless
`--model`), timed from the spawn to its "pdserve ready:" line on stdout, then SIGTERM.

The table, per (process, phase), the median over rounds per variant:
  * "server / to ready": the wall time a user waits (pdserve: to the ready line;
    `--llama-server BIN`: llama.cpp's server on the same GGUF, to /health answering 200);
  * "<process> / loaded" and "/ ready": the launcher's own lines ("loaded in X s, warming
    up", "ready in X s": from its spawn of that process);
  * "<process> / <phase>": the process's own "start-up:" line (services/startup_log.py:
    imports, config, weights, tokenizer, kv cache + kernels, ..., warm-up), where the
    checkout logs one (older ones do not: "-").
With --first-request (REST on a free port): once ready, the time to the first streamed token
of one chat request (a ~100-token prompt, 8 tokens out), then of FIRST_REQUEST_WARM more:
"client / first request TTFT" beside "client / warm TTFT (median)" (no cold start for the
first request: the first within ~1.5x the warm).
With --cold-cache the variant's pdserve caches beside the model (the GGUF header cache and
the built model and the prefill warm-up's cost: engine/gguf_cache.py,
engine/build_cache.py) are removed before each start.
No timing here is asserted anywhere: this is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = "pdserve ready:"
READY_KEY = "server / to ready (pdserve: its ready line; llama-server: /health 200)"
LAUNCHER = re.compile(r"pdserve up: (?P<proc>[\w ]+?): (?:loaded in (?P<loaded>[\d.]+) s|"
                      r"ready in (?P<ready>[\d.]+) s)")
PHASES = re.compile(r"start-up \((?P<who>[^)]*)\): (?P<body>.*?); ready (?P<age>[\d.]+) s after exec")
PHASE = re.compile(r"(?P<name>[^,]+?) (?P<s>[\d.]+) s")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--model", default="", help="pdserve up --model (default: its default)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to the ready line")
    p.add_argument("--cold-cache", action="store_true",
                   help="remove the model's pdserve caches before each start")
    p.add_argument("--llama-server", default="", metavar="BIN",
                   help="also start llama.cpp's llama-server (bench/build_llama_server.sh) on "
                        "the same GGUF each round: -t 2 -cb --parallel 32 -c 32768")
    p.add_argument("--first-request", action="store_true",
                   help="time the first chat request after the ready line against warm ones")
    p.add_argument("up_args", nargs="*", help="more `pdserve up` arguments (after --)")
    return p.parse_args(argv)


def variants(args) -> list[tuple[str, Path]]:
    here = Path(__file__).resolve().parent.parent
    out = [("this", here)]
    for v in args.variant:
        name, _, path = v.partition("=")
        out.append((name, Path(path).resolve()))
    return out


def _reader(stream, lines: list, ready: threading.Event, t0: float) -> None:
    for raw in stream:
        line = raw.rstrip("\n")
        lines.append((time.perf_counter() - t0, line))
        if line.startswith(READY):
            ready.set()


def one_start(root: Path, args) -> dict[str, float]:
    """One `pdserve up` from checkout `root`: {READY_KEY: s, ...}."""
    http_port = _free_port() if args.first_request else 0
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--grpc-port", "0", "--http-port", str(http_port),
           *(["--model", args.model] if args.model else []), *args.up_args]
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True)
    out, err, ready = [], [], threading.Event()
    readers = [threading.Thread(target=_reader, args=(s, lines, ready, t0), daemon=True)
               for s, lines in ((p.stdout, out), (p.stderr, err))]
    for r in readers:
        r.start()
    try:
        if not ready.wait(args.timeout) or p.poll() is not None:
            tail = "\n".join(line for _, line in err[-30:])
            raise SystemExit(f"{root}: no ready line within {args.timeout:g} s:\n{tail}")
        took = next(t for t, line in out if line.startswith(READY))
        ready_line = next(line for _, line in out if line.startswith(READY))
        client = first_requests(http_port, ready_line) if http_port else {}
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        for r in readers:
            r.join(5)
    return {READY_KEY: took, **client, **phases_of([line for _, line in err])}


FIRST_REQUEST_WARM = 3
PROMPT = ("Summarise in one line why a server that loads quickly matters to the people who run "
          "it: restarts after a crash, rolling upgrades, scaling out under a burst of traffic, "
          "and tests that start a whole system many times a day all wait for it, and every "
          "second of that wait is a second in which requests queue or are refused. ")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ttft(url: str, model: str, i: int) -> float:
    """One request's TTFT; `i` heads its prompt (no request hits another's prefix cache)."""
    import httpx
    body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"{i}. {PROMPT}"}]}
    t0 = time.perf_counter()
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line.replace(" ", ""):
                return time.perf_counter() - t0
    raise SystemExit(f"{url}: no content streamed")


def first_requests(http_port: int, ready_line: str) -> dict[str, float]:
    """TTFT of the first chat request after the ready line, and the median of the warm ones."""
    model = re.search(r" id=(\S+)", ready_line)[1]
    url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
    seed = time.time_ns() % 10**6
    first = _ttft(url, model, seed)
    warm = statistics.median(_ttft(url, model, seed + i) for i in range(1, 1 + FIRST_REQUEST_WARM))
    return {"client / first request TTFT": first, "client / warm TTFT (median)": warm,
            "client / first / warm": first / warm}


def phases_of(lines: list[str]) -> dict[str, float]:
    """The launcher's per-process lines and each process's own start-up line."""
    got: dict[str, float] = {}
    for line in lines:
        if m := LAUNCHER.search(line):
            what = "loaded (launcher)" if m["loaded"] else "ready (launcher)"
            got[f"{m['proc']} / {what}"] = float(m["loaded"] or m["ready"])
        elif m := PHASES.search(line):
            proc = _process_of(m["who"])
            for ph in PHASE.finditer(m["body"]):
                got[f"{proc} / {ph['name'].strip()}"] = float(ph["s"])
            got[f"{proc} / ready after exec"] = float(m["age"])
    return got


def _process_of(who: str) -> str:
    """The launcher's name of a process: "prefill 0" for worker id "prefill-0"."""
    m = re.fullmatch(r"(.*?)-?(prefill|decode)-(\d+)", who)
    return " ".join(x for x in m.groups() if x) if m else who


def clear_caches(model: str) -> None:
    import hashlib

    from engine.config import cache_dir
    from engine.gguf import find_gguf
    from engine.gguf_cache import remove_caches     # this checkout's idea of where they are
    if (f := find_gguf(model)) is not None:
        remove_caches(f)
    who = hashlib.sha256(str(Path(f or model).resolve()).encode()).hexdigest()[:12]
    for e in (cache_dir() / "built").glob(f"*-{who}-*"):     # engine/build_cache.py's entries
        e.unlink(missing_ok=True)


def llama_start(binary: Path, gguf: str, args) -> dict[str, float]:
    """One llama-server start on `gguf`: seconds to its /health answering 200 (and, with
    --first-request, the same client requests as pdserve's)."""
    import httpx
    port = _free_port()
    cmd = [str(binary), "-m", gguf, "-t", "2", "-cb", "--parallel", "32", "-c", "32768",
           "--host", "127.0.0.1", "--port", str(port)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL)
    try:
        while True:
            if p.poll() is not None or time.perf_counter() - t0 > args.timeout:
                raise SystemExit(f"llama-server: not healthy within {args.timeout:g} s")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)        # a bounded poll: the server binds its port, then loads
        took = time.perf_counter() - t0
        client = first_requests(port, " id=default") if args.first_request else {}
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    return {READY_KEY: took, **client}


def table(results: dict[str, list[dict[str, float]]]) -> str:
    names = list(results)
    keys: list[str] = []
    for runs in results.values():
        for run in runs:
            keys += [k for k in run if k not in keys]
    keys.sort(key=lambda k: (k.split(" / ")[0] not in ("server", "client"), k.split(" / ")[0]))
    head = ["process", "phase", *[f"{n} (s, median of {len(results[n])})" for n in names]]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for k in keys:
        proc, phase = k.split(" / ", 1)
        cells = []
        for n in names:
            vals = [r[k] for r in results[n] if k in r]
            cells.append(f"{statistics.median(vals):.2f}" if vals else "-")
        rows.append(f"| {proc} | {phase} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's engine
    vs = variants(args)
    model = args.model
    if args.cold_cache and not model:
        from pdserve.default_model import resolve_default_model
        model = str(resolve_default_model())
    results: dict[str, list[dict[str, float]]] = {n: [] for n, _ in vs}
    gguf = ""
    if args.llama_server:
        from engine.gguf import find_gguf
        from pdserve.default_model import resolve_default_model
        gguf = str(find_gguf(model or str(resolve_default_model())))
        vs.append(("llama-server", Path(args.llama_server)))
        results["llama-server"] = []
    for rnd in range(args.rounds):
        for name, root in vs:
            if args.cold_cache:
                clear_caches(model)
            run = llama_start(root, gguf, args) if name == "llama-server" else one_start(root, args)
            results[name].append(run)
            print(f"round {rnd + 1} {name}: ready line after "
                  f"{run[READY_KEY]:.2f} s", flush=True)
    print(f"\npdserve up (1P1D unless told), {args.model or 'the default model'}, load average "
          f"{open('/proc/loadavg').read().split()[0]} at the end, "
          f"{args.rounds} rounds alternating {', '.join(n for n, _ in vs)}"
          f"{' (caches removed before each start)' if args.cold_cache else ''}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
