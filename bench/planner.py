"""The planner's accuracy, measured: the simulator's prediction (sim.system.simulate on a
profile measured here) against `pdserve bench --json` on real `pdserve up` systems, cell by
cell, for exactly the same requests.

    python bench/planner.py [--quick] [--model M] [--configs 1P1D,1P2D,2P1D,2P2D]
                            [--traces bench/traces/chat.jsonl,bench/traces/longdoc.jsonl]
                            [--window 45] [--factors 0.5,1,1.5] [--profiles DIR]

  1. profile: `pdserve profile` once per thread split the configurations use (threads per
     worker as `pdserve up` gives them on this machine: UpConfig.threads, the prefill workers
     splitting every core, the decode workers half of them). No process is pinned: every
     worker, the gateway and the load generator share all the cores, as `pdserve up` runs
     them; the simulator models that as processor sharing over --cores.
  2. SLOs per trace (unless given): 3x the profile's prefill time of the trace's p90 prompt,
     and 3x its decode step at a batch of 4 (a loaded but not saturated worker).
  3. capacity per configuration and trace: the highest rate at which the simulator has
     --attainment of the requests meeting both SLOs (pdserve.plan.capacity, bisection);
     the cell rates are --factors times it (below, near, above capacity).
  4. each cell's requests: the trace rescaled to the cell's rate, cut to its first --window
     seconds of arrivals (longer where that holds fewer than --min-requests), written to a file that both the simulator and `pdserve bench
     --trace` read (bench's --seed differs per cell, so no prompt text repeats across cells).
  5. each configuration started once (`pdserve up --prefill P --decode D`); its cells run in
     order of rate, the traces alternating.
  6. the table: predicted vs measured TTFT p50/p90, ITL p50, throughput, goodput, the error
     |predicted - measured| / measured per figure, their median, the worst cell, and whether
     the configuration the planner ranks first (the highest predicted goodput per worker over
     its cells) is the measured best, or within 5% of it.

`--quick` (a smoke check): the first configuration and trace, one rate (near capacity), 20 s,
the profile's quick grid.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve import plan  # noqa: E402
from pdserve.processes import free_port  # noqa: E402
from services.worker_config import available_cores  # noqa: E402
from sim.profile import Profile  # noqa: E402
from sim.trace import read_trace, write_trace  # noqa: E402
from sim.workload import Workload, mean_rate, scale  # noqa: E402

FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "throughput_tok_s", "goodput_rps")
TRACES = "bench/traces/chat.jsonl,bench/traces/longdoc.jsonl"
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f} s] {msg}", flush=True)


def parse_config(s: str) -> tuple[int, int]:
    p, _, d = s.upper().partition("P")
    if not d.endswith("D") or not p.isdigit() or not d[:-1].isdigit():
        raise argparse.ArgumentTypeError(f"a configuration is like 1P2D, got {s!r}")
    return int(p), int(d[:-1])


def pdserve(*argv: str) -> list[str]:
    return [sys.executable, "-m", "pdserve", *argv]


def measure_profile(model: str, threads: tuple[int, int], out: Path, quick: bool,
                    repeat: int = 0) -> Profile:
    """`pdserve profile` for one thread split (reused when `out` exists)."""
    if not out.exists():
        say(f"profile: prefill {threads[0]} thread(s), decode {threads[1]} -> {out}")
        argv = pdserve("profile", "--out", str(out), "--prefill-threads", str(threads[0]),
                       "--decode-threads", str(threads[1]), *(["--model", model] if model else []),
                       *(["--quick"] if quick else []),
                       *(["--repeat", str(repeat)] if repeat else []))
        subprocess.run(argv, cwd=ROOT, check=True, timeout=1800)
    return Profile.load(out)


def slos(profile: Profile, trace, args) -> tuple[float, float]:
    """The SLOs of one trace: given, else derived from the profile (module docstring, 2)."""
    lengths = sorted(r.input_length for r in trace)
    p90 = lengths[int(0.9 * (len(lengths) - 1))]
    ctx = int(statistics.median(r.input_length + r.output_length / 2 for r in trace))
    chunk = int(profile.options.get("max_num_batched_tokens", 2048))
    prefill = sum(profile.prefill_s(min(chunk, p90 - c), c) for c in range(0, p90, chunk))
    ttft = args.slo_ttft_ms or round(3000 * prefill)
    itl = args.slo_itl_ms or round(3000 * profile.decode_s(4, 4 * ctx), 1)
    return ttft, itl


def cell_trace(trace, rate: float, window_s: float) -> list:
    """The trace at `rate` req/s, from its first arrival, cut to `window_s` s of arrivals."""
    t0 = min(r.timestamp_ms for r in trace)
    shifted = [r.__class__(r.timestamp_ms - t0, r.input_length, r.output_length, r.hash_ids)
               for r in trace]
    return [r for r in scale(shifted, rate / mean_rate(shifted)) if r.timestamp_ms < window_s * 1e3]


def plan_cells(args, profiles: dict, traces: dict, cores: float) -> list[dict]:
    """Every cell: its configuration, trace, rate, SLOs, requests and the prediction."""
    cells = []
    for p, d in args.configs:
        prof = profiles[plan.threads_for(p, d, cores)]
        cand = plan.candidates(1, cores)[0]      # the engine's default settings
        cand = plan.Candidate(p, d, cand.settings, dict(zip(("prefill", "decode"),
                                                            plan.threads_for(p, d, cores))))
        for name, trace in traces.items():
            slo = slos(prof, trace, args)
            cap = plan.capacity(prof, cand, Workload(trace=tuple(trace)), cores=cores, slo=slo,
                                attainment=args.attainment)
            say(f"{p}P{d}D {name}: SLOs TTFT {slo[0]:g} ms ITL {slo[1]:g} ms; predicted "
                f"capacity {cap:.3f} req/s")
            for f in args.factors:
                rate = max(cap, 1e-3) * f
                reqs = cell_trace(trace, rate, max(args.window, args.min_requests / rate))
                if not reqs:
                    continue
                c = plan.Candidate(p, d, cand.settings, cand.threads)
                plan.evaluate(prof, c, Workload(trace=tuple(reqs)), cores=cores, slo=slo)
                cells.append({"config": (p, d), "trace": name, "factor": f, "rate": rate,
                              "slo": slo, "requests": reqs, "predicted": c.summary})
    order = {f: i for i, f in enumerate(args.factors)}
    names = list(traces)
    cells.sort(key=lambda c: (args.configs.index(c["config"]), order[c["factor"]],
                              names.index(c["trace"])))
    return cells


class System:
    """`pdserve up --prefill P --decode D` on free ports; stopped (SIGINT, then kill) on exit."""

    def __init__(self, p: int, d: int, model: str, logdir: Path, ready_s: float = 600.0):
        self.http = free_port()
        self.log = logdir / f"up-{p}P{d}D.log"
        argv = pdserve("up", "--prefill", str(p), "--decode", str(d), "--grpc-port",
                       str(free_port()), "--http-port", str(self.http),
                       *(["--model", model] if model else []))
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_s
        while "pdserve ready:" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve up {p}P{d}D did not start: see {self.log}")
            time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def bench(url: str, cell: dict, path: Path, seed: int, timeout_s: float) -> dict:
    write_trace(path, cell["requests"])
    argv = pdserve("bench", "--url", url, "--trace", str(path), "--json", "--no-progress",
                   "--seed", str(seed), "--slo-ttft-ms", str(cell["slo"][0]),
                   "--slo-itl-ms", str(cell["slo"][1]))
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"pdserve bench failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def measure(cells: list[dict], args, logdir: Path) -> None:
    seed = 100
    for cfg in args.configs:
        mine = [c for c in cells if c["config"] == cfg]
        if not mine:
            continue
        say(f"starting pdserve up --prefill {cfg[0]} --decode {cfg[1]}")
        system = System(*cfg, args.model, logdir)
        try:
            for c in mine:
                seed += 1
                say(f"  {cfg[0]}P{cfg[1]}D {c['trace']} x{c['factor']:g} ({c['rate']:.3f} "
                    f"req/s, {len(c['requests'])} requests) ...")
                c["measured"] = bench(system.url, c, logdir / f"cell-{seed}.jsonl", seed,
                                      timeout_s=args.window * 20 + 600)
                m = c["measured"]
                say(f"    measured TTFT p50 {m['ttft_p50_ms']} ms, ITL p50 {m['itl_p50_ms']} "
                    f"ms, goodput {m['goodput_rps']} req/s; predicted TTFT p50 "
                    f"{c['predicted']['ttft_p50_ms']} ms")
        finally:
            system.stop()


def error(pred, meas) -> float | None:
    """|predicted - measured| / measured; None where undefined (no figure, or 0 measured)."""
    if pred is None or meas is None:
        return None
    if meas == 0:
        return 0.0 if pred == 0 else None
    return abs(pred - meas) / abs(meas)


def _fmt(x, spec=".0f") -> str:
    return "-" if x is None else format(x, spec)


def report(cells: list[dict]) -> dict:
    """The table (markdown), the errors and the ranking verdict."""
    head = ["config", "trace", "rate req/s", "n"] + [f"{f} pred/meas (err)" for f in FIGURES]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    errs, worst = [], (None, -1.0)
    for c in cells:
        if "measured" not in c:
            continue
        row = [f"{c['config'][0]}P{c['config'][1]}D", c["trace"], f"{c['rate']:.3f}",
               str(len(c["requests"]))]
        for f in FIGURES:
            p, m = c["predicted"].get(f), c["measured"].get(f)
            e = error(p, m)
            spec = ".3f" if f == "goodput_rps" else ".1f" if f != "ttft_p50_ms" else ".0f"
            row.append(f"{_fmt(p, spec)} / {_fmt(m, spec)} ({_fmt(None if e is None else 100 * e)}%)")
            if e is not None:
                errs.append(e)
                if e > worst[1]:
                    worst = (f"{row[0]} {c['trace']} {c['rate']:.3f} req/s {f}", e)
        lines.append("| " + " | ".join(row) + " |")
    out = {"table": "\n".join(lines), "median_abs_error": statistics.median(errs) if errs else None,
           "worst": worst, "within_20pct": sum(e <= 0.2 for e in errs), "figures": len(errs)}
    out.update(ranking(cells))
    return out


def ranking(cells: list[dict]) -> dict:
    """The planner's first configuration (highest predicted goodput per worker over its cells)
    against the measured best (the same, measured)."""
    def best_per_worker(key: str) -> dict:
        out = {}
        for c in cells:
            if "measured" in c:
                p, d = c["config"]
                g = (c[key].get("goodput_rps") or 0.0) / (p + d)
                out[c["config"]] = max(out.get(c["config"], 0.0), g)
        return out
    pred, meas = best_per_worker("predicted"), best_per_worker("measured")
    if not meas:
        return {}
    first = max(pred, key=lambda k: (pred[k], -sum(k)))
    best = max(meas, key=lambda k: (meas[k], -sum(k)))
    return {"planner_first": first, "measured_best": best,
            "first_within_5pct": meas[first] >= 0.95 * meas[best],
            "goodput_per_worker": {f"{p}P{d}D": (pred[(p, d)], meas[(p, d)]) for p, d in meas}}


def print_report(r: dict, args, cores: float) -> None:
    print(f"\n### Planner validation: predicted vs measured ({cores:g} cores shared by every "
          f"process, unpinned; {args.window:g} s of arrivals per cell)\n", flush=True)
    print(r["table"])
    if r.get("median_abs_error") is None:
        print("\nno cell was measured")
        return
    print(f"\nmedian absolute error {100 * r['median_abs_error']:.1f}% over {r['figures']} "
          f"figures; {r['within_20pct']} within 20%; worst: {r['worst'][0]} "
          f"({100 * r['worst'][1]:.0f}%)")
    name = lambda k: f"{k[0]}P{k[1]}D"   # noqa: E731
    gpw = ", ".join(f"{k} {p:.3f}/{m:.3f}" for k, (p, m) in r["goodput_per_worker"].items())
    print(f"goodput per worker, best over the cells (predicted/measured): {gpw}")
    print(f"planner ranks first {name(r['planner_first'])}; measured best "
          f"{name(r['measured_best'])}: "
          + ("the same" if r["planner_first"] == r["measured_best"] else
             "within 5%" if r["first_within_5pct"] else "NOT within 5%"), flush=True)


def parse_args(argv=None):
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--quick", action="store_true", help="smoke: one config, one rate, 20 s")
    a.add_argument("--model", default="", help="model (default: pdserve up's default model)")
    a.add_argument("--configs", default="1P1D,1P2D,2P1D,2P2D")
    a.add_argument("--traces", default=TRACES)
    a.add_argument("--window", type=float, default=45.0, help="seconds of arrivals per cell")
    a.add_argument("--min-requests", type=int, default=4, help="a cell's window grows to "
                   "hold at least this many arrivals (at low rates)")
    a.add_argument("--factors", default="0.5,1,1.5", help="cell rates, times the capacity")
    a.add_argument("--slo-ttft-ms", type=float, default=0.0, help="(0: from the profile)")
    a.add_argument("--slo-itl-ms", type=float, default=0.0, help="(0: from the profile)")
    a.add_argument("--attainment", type=float, default=0.9)
    a.add_argument("--cores", type=float, default=0.0, help="(0: the cores this process has)")
    a.add_argument("--profile-repeat", type=int, default=0, help="`pdserve profile --repeat` "
                   "(0: its default)")
    a.add_argument("--profiles", default="", help="a directory to keep (and reuse) profiles")
    a.add_argument("--json-out", default="", help="also write every cell as JSON here")
    args = a.parse_args(argv)
    args.configs = [parse_config(s) for s in args.configs.split(",")]
    args.factors = [float(x) for x in args.factors.split(",")]
    args.traces = [t for t in args.traces.split(",") if t]
    if args.quick:
        args.configs, args.traces, args.factors = args.configs[:1], args.traces[:1], [1.0]
        args.window = min(args.window, 20.0)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cores = args.cores or float(available_cores())
    work = Path(tempfile.mkdtemp(prefix="pdserve-planner-"))
    pdir = Path(args.profiles) if args.profiles else work
    pdir.mkdir(parents=True, exist_ok=True)
    say(f"planner validation: configs {args.configs}, traces {args.traces}, factors "
        f"{args.factors}, {args.window:g} s per cell, {cores:g} cores; work dir {work}")
    splits = sorted({plan.threads_for(p, d, cores) for p, d in args.configs})
    profiles = {t: measure_profile(args.model, t, pdir / f"profile-p{t[0]}-d{t[1]}"
                                   f"{'-quick' if args.quick else ''}.json", args.quick,
                                   args.profile_repeat)
                for t in splits}
    traces = {Path(t).stem: read_trace(ROOT / t) for t in args.traces}
    cells = plan_cells(args, profiles, traces, cores)
    say(f"{len(cells)} cells predicted; measuring")
    measure(cells, args, work)
    r = report(cells)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            [{k: v for k, v in c.items() if k != "requests"} | {"n": len(c["requests"])}
             for c in cells], indent=1, default=str))
    print_report(r, args, cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
