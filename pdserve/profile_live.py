"""`pdserve profile --from-url URL`: refresh a profile's prefill and decode costs from a running
pdserve, without stopping anything.

    scrape URL/metrics (the gateway's, which merges its workers'; a worker's own works too)
    wait --window-s, scrape again; the difference of the step counters of
    services/step_metrics.py is what the workers computed in the window (0: one scrape,
    everything since they started, their warm-up included)
    each (kind, bucket) with >= --min-steps steps becomes one point: its mean step seconds at
    its mean tokens / requests / context (the cost models are linear in these, so a bucket's
    mean is a point of the model)
    the live points replace the --base profile's points of the same kind in the range they
    cover; the base's points outside it, its handover, gateway cost, KV, model and machine
    are kept. Without --base: no handover, no gateway cost, KV from the workers' gauges.
"""
from __future__ import annotations

import sys
import time
import urllib.request
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from services.step_metrics import NAMES
from sim.profile import SCHEMA, Profile

from .profile_report import pdserve_version, print_summary

PREFIXES = ("pdserve:", "vllm:")
SCRAPE_TIMEOUT_S = 10.0


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def parse(text: str) -> tuple[dict, int]:
    """{(kind, bucket): [steps, seconds, tokens, requests, context]} summed over the workers,
    and the smallest KV block count a worker reports (0: none)."""
    sums: dict[tuple[str, int], list[float]] = {}
    blocks = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = next((s.name[len(p):] for p in PREFIXES if s.name.startswith(p)), None)
            if name is None:
                continue
            if name == "kv_cache_blocks":
                blocks.append(int(s.value))
                continue
            base = name.removesuffix("_total")
            if base not in NAMES or not name.endswith("_total"):
                continue
            key = (s.labels["kind"], int(s.labels["bucket"]))
            sums.setdefault(key, [0.0] * len(NAMES))[NAMES.index(base)] += s.value
    return sums, min(blocks, default=0)


def scrape(url: str) -> tuple[dict, int]:
    with urllib.request.urlopen(metrics_url(url), timeout=SCRAPE_TIMEOUT_S) as r:
        return parse(r.read().decode())


def delta(after: dict, before: dict) -> dict:
    """What was added between two scrapes (a bucket that went down: a restarted worker, so
    its whole later value is new)."""
    out = {}
    for key, vals in after.items():
        old = before.get(key, [0.0] * len(vals))
        out[key] = vals if vals[0] < old[0] else [a - b for a, b in zip(vals, old)]
    return out


def live_points(sums: dict, min_steps: int) -> dict[str, list[dict]]:
    """The profile points of each kind from the buckets with enough steps."""
    points = {"prefill": [], "decode": []}
    for (kind, bucket), (steps, seconds, tokens, requests, context) in sorted(sums.items()):
        if steps < max(min_steps, 1) or seconds <= 0:
            continue
        mean = lambda v: round(v / steps, 2)            # noqa: E731
        if kind == "prefill":
            p = {"chunk_tokens": mean(tokens), "cached_tokens": mean(context)}
        elif kind == "decode":
            p = {"batch": mean(requests), "context_tokens": mean(context)}
        else:
            continue
        p.update(seconds=seconds / steps, steps=int(steps), bucket=bucket, source="live")
        points[kind].append(p)
    return points


def merge(live: list[dict], base: list[dict], key: str) -> list[dict]:
    """The live points, and the base's outside the range of `key` the live ones cover."""
    if not live:
        return list(base)
    lo, hi = min(p[key] for p in live), max(p[key] for p in live)
    return live + [p for p in base if not lo <= p[key] <= hi]


def refreshed(base: Profile | None, points: dict, num_blocks: int, info: dict) -> Profile:
    """A profile whose prefill and decode points are the live ones merged into `base`'s."""
    if base is None:
        missing = [k for k in ("prefill", "decode") if not points[k]]
        if missing:
            raise ValueError(f"no live {' or '.join(missing)} steps to fit (and no --base): "
                             "send traffic, widen --window-s or lower --min-steps")
        base = Profile(schema=SCHEMA, pdserve_version="", created_unix=0.0, machine={}, model={},
                       options={}, prefill=points["prefill"], decode=points["decode"],
                       handover=[], gateway_s=0.0,
                       kv={"block_size": 16, "num_blocks": num_blocks, "block_size_assumed": True},
                       threads=0)
    options = {**base.options, "live": info}
    return replace(base, schema=SCHEMA, pdserve_version=pdserve_version(),
                   created_unix=round(time.time(), 3), options=options,
                   prefill=merge(points["prefill"], base.prefill, "chunk_tokens"),
                   decode=merge(points["decode"], base.decode, "batch"))


def refresh(args) -> int:
    """The command: scrape (twice, --window-s apart), merge into --base, write --out."""
    base = Profile.load(args.base) if args.base else None
    try:
        before, _ = scrape(args.from_url) if args.window_s > 0 else ({}, 0)
        if args.window_s > 0:
            print(f"pdserve profile: watching {metrics_url(args.from_url)} for "
                  f"{args.window_s:g}s", file=sys.stderr, flush=True)
            time.sleep(args.window_s)
        after, num_blocks = scrape(args.from_url)
    except OSError as e:
        raise SystemExit(f"pdserve profile: cannot read {metrics_url(args.from_url)}: {e}")
    sums = delta(after, before)
    points = live_points(sums, args.min_steps)
    info = {"url": args.from_url, "window_s": args.window_s, "scraped_unix": round(time.time(), 3),
            "steps": {k: int(sum(v[0] for (kind, _), v in sums.items() if kind == k))
                      for k in ("prefill", "decode")}}
    try:
        prof = refreshed(base, points, num_blocks, info)
    except ValueError as e:
        raise SystemExit(f"pdserve profile: {e}")
    prof.save(args.out)
    for kind in ("prefill", "decode"):
        if not points[kind]:
            print(f"pdserve profile: no live {kind} bucket with >= {args.min_steps} steps: "
                  f"the base's {kind} points are kept", file=sys.stderr)
    print_summary(prof, sys.stdout)
    print(f"wrote {args.out} ({len(points['prefill'])} live prefill and "
          f"{len(points['decode'])} live decode points)")
    return 0
