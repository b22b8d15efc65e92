"""A draining prefill worker hands its queue back (so a scale-down loses no prompt).

    SIGTERM -> WorkerServer.drain: NOT_SERVING, new Prefill calls refused (UNAVAILABLE),
               on_drain(deadline) -> HandBack.start(deadline)
    at once          every call whose prompt no step has started (AsyncEngine.
                     abort_unscheduled: queued in the engine, aborted there in one engine
                     command, or not in the engine yet) is cancelled and ends with
                     UNAVAILABLE (HANDED_BACK): the gateway's PrefillRetries retries it on
                     another prefill worker at no charge, with a fresh decode reservation
    meanwhile        the started ones finish (their KV goes out, they answer)
    deadline - END_MARGIN_S   one still computing is handed back the same way, rather than
                     cut by the server's stop
"""
from __future__ import annotations

import asyncio
import logging

from engine.async_engine import AsyncEngine, EngineError

log = logging.getLogger(__name__)

HANDED_BACK = "worker draining: the prompt is handed back, retry it on another prefill worker"
END_MARGIN_S = 0.5


class HandBack:
    """The calls this worker handed back (`ids`): their RPCs end UNAVAILABLE."""

    def __init__(self, ae: AsyncEngine, tasks: dict[str, asyncio.Task], drain_s: float):
        self.ae, self.tasks = ae, tasks           # tasks: the servicer's open calls by id
        self.end_margin_s = min(END_MARGIN_S, drain_s / 4)
        self.ids: set[str] = set()
        self._task: asyncio.Task | None = None

    def start(self, deadline: float) -> None:
        """Draining began; it ends at `deadline` (loop time). A WorkerServer.on_drain hook."""
        self._task = asyncio.ensure_future(self._run(deadline))

    async def _run(self, deadline: float) -> None:
        try:
            queued = await self.ae.abort_unscheduled(list(self.tasks))
        except EngineError:            # a failed engine holds nothing: hand every call back
            queued = list(self.tasks)
        self._cancel(queued, "queued")
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, deadline - self.end_margin_s - loop.time()))
        self._cancel(list(self.tasks), "still computing at the end of the drain")

    def _cancel(self, ids: list[str], what: str) -> None:
        tasks = [(rid, self.tasks.get(rid)) for rid in ids]
        tasks = [(rid, t) for rid, t in tasks if t is not None and not t.done()]
        if tasks:
            log.warning("draining: handing %d %s prompt(s) back to the gateway", len(tasks), what)
        for rid, t in tasks:
            self.ids.add(rid)
            t.cancel()
