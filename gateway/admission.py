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
    standing queue   without SLOs (the default; --max-standing-queue-s, 0: off), the same
                     kind of limit driven by the prefill workers' queue, CoDel's rule (a
                     queue that never drains below a small delay is standing; a burst that
                     drains is not): each PrefillResponse says how long its prompt waited in
                     the worker's queue (queue_ms). Standing: the last STANDING_SAMPLES
                     requests admitted since the limit last moved down ALL waited longer than
                     max_standing_queue_s: nothing but overload makes every one of them wait,
                     whatever the model, hardware or prompt lengths (an idle worker starts a
                     prompt at once, however long). Then
                       limit = PEAK in flight since the last change x DECREASE, and the
                               window starts again (only requests admitted under the new
                               limit count)
                     with a full window and no standing queue, every ADJUST_S while the
                     limit was reached: limit += max(1, INCREASE x limit); after RELAX_S
                     without reaching it (the pressure is over), back to max_in_flight: a
                     later burst is queued, not refused, and a new overload is measured again
                     Nothing is learned from the operator: the limit is found from the
                     workers' own queue, so at capacity (a queue that drains) nothing is
                     refused, and an idle system admits anything.

Requests past the limit would only queue (on the prefill worker, or in a larger decode
batch) and miss their SLO together with those already admitted; refused at once, a client
can retry elsewhere or later, and the admitted ones keep their latency.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque

log = logging.getLogger(__name__)

ADJUST_S = 0.5           # seconds between limit adjustments
DECREASE = 0.8
INCREASE = 0.05
MIN_SAMPLES = 10
MAX_INTERVALS = 4
STANDING_SAMPLES = 16    # queue waits that must ALL be over the bound: a standing queue
RELAX_S = 10.0           # the limit not reached this long: back to max_in_flight


class StandingQueue:
    """The prefill queue waits of the last STANDING_SAMPLES requests admitted after `since`
    (the limit's last cut): standing when the window is full and every wait is over
    `bound_s`."""

    def __init__(self, bound_s: float, samples: int = STANDING_SAMPLES):
        self.bound_s = bound_s
        self.since = -math.inf
        self.waits: deque[float] = deque(maxlen=samples)

    def observe(self, admitted_at: float, wait_s: float) -> None:
        if admitted_at > self.since:
            self.waits.append(wait_s)

    @property
    def full(self) -> bool:
        return len(self.waits) == self.waits.maxlen

    def standing(self) -> bool:
        return self.full and min(self.waits) > self.bound_s

    def restart(self, now: float) -> None:
        self.since = now
        self.waits.clear()


class Admission:
    def __init__(self, max_in_flight: int, slo_ttft_s: float = 0.0, slo_itl_s: float = 0.0,
                 clock=time.monotonic, max_standing_queue_s: float = 0.0):
        """SLOs of 0: none; then a max_standing_queue_s over 0 drives the limit (0: only
        max_in_flight applies)."""
        self.max_in_flight = max_in_flight
        self.slo_ttft_s, self.slo_itl_s = slo_ttft_s, slo_itl_s
        self.clock = clock
        self.queue = (StandingQueue(max_standing_queue_s)
                      if max_standing_queue_s > 0 and not self.slos else None)
        self._reached = clock()          # the limit last reached (standing-queue mode)
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
        elif in_flight >= self.limit and self.queue is not None:
            why = (f"overloaded: the prefill queue stands (every one of the last "
                   f"{self.queue.waits.maxlen} requests waited over {self.queue.bound_s:g}s); "
                   f"{in_flight} requests in flight is the limit that drains it")
        elif in_flight >= self.limit:
            why = (f"overloaded: {in_flight} requests in flight would break the latency SLOs "
                   f"(the limit that keeps them is now {int(self.limit)})")
        else:
            self._peak = max(self._peak, in_flight + 1)
            return None
        self.refused += 1
        return why

    def first_token(self, ttft_s: float, queue_s: float | None = None) -> None:
        """A first token `ttft_s` after its request's admission; `queue_s`: how long its
        prompt waited in a prefill worker's queue (None: unknown)."""
        if self.slos:
            self._ttft.append(ttft_s)
        elif self.queue is not None and queue_s is not None:
            self.queue.observe(self.clock() - ttft_s, queue_s)

    def tokens(self, gap_s: float, n: int) -> None:
        """`n` more tokens arrived `gap_s` after the previous ones."""
        if self.slos and n > 0:
            self._gaps_s += gap_s
            self._gaps += n

    def _adjust(self, in_flight: int) -> None:
        if self.queue is not None:
            self._adjust_to_queue(in_flight)
            return
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

    def _adjust_to_queue(self, in_flight: int) -> None:
        """The standing-queue limit (see the module docstring)."""
        now, q = self.clock(), self.queue
        peak = max(self._peak, in_flight)
        if peak >= int(self.limit):
            self._reached = now
        if q.standing():
            self.limit = max(1.0, min(self.limit, peak) * DECREASE)
            log.info("admission: the prefill queue stands (the last %d waits %.2f-%.2fs): "
                     "limit %.1f", len(q.waits), min(q.waits), max(q.waits), self.limit)
            q.restart(now)
        elif now - self._reached > RELAX_S and self.limit < self.max_in_flight:
            self.limit = float(self.max_in_flight)
            q.restart(now)
        elif q.full and now >= self._start + ADJUST_S and peak >= int(self.limit):
            self.limit = min(float(self.max_in_flight), self.limit + max(1.0, INCREASE * self.limit))
        else:
            return
        self._start, self._peak = now, in_flight


def _p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
