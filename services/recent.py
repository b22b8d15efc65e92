"""Recent latency: percentiles over the last `window_s` seconds, for status pages.

Prometheus histograms count since the process started and in fixed buckets; an operator
looking at a status page wants "the last minute", exact. `RecentWindow` keeps the samples
of the window (value, weight, time) and answers p50/p90/mean over them:

    add(value, weight=1)    one observation, counted `weight` times (n tokens that arrived
                            together: one inter-token gap of value each)
    summary()               {"count", "p50_ms", "p90_ms", "mean_ms", "window_s"}
                            (count 0: the times are None)

The gateway's `Metrics` feeds one for TTFT and one for ITL from the very observations its
histograms get (services/metrics.py), so the status page and /metrics agree on counts.
Bounded: at most `max_samples` kept (the oldest dropped first), old ones dropped on add and
on read. Thread-safe (a lock): the engine thread and the event loop may both observe.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque

WINDOW_S = 60.0
MAX_SAMPLES = 20_000


class RecentWindow:
    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES,
                 clock=time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float, int]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, value: float, weight: int = 1) -> None:
        if weight <= 0:
            return
        now = self._clock()
        with self._lock:
            self._samples.append((now, value, weight))
            self._expire(now)

    def _expire(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def summary(self) -> dict:
        """Percentiles (nearest rank, over the weights) and the mean, in milliseconds."""
        with self._lock:
            self._expire(self._clock())
            pairs = sorted((v, w) for _, v, w in self._samples)
        count = sum(w for _, w in pairs)
        out = {"count": count, "window_s": self.window_s,
               "p50_ms": None, "p90_ms": None, "mean_ms": None}
        if count:
            out["p50_ms"] = _rank(pairs, count, 0.50) * 1e3
            out["p90_ms"] = _rank(pairs, count, 0.90) * 1e3
            out["mean_ms"] = sum(v * w for v, w in pairs) / count * 1e3
        return out


def _rank(pairs: list[tuple[float, int]], count: int, q: float) -> float:
    """The nearest-rank q-quantile of sorted (value, weight) pairs: the smallest value with
    at least ceil(q x count) of the weight at or below it."""
    need = max(1, math.ceil(q * count))
    seen = 0
    for v, w in pairs:
        seen += w
        if seen >= need:
            return v
    return pairs[-1][0]
