"""The per-token path: where the time between two tokens goes, as one Prometheus histogram,
`pdserve:token_path_seconds{role, stage}` (no per-token span: one observe per token, cheap).

    stage         role     one observation per                 what
    engine_step   decode   engine step                         the step's wall time (a step observer)
    to_loop       decode   engine output read by the servicer  the output handed by the engine
                                                               thread -> read on the event loop
    grpc_gap      gateway  TokenChunk read (after the first)   since the previous message the
                                                               gateway read of the same stream
    gateway       gateway  TokenChunk read                     the read -> its event made
                                                               (output processor: text, stops)
    sse_write     gateway  SSE chunk (REST streams)            the chunk handed to the server
                                                               -> the server took it (written)

Each duration is measured on one process's monotonic clock. A role's series exist once it
observed something (a gateway shows no engine_step series).
"""
from __future__ import annotations

import time
from typing import AsyncIterator, Mapping

from prometheus_client import CollectorRegistry, Histogram

PREFIX = "pdserve:"
STAGES = ("engine_step", "to_loop", "grpc_gap", "gateway", "sse_write")
BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
           0.1, 0.25, 0.5, 1.0, 2.5)


class TokenPath:
    """The histogram of one process (its Metrics registry), by stage."""

    def __init__(self, registry: CollectorRegistry, role: str):
        self.role = role
        self._hist = Histogram(PREFIX + "token_path_seconds",
                               "Per-token path by stage (services/token_path.py)",
                               ("role", "stage"), buckets=BUCKETS, registry=registry)
        self._children: dict = {}

    def observe(self, stage: str, seconds: float) -> None:
        child = self._children.get(stage)
        if child is None:
            if stage not in STAGES:
                raise ValueError(f"unknown token path stage {stage!r}; known: {STAGES}")
            child = self._children[stage] = self._hist.labels(self.role, stage)
        child.observe(max(seconds, 0.0))

    def since(self, stage: str, t0: float) -> float:
        """Observe time.monotonic() - t0 under `stage` (t0 0: not measured, nothing
        observed); returns now."""
        now = time.monotonic()
        if t0 > 0:
            self.observe(stage, now - t0)
        return now

    def on_step(self, duration_s: float, tokens: Mapping[str, int]) -> None:
        """A step observer (engine/step_observer.py): engine_step."""
        self.observe("engine_step", duration_s)

    def gaps(self) -> "Gaps":
        return Gaps(self)

    async def timed_writes(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """`chunks` as they are, each one's write (the consumer's time until it asks for the
        next: a StreamingResponse sends it first) observed as sse_write."""
        async for c in chunks:
            t = time.monotonic()
            yield c
            self.since("sse_write", t)


class Gaps:
    """The grpc_gap of one stream: `tick()` at each message read, returns the read time."""

    def __init__(self, path: TokenPath):
        self.path, self.last = path, None

    def tick(self) -> float:
        now = time.monotonic()
        if self.last is not None:
            self.path.observe("grpc_gap", now - self.last)
        self.last = now
        return now
