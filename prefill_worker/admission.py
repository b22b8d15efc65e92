"""The prefill worker's admission: a queue bounded in tokens, a wait bounded by the prompt's
own cost, and no work taken that cannot be computed before its deadline: its decode
reservation's hard bound, or the call's own (the gateway's request deadline). The
reservation's idle window does not limit the wait: a call queued here sends KEEPALIVEs that
hold its reservation (kv_push.py).

    queued    prompt tokens of the calls admitted and not yet at their first token
    calls     those calls
    busy s    seconds with at least one call queued or computing (idle time counts for
              nothing)
    sample    (tokens, busy seconds) of one completed call: the busy seconds since the
              previous completion (calls are computed in arrival order, so that interval
              is this call's work); an interval in which a call was dropped (failed,
              aborted, expired) gives no sample
    cost      fixed + per_token x tokens (seconds): a least-squares line through the last
              `max_samples` samples and the warm-up's (`seed`: a short and a long prompt,
              always part of the fit, so a run of short prompts cannot pass its per-request
              overhead off as per-token cost); clamped (services/prefill_cost.fit):
              per_token >= 1e-7 and fixed >= 0; one distinct length only: per_token =
              time / tokens, fixed 0
    backlog   cost of the queue (fixed x calls + per_token x queued) less the busy seconds
              already spent on it (since the last completion), at least 0
    refuse    queued + this prompt > max_queued_tokens (unless nothing is queued: a prompt
              longer than the bound is served alone), or, with calls queued and a cost
              fitted, backlog + cost(this prompt) past the deadline, or
              backlog > max(max_queue_delay_factor x cost(this prompt), MIN_QUEUE_DELAY_S):
              the queue ahead would keep it waiting longer than K times its own compute
              (the slowdown bound; factor 0: off). This is what keeps latency under
              overload without any SLO from the operator: the queue a closed loop at
              capacity builds (at most its own streams, spread over the workers) stays
              under it, an open-loop overload's grows until it is refused, so the admitted
              requests wait at most K x their own compute here; the cost is the worker's own
              measure (the warm-up and its completed calls), so the bound follows the
              model, the hardware and the prompt's length (a long prompt may wait longer,
              in proportion). The default 10: at 6, 16 closed-loop streams of the real
              model over 2 prefill workers on a 2-core CPU were refused (their queue reached
              6-7 prompts' cost on one worker); at 10 never (bench/RESULTS.md, the bad day)
              An idle worker admits whatever fits the bound: alone, a prompt has the best
              chance it can get, so it is never refused on an estimate

Refusals are RESOURCE_EXHAUSTED: the gateway tries another prefill worker, then answers 429.
Everything runs on the worker's event loop (no locks).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Iterable

from services import prefill_cost

MIN_QUEUE_DELAY_S = 1.0          # the slowdown bound never refuses a wait shorter than this


class PrefillAdmission:
    def __init__(self, max_queued_tokens: int, max_samples: int = 32,
                 max_queue_delay_factor: float = 0.0):
        self.max_queued_tokens = max_queued_tokens
        self.max_queue_delay_factor = max_queue_delay_factor
        self.queued = 0                  # tokens admitted, not yet computed
        self.refused = 0
        self._calls = 0                  # calls admitted, not yet computed
        self._busy_s = 0.0               # busy seconds before _busy_since
        self._busy_since = 0.0
        self._mark = 0.0                 # busy seconds at the last completion (or drop)
        self._dropped = False            # a call was dropped since the mark: no sample
        self._seed: list[tuple[int, float]] = []
        self._samples: deque[tuple[int, float]] = deque(maxlen=max_samples)

    # -- the cost model ------------------------------------------------------------------
    def seed(self, samples: Iterable[tuple[int, float]]) -> None:
        """The warm-up's (tokens, seconds): kept in every fit."""
        self._seed = [(n, s) for n, s in samples if n > 0 and s > 0]

    @property
    def num_samples(self) -> int:
        """Completed calls in the fit (the warm-up's seed not counted)."""
        return len(self._samples)

    def cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) fitted (services/prefill_cost.fit); None:
        nothing measured yet."""
        return prefill_cost.fit(self._seed + list(self._samples))

    def estimate(self, tokens: int, calls: int = 1) -> float | None:
        """Seconds to compute `calls` calls of `tokens` prompt tokens in all (None: no cost
        fitted yet)."""
        c = self.cost()
        return None if c is None else c[0] * calls + c[1] * tokens

    def backlog_s(self, now: float) -> float:
        """Busy seconds the queued calls still need (0 with none, or no cost fitted)."""
        est = self.estimate(self.queued, self._calls) if self._calls else None
        return 0.0 if est is None else max(0.0, est - (self.busy_s(now) - self._mark))

    def busy_s(self, now: float) -> float:
        return self._busy_s + (now - self._busy_since if self._calls else 0.0)

    # -- admission -----------------------------------------------------------------------
    def refusal(self, tokens: int, seconds_left: float | None, now: float | None = None) -> str | None:
        """Why a call computing `tokens` prompt tokens, due in `seconds_left` (None: no
        deadline), is refused now (counted in `refused`); None: admit it."""
        why = self._refusal(tokens, seconds_left, time.monotonic() if now is None else now)
        self.refused += why is not None
        return why

    def _refusal(self, tokens: int, seconds_left: float | None, now: float) -> str | None:
        if self.queued and self.queued + tokens > self.max_queued_tokens:
            return (f"prefill queue full: {self.queued} prompt tokens queued, {tokens} more would "
                    f"pass the bound of {self.max_queued_tokens}")
        own = self.estimate(tokens)
        if not self._calls or own is None:
            return None                  # idle (alone is its best chance), no cost
        backlog = self.backlog_s(now)
        k = self.max_queue_delay_factor
        if k and backlog > max(k * own, MIN_QUEUE_DELAY_S):
            return (f"prefill queue too long: {self._calls} call(s) ahead ({self.queued} prompt "
                    f"tokens) take ~{backlog:.1f}s, over {k:g}x this prompt's own ~{own:.1f}s "
                    f"(--max-queue-delay-factor)")
        if seconds_left is None:
            return None
        if backlog + own > seconds_left:
            fixed, per_token = self.cost()
            return (f"prefill cannot finish in time: {self._calls} call(s) queued "
                    f"({self.queued} prompt tokens, ~{backlog:.1f}s left) + {tokens} prompt "
                    f"tokens (~{own:.1f}s at {fixed * 1e3:.0f} ms + {per_token * 1e3:.2f} ms a "
                    f"token) take ~{backlog + own:.1f}s, its deadline is in {seconds_left:.1f}s")
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
        if not computed:             # its work is somewhere in the interval: unmeasurable
            if self._calls:
                self._dropped = True
            else:
                self._mark = busy        # idle again: the next call starts a clean interval
            return
        if not self._dropped and busy > self._mark:
            self._samples.append((tokens, busy - self._mark))
        self._mark, self._dropped = busy, False
