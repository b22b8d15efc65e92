"""A stand-in for pdserve/autoscale.py (issue 30 I2, branch i30-scale) until that lands: the
same names and shapes (`Decision`, `Actuator`, `Autoscaler(cfg, source, actuator, profile)`
with `.step()`, `.run(stop_event)`, `.state()`, `/plan`), with a deliberately simple rule, so
`pdserve planner` (pdserve/planner_k8s.py) can be built and tested against the interface.
Delete it when i30-scale is merged and import `pdserve.autoscale` instead.

The rule: the gateway's mean TTFT and ITL since the last scrape (histogram sum/count
deltas); TTFT over its SLO adds a prefill worker, else ITL over its SLO adds a decode worker,
never above `max_workers`; a scrape that fails or has no new requests holds ("unknown" or
"idle", never read as zero load). No scale-down, no hysteresis: that is i30-scale's.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

TTFT = "pdserve:time_to_first_token_seconds"
ITL = "pdserve:inter_token_latency_seconds"
HISTORY = 50


@dataclass
class AutoscaleConfig:
    slo_ttft_ms: float = field(default=1000.0, metadata={"help": "TTFT SLO (ms)"})
    slo_itl_ms: float = field(default=100.0, metadata={"help": "inter-token latency SLO (ms)"})
    max_workers: int = field(default=4, metadata={"help": "budget: prefill + decode workers"})
    interval_s: float = field(default=10.0, metadata={"help": "seconds between decisions"})


@dataclass
class Decision:
    prefill: int
    decode: int
    reasons: list[str]
    signals: dict
    at_unix: float


class Actuator(Protocol):
    def current(self) -> tuple[int, int]: ...

    def scale(self, prefill: int, decode: int) -> None: ...


class MetricsSource:
    """The gateway's /metrics: (sum, count) of the TTFT and ITL histograms, cumulative."""

    def __init__(self, url: str, timeout_s: float = 5.0, context=None):
        self.url, self.timeout_s, self.context = url.rstrip("/") + "/metrics", timeout_s, context

    def read(self) -> dict[str, tuple[float, float]]:
        with urllib.request.urlopen(self.url, timeout=self.timeout_s, context=self.context) as r:
            text = r.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            if fam.name in (TTFT, ITL):
                s = sum(x.value for x in fam.samples if x.name.endswith("_sum"))
                n = sum(x.value for x in fam.samples if x.name.endswith("_count"))
                out[fam.name] = (s, n)
        return out


class Autoscaler:
    def __init__(self, cfg: AutoscaleConfig, source, actuator: Actuator, profile=None):
        self.cfg, self.source, self.actuator, self.profile = cfg, source, actuator, profile
        self._last: dict[str, tuple[float, float]] | None = None
        self._lock = threading.Lock()
        self._decision: Decision | None = None
        self._current = (0, 0)
        self._history: list[dict] = []

    def _signals(self) -> dict:
        now = self.source.read()
        last, self._last = self._last, now
        sig = {}
        for key, name in (("ttft_ms", TTFT), ("itl_ms", ITL)):
            s, n = now.get(name, (0.0, 0.0))
            s0, n0 = (last or {}).get(name, (0.0, 0.0))
            sig[key] = 1000 * (s - s0) / (n - n0) if n > n0 else None
        return sig

    def _decide(self, cur: tuple[int, int], sig: dict) -> tuple[tuple[int, int], list[str]]:
        p, d = cur
        room = p + d < self.cfg.max_workers
        if sig["ttft_ms"] is None and sig["itl_ms"] is None:
            return cur, ["no new requests since the last scrape: hold"]
        if sig["ttft_ms"] is not None and sig["ttft_ms"] > self.cfg.slo_ttft_ms:
            if room:
                return (p + 1, d), [f"TTFT {sig['ttft_ms']:.1f} ms > SLO: add a prefill worker"]
            return cur, ["TTFT over its SLO, at the worker budget: hold"]
        if sig["itl_ms"] is not None and sig["itl_ms"] > self.cfg.slo_itl_ms:
            if room:
                return (p, d + 1), [f"ITL {sig['itl_ms']:.1f} ms > SLO: add a decode worker"]
            return cur, ["ITL over its SLO, at the worker budget: hold"]
        return cur, ["within the SLOs: hold"]

    def step(self) -> Decision:
        cur = self.actuator.current()
        try:
            sig = self._signals()
        except OSError as e:
            target, reasons, sig = cur, [f"metrics unknown ({e}): hold"], {}
        else:
            target, reasons = self._decide(cur, sig)
        if target != cur:
            self.actuator.scale(*target)
        d = Decision(target[0], target[1], reasons, sig, time.time())
        with self._lock:
            self._decision, self._current = d, cur
            self._history = (self._history + [{"at_unix": d.at_unix, "prefill": d.prefill,
                                                "decode": d.decode, "reasons": reasons}])[-HISTORY:]
        return d

    def run(self, stop_event: threading.Event) -> None:
        while not stop_event.is_set():
            self.step()
            stop_event.wait(self.cfg.interval_s)

    def state(self) -> dict:
        with self._lock:
            d = self._decision
            return {"mode": "autoscale",
                    "target": {"prefill": d.prefill, "decode": d.decode} if d else {},
                    "current": {"prefill": self._current[0], "decode": self._current[1]},
                    "reasons": d.reasons if d else [], "signals": d.signals if d else {},
                    "updated_unix": d.at_unix if d else 0.0, "history": list(self._history)}


def serve_plan(autoscaler: Autoscaler, host: str, port: int) -> ThreadingHTTPServer:
    """`GET /plan`: the autoscaler's state() as JSON, from a daemon thread."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/plan":
                self.send_error(404)
                return
            body = json.dumps(autoscaler.state()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server

