"""Start-up of `pdserve up` to its ready line, checkouts side by side, rounds alternating.

    python bench/startup.py [--rounds 3] [--variant NAME=DIR ...] [--model PATH] [-- up args]

Each variant is a pdserve checkout (default: this one, "this"); `--variant before=DIR` adds
another (e.g. `git archive main | tar -x -C DIR`). Each round starts every variant once, in
turn: `python -m pdserve.cli up --grpc-port 0 --http-port 0` (1P1D, the default model unless
`--model`), timed from the spawn to its "pdserve ready:" line on stdout, then SIGTERM.

The table, per (process, phase), the median over rounds per variant:
  * "pdserve up / to ready line": the wall time a user waits;
  * "<process> / loaded" and "/ ready": the launcher's own lines ("loaded in X s, warming
    up", "ready in X s": from its spawn of that process);
  * "<process> / <phase>": the process's own "start-up:" line (services/startup_log.py:
    imports, config, weights, tokenizer, kv cache + kernels, ..., warm-up), where the
    checkout logs one (older ones do not: "-").
With --cold-cache the variant's pdserve caches beside the model (the GGUF header cache and
the repacked weights: engine/gguf_cache.py) are removed before each start.
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
    """One `pdserve up` from checkout `root`: {"pdserve up / to ready line": s, ...}."""
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--grpc-port", "0", "--http-port", "0",
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
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        for r in readers:
            r.join(5)
    return {"pdserve up / to ready line": took, **phases_of([line for _, line in err])}


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
    from engine.gguf import find_gguf
    from engine.gguf_cache import remove_caches     # this checkout's idea of where they are
    if (f := find_gguf(model)) is not None:
        remove_caches(f)


def table(results: dict[str, list[dict[str, float]]]) -> str:
    names = list(results)
    keys: list[str] = []
    for runs in results.values():
        for run in runs:
            keys += [k for k in run if k not in keys]
    keys.sort(key=lambda k: (k.split(" / ")[0] != "pdserve up", k.split(" / ")[0]))
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
    vs = variants(args)
    model = args.model
    if args.cold_cache and not model:
        from pdserve.default_model import resolve_default_model
        model = str(resolve_default_model())
    results: dict[str, list[dict[str, float]]] = {n: [] for n, _ in vs}
    for rnd in range(args.rounds):
        for name, root in vs:
            if args.cold_cache:
                clear_caches(model)
            run = one_start(root, args)
            results[name].append(run)
            print(f"round {rnd + 1} {name}: ready line after "
                  f"{run['pdserve up / to ready line']:.2f} s", flush=True)
    print(f"\npdserve up (1P1D unless told), {args.model or 'the default model'}, "
          f"{args.rounds} rounds alternating {', '.join(n for n, _ in vs)}"
          f"{' (caches removed before each start)' if args.cold_cache else ''}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
