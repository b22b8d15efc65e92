"""The `pdserve plan` command line: its options, the workload they describe, the verdict
lines, the table or `--json`, the rate sweep and the `--plot` (pdserve/plan.py does the
search; pdserve/plan_plot.py draws)."""
from __future__ import annotations

import argparse
import json
import sys

from sim.workload import Workload, parse_lengths

from . import plan

LENGTHS_HELP = ("N (fixed), MEAN:SD (normal, clamped >= 1), or a file: a JSON histogram "
                "{\"edges\": [e0, ..., ek], \"counts\": [c1, ..., ck]} or one length per line")


def _floats(s: str) -> list[float]:
    try:
        xs = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of numbers, got {s!r}")
    if not xs or any(x <= 0 for x in xs):
        raise argparse.ArgumentTypeError(f"numbers > 0, got {s!r}")
    return xs


def _ints(s: str) -> list[int]:
    return [int(x) for x in _floats(s)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a profile from `pdserve profile` (JSON)")
    p.add_argument("--slo-ttft-ms", type=float, default=0.0, help="time-to-first-token SLO")
    p.add_argument("--slo-itl-ms", type=float, default=0.0,
                   help="inter-token latency SLO (a request's mean time per output token)")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="fraction of requests that must meet both SLOs (default 0.9)")
    p.add_argument("--max-workers", type=int, default=4, help="P + D at most (P = 0: "
                   "colocated, each decode worker prefills its own prompts)")
    w = p.add_argument_group("workload: a trace, or a rate with length distributions")
    w.add_argument("--trace", default="", help="a Mooncake-format trace (JSONL)")
    w.add_argument("--rate-scale", type=float, default=1.0, help="with --trace: arrivals "
                   "this many times as fast")
    w.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals, requests/s")
    w.add_argument("--input-tokens", default="", help="prompt lengths: " + LENGTHS_HELP)
    w.add_argument("--output-tokens", default="", help="output lengths, as --input-tokens")
    w.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    w.add_argument("--burstiness", type=float, default=1.0, help="coefficient of variation "
                   "of the gaps between arrivals (1: Poisson; >1: bursts, gamma gaps)")
    s = p.add_argument_group("search")
    s.add_argument("--cores", type=float, default=0.0, help="cores the whole system shares "
                   "(0: the profile's machine's)")
    s.add_argument("--max-num-seqs", type=_ints, default=list(plan.DEFAULT_MAX_NUM_SEQS),
                   help="per-worker decode batch bounds to try (comma-separated)")
    s.add_argument("--max-num-batched-tokens", type=_ints,
                   default=list(plan.DEFAULT_MAX_NUM_BATCHED_TOKENS),
                   help="per-worker step token budgets (prefill chunk) to try")
    s.add_argument("--seeds", type=int, default=0, help="simulations per candidate, a "
                   "synthetic workload drawn afresh for each (0: 3 for --rate, 1 for --trace)")
    s.add_argument("--admission", action="store_true", help="simulate the gateway's "
                   "admission control at the SLOs (`pdserve gateway --slo-ttft-ms ...`; "
                   "`pdserve up` runs without it)")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=8, help="rows of the table")
    o.add_argument("--json", action="store_true", help="one JSON object: best, candidates")
    o.add_argument("--rates", type=_floats, default=None, help="also simulate each P:D split "
                   "(its best settings) at these rates (req/s), for the plot and the JSON")
    o.add_argument("--plot", default="", help="write a PNG: goodput and latency against the "
                   "P:D split and the rate (needs matplotlib: pip install 'pdserve[plan]')")
    p.set_defaults(func=main)


def workload_from(args) -> Workload:
    from sim.trace import read_trace
    if args.trace:
        if args.rate:
            raise ValueError("give --trace or --rate, not both")
        records = read_trace(args.trace)
        if not records:
            raise ValueError(f"{args.trace}: no requests in it")
        return Workload(trace=tuple(records), rate_scale=args.rate_scale)
    if args.rate <= 0 or not args.input_tokens or not args.output_tokens:
        raise ValueError("give --trace FILE, or --rate R with --input-tokens and --output-tokens")
    return Workload(rate=args.rate, input=parse_lengths(args.input_tokens),
                    output=parse_lengths(args.output_tokens), duration_s=args.duration,
                    cv=args.burstiness)


def verdict(ranked: list[plan.Candidate], attainment: float) -> list[str]:
    best = ranked[0]
    if not best.meets(attainment):
        return [f"no configuration meets the SLOs for {attainment:.0%} of requests: the "
                f"closest, {best.name}, reaches {best.summary.get('slo_attainment') or 0:.0%}; "
                "raise --max-workers or loosen the SLOs"]
    lines = [f"best: {best.name} {best.settings}, goodput {best.goodput_per_worker:.3g} "
             f"req/s per worker"]
    if best.prefill == 0:
        split = next((c for c in ranked if c.prefill and c.meets(attainment)), None)
        other = (f"the best disaggregated, {split.name}, gives {split.goodput_per_worker:.3g}"
                 if split else "no disaggregated split meets the target")
        lines.append(f"colocated serving wins: {best.decode} worker(s) prefilling their own "
                     f"prompts ({other}); `pdserve up` starts disaggregated systems only")
    else:
        lines.append(f"run: pdserve up --prefill {best.prefill} --decode {best.decode} "
                     f"--max-num-seqs {best.settings['max_num_seqs']} --max-num-batched-tokens "
                     f"{best.settings['max_num_batched_tokens']}")
    return lines


def sweep(profile, ranked, workload, rates, attainment, **kw) -> list[dict]:
    """Each P:D split, with the settings ranked best for it, at each rate."""
    seen, rows = set(), []
    for c in ranked:
        if (c.prefill, c.decode) in seen:
            continue
        seen.add((c.prefill, c.decode))
        for r in rates:
            at = plan.Candidate(c.prefill, c.decode, c.settings, c.threads)
            plan.evaluate(profile, at, workload.at_rate(r), **kw)
            rows.append({"rate": r, **at.to_json(attainment)})
    return rows


def main(args) -> int:
    from sim.profile import Profile
    try:
        profile = Profile.load(args.profile)
        workload = workload_from(args)
    except (OSError, ValueError) as e:
        raise SystemExit(f"pdserve plan: {e}")
    args.seeds = args.seeds or (1 if args.trace else 3)
    if args.max_workers < 1 or not 0 < args.attainment <= 1 or args.seeds < 1:
        raise SystemExit("pdserve plan: --max-workers and --seeds must be >= 1, "
                         "--attainment in (0, 1]")
    cores = args.cores or plan.profile_cores(profile)
    slo = (args.slo_ttft_ms, args.slo_itl_ms)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if not args.json else None
    ranked = plan.search(profile, workload, max_workers=args.max_workers, cores=cores, slo=slo,
                         attainment=args.attainment, seeds=args.seeds,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         admission=args.admission, progress=say)
    kw = dict(cores=cores, slo=slo, seeds=args.seeds, admission=args.admission)
    rows = sweep(profile, ranked, workload, args.rates, args.attainment, **kw) if args.rates else []
    if args.plot:
        from .plan_plot import plot
        plot(args.plot, ranked, rows, workload.mean_rate, args.attainment)
    if args.json:
        print(json.dumps(report(ranked, rows, workload, cores, args), indent=1))
        return 0
    print(f"workload: {workload.describe()}; {cores:g} cores; SLOs TTFT <= "
          f"{args.slo_ttft_ms:g} ms, ITL <= {args.slo_itl_ms:g} ms for "
          f"{args.attainment:.0%} of requests")
    print(plan.table(ranked, args.attainment, args.top))
    for line in verdict(ranked, args.attainment):
        print(line)
    return 0


def report(ranked, rows, workload, cores, args) -> dict:
    best = ranked[0].to_json(args.attainment)
    return {"best": best, "colocated_wins": best["prefill"] == 0 and best["meets_attainment"],
            "verdict": verdict(ranked, args.attainment),
            "workload": {"describe": workload.describe(), "mean_rate": workload.mean_rate},
            "cores": cores, "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms,
            "attainment": args.attainment,
            "candidates": [c.to_json(args.attainment) for c in ranked], "sweep": rows}
