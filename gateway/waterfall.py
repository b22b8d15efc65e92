"""The TTFT waterfall: where each request's time to first token went, phase by phase.

One `PhaseClock` per request (RequestState.clock) laps from the moment the front received
the request to the moment the consumer of `Gateway.generate()` took its first token event:

    gateway_queue       arrived (REST: the ASGI app got the request head; gRPC: generate()
                        was called) -> routing starts: body parse, chat template, tokenize,
                        stop strings, grammar check, admission
    routing             the decode and the prefill picks (load, prefix affinity)
    decode_reservation  Decode opened -> KvReady read (with the decode worker's batch or KV
                        full, its wait for room: decode_worker/reservations.py)
    prefill_queue       Prefill sent -> compute starts on the prefill worker: the worker's own
                        queue (received -> first scheduled) plus both gRPC transits of the
                        call (the call's time on this clock less what the worker reports)
    prefill_compute     first scheduled -> first token sampled (the worker's clock)
    kv_transfer         first token sampled -> every layer sent (the push tail the compute
                        did not hide; the worker's clock)
    decode_admission    SubmitFirstToken sent -> accepted
    local_prefill       a locally prefilled request (no prefill worker: DecodeRequest
                        .local_prefill): Decode opened -> its first TokenChunk, replacing the
                        four phases above it
    first_token_out     -> the consumer took the first event: the output processor, the
                        front's write (REST: the SSE chunk handed to the server; gRPC: the
                        message written), or output held back (stop strings)

Clock rule: every phase is a duration on one host's monotonic clock. A worker reports the
durations it measured (PrefillResponse.timings, common.proto PhaseTimings); the gateway
places them inside the call's interval on its own clock, the remainder being transit. No
timestamps of two processes are ever subtracted. The laps cover the whole interval, so the
phases add up to the gateway's TTFT exactly; what lies outside is the client's side: the
connection, sending the request up to its head, the response's bytes in flight and the
client's parsing (on loopback with a kept-alive connection, a millisecond or less).

`Waterfall` (Gateway.waterfall) keeps the last `window` requests: `summary()` (p50, p90,
mean and share of each phase; a phase's percentiles over the requests that had it, its mean
and share over all of them, so the means add up to the mean TTFT), the Prometheus histogram
`pdserve:ttft_phase_seconds{phase}`, and OTel child spans `pdserve.phase.<name>` under the
request's pdserve.generate span.
"""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Histogram

from services import tracing
from services.metrics import PREFIX, TTFT_BUCKETS

PHASES = ("gateway_queue", "routing", "decode_reservation", "prefill_queue", "prefill_compute",
          "kv_transfer", "decode_admission", "local_prefill", "first_token_out")
WINDOW = 1000          # requests summary() looks back over


class PhaseClock:
    """One request's phases: `lap(phase)` gives the time since the last lap to `phase`.
    Once `stop()`ped (the first token is out) it records nothing more."""

    def __init__(self, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.t = self.start
        self.ms: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []     # (phase, start, end), monotonic
        self.done = False

    def lap(self, phase: str, now: float | None = None) -> None:
        if self.done:
            return
        now = time.monotonic() if now is None else now
        self._add(phase, self.t, now)
        self.t = now

    def split(self, reported_ms: dict[str, float], rest: str, now: float | None = None) -> None:
        """Lap the interval since the last lap as a remote call: the phases the worker reported
        (durations, placed one after the other at its end) and the remainder to `rest`."""
        if self.done:
            return
        now = time.monotonic() if now is None else now
        total = now - self.t
        inner = min(sum(max(v, 0.0) for v in reported_ms.values()) / 1e3, total)
        self._add(rest, self.t, now - inner)
        t = now - inner
        for phase, ms in reported_ms.items():
            d = min(max(ms, 0.0) / 1e3, now - t)
            self._add(phase, t, t + d)
            t += d
        self.t = now

    def _add(self, phase: str, a: float, b: float) -> None:
        self.ms[phase] = self.ms.get(phase, 0.0) + (b - a) * 1e3
        if self.spans and self.spans[-1][0] == phase and self.spans[-1][2] == a:
            self.spans[-1] = (phase, self.spans[-1][1], b)     # one span: transit + queue
        else:
            self.spans.append((phase, a, b))

    def stop(self, phase: str = "first_token_out", now: float | None = None) -> None:
        self.lap(phase, now)
        self.done = True

    @property
    def ttft_ms(self) -> float:
        return sum(self.ms.values())

    def phases_ms(self) -> dict[str, float]:
        """The phases this request had, in PHASES order."""
        return {p: self.ms[p] for p in PHASES if p in self.ms}


def prefill_phases(resp) -> dict[str, float]:
    """A PrefillResponse's own phases (its `timings`; none from a worker that sends none)."""
    if not resp.HasField("timings"):
        return {}
    t = resp.timings
    return {"prefill_queue": t.queue_ms, "prefill_compute": t.compute_ms, "kv_transfer": t.kv_tail_ms}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


class Waterfall:
    """The TTFT phases of recent requests, their histogram, and each request's phase spans."""

    def __init__(self, registry: CollectorRegistry | None = None, role: str = "gateway",
                 window: int = WINDOW):
        self._recent: deque[dict[str, float]] = deque(maxlen=window)
        self._hist = None
        if registry is not None:
            self._hist = Histogram(PREFIX + "ttft_phase_seconds",
                                   "Time to first token by phase (gateway/waterfall.py)",
                                   ("role", "phase"), buckets=TTFT_BUCKETS, registry=registry)
            self._children = {p: self._hist.labels(role, p) for p in PHASES}

    def observe(self, phases_ms: dict[str, float]) -> None:
        unknown = set(phases_ms) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown TTFT phases {sorted(unknown)}; known: {PHASES}")
        self._recent.append(dict(phases_ms))
        if self._hist is not None:
            for p, ms in phases_ms.items():
                self._children[p].observe(max(ms, 0.0) / 1e3)

    def observe_request(self, clock: PhaseClock, parent_span=None) -> None:
        """A request's first token is out: its phases into the window, histogram and trace."""
        self.observe(clock.phases_ms())
        if parent_span is not None and tracing.tracing_enabled():
            off = tracing.wall_offset_ns()       # one offset: the spans tile, no gap or overlap
            for phase, a, b in clock.spans:
                span = tracing.start_span(f"pdserve.phase.{phase}", parent_span, None,
                                          tracing.monotonic_to_ns(a, off))
                span.end(end_time=tracing.monotonic_to_ns(b, off))

    def summary(self) -> dict:
        """{"count": n, "phases": {name: {"p50_ms", "p90_ms", "mean_ms", "share", "count"}}}
        over the last `window` requests (phases no request had are left out)."""
        recent = list(self._recent)
        n = len(recent)
        means = {p: sum(r.get(p, 0.0) for r in recent) / n for p in PHASES} if n else {}
        total = sum(means.values())
        phases = {}
        for p in PHASES:
            had = [r[p] for r in recent if p in r]
            if not had:
                continue
            phases[p] = {"p50_ms": _pct(had, 0.5), "p90_ms": _pct(had, 0.9),
                         "mean_ms": means[p], "share": means[p] / total if total > 0 else 0.0,
                         "count": len(had)}
        return {"count": n, "phases": phases}
