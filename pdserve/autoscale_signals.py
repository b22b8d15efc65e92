"""What the autoscaler (pdserve/autoscale.py) reads: the gateway's /metrics (Prometheus text,
which merges every worker's, each sample labelled worker=ID), two scrapes apart.

    scrape k-1 ----- interval ----- scrape k          (each a `Snapshot`: cumulative values)
                \\                   /
                 `Signals.between`: the differences over the interval
                   rate_rps        arrivals: finished requests (success + errors) + the change
                                   in requests in flight, per second
                   input/output    prompt / generated tokens per finished request (means)
                   ttft / itl      mean and p90 of the gateway's histograms' increments
                                   (histogram_quantile's linear interpolation)
                   workers         per worker: role, running, waiting, KV use, queued tokens
                   steps           per worker: the increments of its step counters
                                   (services/step_metrics.py), for the measured step costs

A scrape that fails, or one that lacks a pool's metrics (no worker of a role that has
workers, a worker whose /metrics did not answer: worker_metrics_up 0), leaves the signals
`unknown` with the reason: the autoscaler holds, it never reads a missing pool as zero load.
Names are read under either prefix (`pdserve:` or `vllm:`, the gateway's --metrics-prefix).
"""
from __future__ import annotations

import math
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from services.step_metrics import NAMES as STEP_NAMES

PREFIXES = ("pdserve:", "vllm:")
SCRAPE_TIMEOUT_S = 5.0
WORKER_GAUGES = {"num_requests_running": "running", "num_requests_waiting": "waiting",
                 "kv_cache_usage_perc": "kv_usage", "prefill_queue_tokens": "queue_tokens"}
GATEWAY_COUNTERS = {"request_success_total": "success", "request_errors_total": "errors",
                    "prompt_tokens_total": "prompt_tokens",
                    "generation_tokens_total": "generation_tokens"}
HISTOGRAMS = {"time_to_first_token_seconds": "ttft", "inter_token_latency_seconds": "itl"}


class MetricsSource:
    """The gateway's /metrics at `url` (a base URL or the /metrics URL itself)."""

    def __init__(self, url: str, timeout_s: float = SCRAPE_TIMEOUT_S):
        url = url.rstrip("/")
        self.url = url if url.endswith("/metrics") else url + "/metrics"
        self.timeout_s = timeout_s

    def scrape(self) -> str:
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:
            return r.read().decode()


@dataclass
class Hist:
    """A histogram's cumulative buckets {le: count}, sum and count."""
    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0

    def minus(self, old: "Hist") -> "Hist":
        if self.count < old.count:          # a restarted gateway: all of it is new
            return self
        return Hist({le: c - old.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                    self.sum - old.sum, self.count - old.count)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket the rank falls in."""
        if self.count <= 0:
            return None
        rank, lo, below = q * self.count, 0.0, 0.0
        for le in sorted(self.buckets):
            c = self.buckets[le]
            if c >= rank:
                if math.isinf(le):
                    return lo
                return lo + (le - lo) * ((rank - below) / (c - below) if c > below else 1.0)
            lo, below = le, c
        return lo


@dataclass
class Snapshot:
    """One scrape, cumulative."""
    at: float                                              # monotonic seconds
    gateway: dict[str, float] = field(default_factory=dict)   # GATEWAY_COUNTERS + in_flight
    hists: dict[str, Hist] = field(default_factory=dict)
    workers: dict[str, dict] = field(default_factory=dict)    # id -> role, up, gauges
    steps: dict[str, dict] = field(default_factory=dict)      # id -> {(kind, bucket): [5]}

    @classmethod
    def parse(cls, text: str, at: float | None = None) -> "Snapshot":
        snap = cls(time.monotonic() if at is None else at)
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                name = next((s.name[len(p):] for p in PREFIXES if s.name.startswith(p)), None)
                if name is not None:
                    snap._add(name, s.labels, s.value)
        return snap

    def _add(self, name: str, labels: dict, value: float) -> None:
        worker = labels.get("worker")
        if worker is None:
            self._add_gateway(name, labels, value)
            return
        w = self.workers.setdefault(worker, {"role": "", "up": 1.0})
        if name == "worker_metrics_up":
            w["up"] = value
            return
        w["role"] = w["role"] or labels.get("role", "")
        if name in WORKER_GAUGES:
            w[WORKER_GAUGES[name]] = value
        elif name.endswith("_total") and name[:-len("_total")] in STEP_NAMES:
            key = (labels.get("kind", ""), int(labels.get("bucket", "0") or 0))
            row = self.steps.setdefault(worker, {}).setdefault(key, [0.0] * len(STEP_NAMES))
            row[STEP_NAMES.index(name[:-len("_total")])] += value

    def _add_gateway(self, name: str, labels: dict, value: float) -> None:
        if labels.get("role") != "gateway":
            return
        if name in GATEWAY_COUNTERS:
            key = GATEWAY_COUNTERS[name]
            self.gateway[key] = self.gateway.get(key, 0.0) + value
        elif name == "num_requests_running":
            self.gateway["in_flight"] = self.gateway.get("in_flight", 0.0) + value
        for base, key in HISTOGRAMS.items():
            if not name.startswith(base):
                continue
            h = self.hists.setdefault(key, Hist())
            if name == base + "_bucket":
                le = float(labels["le"])
                h.buckets[le] = h.buckets.get(le, 0.0) + value
            elif name == base + "_sum":
                h.sum += value
            elif name == base + "_count":
                h.count += value


@dataclass
class Signals:
    """The load over one interval (see the module docstring); `unknown`: why it cannot be
    read (empty: it can)."""
    interval_s: float = 0.0
    rate_rps: float = 0.0
    finished: float = 0.0
    in_flight: float = 0.0
    input_mean: float = 0.0
    output_mean: float = 0.0
    ttft_mean_s: float | None = None
    ttft_p90_s: float | None = None
    itl_mean_s: float | None = None
    itl_p90_s: float | None = None
    workers: dict[str, dict] = field(default_factory=dict)
    steps: dict[str, dict] = field(default_factory=dict)     # id -> {(kind, bucket): [5]}
    unknown: list[str] = field(default_factory=list)
    correction: dict = field(default_factory=dict)   # the autoscaler's: cost factors used
    plan: dict = field(default_factory=dict)         # the autoscaler's: the recommendation

    @classmethod
    def between(cls, old: Snapshot, new: Snapshot, pools: dict[str, int]) -> "Signals":
        """The signals of the interval from `old` to `new`; `pools`: the workers each role
        has now (a role with workers but none reporting is unknown)."""
        sig = cls(interval_s=max(new.at - old.at, 1e-9), workers=dict(new.workers))
        sig.unknown = missing(new, pools)
        g, o = new.gateway, old.gateway
        if "success" not in g and "in_flight" not in g:
            sig.unknown.append("the gateway's request metrics are missing from the scrape")
        d = {k: g.get(k, 0.0) - o.get(k, 0.0) for k in GATEWAY_COUNTERS.values()}
        if any(v < 0 for v in d.values()):        # the gateway restarted: counters anew
            d = {k: g.get(k, 0.0) for k in GATEWAY_COUNTERS.values()}
        sig.finished = d["success"] + d["errors"]
        sig.in_flight = g.get("in_flight", 0.0)
        arrived = sig.finished + sig.in_flight - o.get("in_flight", 0.0)
        sig.rate_rps = max(0.0, arrived) / sig.interval_s
        if d["success"] > 0:
            sig.input_mean = d["prompt_tokens"] / d["success"]
            sig.output_mean = d["generation_tokens"] / d["success"]
        for key in HISTOGRAMS.values():
            h = new.hists.get(key, Hist()).minus(old.hists.get(key, Hist()))
            setattr(sig, f"{key}_mean_s", h.mean())
            setattr(sig, f"{key}_p90_s", h.quantile(0.9))
        sig.steps = step_deltas(old, new)
        return sig


def missing(snap: Snapshot, pools: dict[str, int]) -> list[str]:
    """Why `snap` cannot stand for the pools (empty: it can)."""
    out = [f"worker {w} ({v['role'] or 'role unknown'}): its /metrics did not answer"
           for w, v in sorted(snap.workers.items()) if v.get("up", 1.0) < 1.0]
    for role, n in pools.items():
        seen = sum(1 for v in snap.workers.values() if v["role"] == role and v.get("up", 1.0) >= 1)
        if n > 0 and seen == 0:
            out.append(f"no {role} worker's metrics in the scrape ({n} running)")
    return out


def step_deltas(old: Snapshot, new: Snapshot) -> dict[str, dict]:
    """Per worker, what its step counters added between the scrapes (a worker absent from
    `old` or whose counters went down, a restart: none, its passes are cold)."""
    out = {}
    for worker, rows in new.steps.items():
        before = old.steps.get(worker)
        if before is None:
            continue
        d = {k: [a - b for a, b in zip(v, before.get(k, [0.0] * len(v)))] for k, v in rows.items()}
        if any(x[0] < 0 for x in d.values()):
            continue
        out[worker] = {k: v for k, v in d.items() if v[0] > 0}
    return out
