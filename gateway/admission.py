"""The gateway's admission: which new requests it refuses (RESOURCE_EXHAUSTED: REST 429,
both with a Retry-After hint from gateway/core.py's DrainRate), goodput first.

    max_in_flight    a hard cap on requests in flight (each choice of n counts)
    SLOs             with --slo-ttft-ms and/or --slo-itl-ms, a concurrency limit that adapts
                     to keep them (AIMD, like TCP's congestion window): every ADJUST_S, the
                     interval's time to first token (p90) and time per output token (mean
                     of the token gaps) are compared with the SLOs:
                       over an SLO     limit = PEAK in flight of the interval x DECREASE
                       within both and the limit was reached: limit += INCREASE x limit
                                       (at least 1)
                     An interval lasts until it has MIN_SAMPLES first tokens (at most
                     MAX_INTERVALS x ADJUST_S): a p90 of a handful is noise. The interval after
                     a cut only observes (its requests were admitted under the old limit).
                     It starts at max_in_flight: nothing is refused until an SLO breaks.

Requests past the limit would only queue (on the prefill worker, or in a larger decode
batch) and miss their SLO together with those already admitted; refused at once, a client
can retry elsewhere or later, and the admitted ones keep their latency.
"""
from __future__ import annotations

import logging
import math
import time

log = logging.getLogger(__name__)

ADJUST_S = 0.5           # seconds between limit adjustments
DECREASE = 0.8
INCREASE = 0.05
MIN_SAMPLES = 10
MAX_INTERVALS = 4


class Admission:
    def __init__(self, max_in_flight: int, slo_ttft_s: float = 0.0, slo_itl_s: float = 0.0,
                 clock=time.monotonic):
        """SLOs of 0: none (only max_in_flight applies)."""
        self.max_in_flight = max_in_flight
        self.slo_ttft_s, self.slo_itl_s = slo_ttft_s, slo_itl_s
        self.clock = clock
        self.limit = float(max_in_flight)
        self.refused = 0
        self._start = clock()            # of the interval
        self._cut = False                # the last interval cut the limit
        self._ttft: list[float] = []
        self._gaps_s = 0.0               # token gaps of the interval: their sum and count
        self._gaps = 0
        self._peak = 0                   # requests in flight, the most this interval

    @property
    def slos(self) -> bool:
        return bool(self.slo_ttft_s or self.slo_itl_s)

    def refusal(self, in_flight: int) -> str | None:
        """Why one more request (with `in_flight` already in flight) is refused; None: admit."""
        self._adjust(in_flight)
        self._peak = max(self._peak, in_flight)
        if in_flight >= self.max_in_flight:
            why = f"the gateway has {in_flight} requests in flight, its maximum"
        elif in_flight >= self.limit:
            why = (f"overloaded: {in_flight} requests in flight would break the latency SLOs "
                   f"(the limit that keeps them is now {int(self.limit)})")
        else:
            self._peak = max(self._peak, in_flight + 1)
            return None
        self.refused += 1
        return why

    def first_token(self, ttft_s: float) -> None:
        if self.slos:
            self._ttft.append(ttft_s)

    def tokens(self, gap_s: float, n: int) -> None:
        """`n` more tokens arrived `gap_s` after the previous ones."""
        if self.slos and n > 0:
            self._gaps_s += gap_s
            self._gaps += n

    def _adjust(self, in_flight: int) -> None:
        now = self.clock()
        if not self.slos or now < self._start + ADJUST_S or (
                len(self._ttft) < MIN_SAMPLES and now < self._start + MAX_INTERVALS * ADJUST_S):
            return
        self._start = now
        ttft = _p90(self._ttft)
        itl = self._gaps_s / self._gaps if self._gaps else None
        over = ((self.slo_ttft_s and ttft is not None and ttft > self.slo_ttft_s)
                or (self.slo_itl_s and itl is not None and itl > self.slo_itl_s))
        peak = max(self._peak, in_flight)
        log.debug("admission: limit %.1f, peak %d, TTFT p90 %s, ITL %s, %d samples", self.limit,
                  peak, ttft, itl, len(self._ttft))
        if self._cut:
            self._cut = False            # observed only: admitted under the old limit
        elif over:
            self.limit = max(1.0, min(self.limit, peak) * DECREASE)
            self._cut = True
        elif peak >= int(self.limit):
            self.limit = min(float(self.max_in_flight), self.limit + max(1.0, INCREASE * self.limit))
        self._ttft.clear()
        self._gaps_s, self._gaps, self._peak = 0.0, 0, in_flight


def _p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
