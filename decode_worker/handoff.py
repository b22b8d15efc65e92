"""A draining decode worker hands its streams to the gateway, which migrates them (so a
scale-down cuts no stream).

    SIGTERM -> WorkerServer.drain: NOT_SERVING, new Decode calls refused (UNAVAILABLE),
               on_drain(deadline) -> Handoff.start(deadline)
    until deadline - migrate_s    the streams run on; one that finishes, finishes here
    at deadline - migrate_s       every call still open that can continue elsewhere is
                                  handed off (DecodeServicer._hand_off: marked drained,
                                  its transfer and engine request aborted, blocks freed);
                                  its stream ends with UNAVAILABLE "worker draining" ->
                                  the gateway's _DecodeLost -> a new segment (prompt +
                                  tokens so far) on another pair: the client's stream
                                  goes on, greedy-identical. A call still before KvReady
                                  reads as a refusal (the gateway tries another decode
                                  worker); one waiting for its first token as lost too
    at deadline - end margin      the rest: structured output, whose grammar state cannot
                                  migrate (the gateway's _migrate_or_raise): they had the
                                  whole drain to finish; ending them the same way gives
                                  their clients a clear UNAVAILABLE, not a cut connection
    migrate_s = min(--drain-migrate-s, drain / 2): the time a migration's re-prefill may
    take on the other pair, so none races the server's stop at the deadline.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Iterable

from .pending import Pending

log = logging.getLogger(__name__)

DRAINING = "worker draining"
END_MARGIN_S = 0.5               # the last hand-off this long before the drain's deadline


def can_migrate(pend: Pending) -> bool:
    """Whether the gateway can continue `pend` on another decode worker (not structured)."""
    return getattr(pend.params, "structured", None) is None


class Handoff:
    """Hands the open calls to the gateway at the drain's two points (module docstring)."""

    def __init__(self, pending: Callable[[], Iterable[Pending]],
                 hand_off: Callable[[Pending], Awaitable[None]], drain_s: float,
                 migrate_s: float):
        self._pending, self._hand_off = pending, hand_off
        self.end_margin_s = min(END_MARGIN_S, drain_s / 4)
        self.migrate_s = max(min(migrate_s, drain_s / 2), self.end_margin_s)
        self.handed_off = 0
        self._task: asyncio.Task | None = None

    def start(self, deadline: float) -> None:
        """Draining began; it ends at `deadline` (loop time). A WorkerServer.on_drain hook."""
        self._task = asyncio.ensure_future(self._run(deadline))

    async def _run(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, deadline - self.migrate_s - loop.time()))
        await self._pass(can_migrate, f"{self.migrate_s:.3g}s before the end of the drain")
        await asyncio.sleep(max(0.0, deadline - self.end_margin_s - loop.time()))
        await self._pass(lambda p: True, "at the end of the drain (they cannot migrate)")

    async def _pass(self, which: Callable[[Pending], bool], when: str) -> None:
        calls = [p for p in self._pending() if not (p.aborted or p.finished) and which(p)]
        if calls:
            log.warning("draining: handing %d open stream(s) to the gateway %s", len(calls), when)
            self.handed_off += len(calls)
            await asyncio.gather(*(self._hand_off(p) for p in calls))
