"""The prefill worker's admission: a queue bounded in tokens, and no work taken that cannot
be computed before its decode reservation expires.

    queued    prompt tokens of the calls admitted and not yet at their first token
    rate      prompt tokens computed per busy second (a second with at least one call
              queued or computing), over the last `window_s`
    refuse    queued + this prompt > max_queued_tokens (unless nothing is queued: a prompt
              longer than the bound is served alone), or, once a rate is measured,
              now + (queued + this prompt) / rate past the reservation's deadline

Refusals are RESOURCE_EXHAUSTED: the gateway tries another prefill worker, then answers 429.
Everything runs on the worker's event loop (no locks).
"""
from __future__ import annotations

import time
from collections import deque


class PrefillAdmission:
    def __init__(self, max_queued_tokens: int, window_s: float = 10.0):
        self.max_queued_tokens = max_queued_tokens
        self.window_s = window_s
        self.queued = 0                  # tokens admitted, not yet computed
        self.refused = 0
        self._calls = 0                  # calls admitted, not yet computed
        self._busy_s = 0.0               # busy seconds before _busy_since
        self._busy_since = 0.0
        self._computed = 0               # tokens computed, ever
        # (time, tokens computed, busy seconds) at each completion; the first is the base
        self._samples: deque[tuple[float, int, float]] = deque([(0.0, 0, 0.0)], maxlen=4096)

    def busy_s(self, now: float) -> float:
        return self._busy_s + (now - self._busy_since if self._calls else 0.0)

    def rate(self, now: float) -> float | None:
        """Tokens computed per busy second over the window (None: nothing measured)."""
        while len(self._samples) > 2 and now - self._samples[1][0] > self.window_s:
            self._samples.popleft()
        (_, t0, b0), (_, t1, b1) = self._samples[0], self._samples[-1]
        return (t1 - t0) / (b1 - b0) if t1 > t0 and b1 > b0 else None

    def refusal(self, tokens: int, seconds_left: float | None, now: float | None = None) -> str | None:
        """Why a call computing `tokens` prompt tokens, due in `seconds_left` (None: no
        deadline), is refused now; None: admit it."""
        now = time.monotonic() if now is None else now
        if self.queued and self.queued + tokens > self.max_queued_tokens:
            return (f"prefill queue full: {self.queued} prompt tokens queued, {tokens} more would "
                    f"pass the bound of {self.max_queued_tokens}")
        rate = self.rate(now)
        if seconds_left is not None and rate is not None:
            eta = (self.queued + tokens) / rate
            if eta > seconds_left:
                return (f"prefill cannot finish in time: {self.queued} + {tokens} prompt tokens at "
                        f"{rate:.0f} tokens/s take ~{eta:.1f}s, the reservation expires in "
                        f"{seconds_left:.1f}s")
        return None

    def started(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not self._calls:
            self._busy_since = now
        self._calls += 1
        self.queued += tokens

    def ended(self, tokens: int, computed: bool, now: float | None = None) -> None:
        """A call started with `tokens` left the queue: `computed` (its first token sampled),
        or dropped (failed, aborted, expired)."""
        now = time.monotonic() if now is None else now
        busy = self.busy_s(now)
        self._calls -= 1
        self.queued -= tokens
        if not self._calls:
            self._busy_s, self._busy_since = busy, now
        if computed:
            self._computed += tokens
            self._samples.append((now, self._computed, busy))
