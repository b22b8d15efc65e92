"""`LocalActuator`: the autoscaler's hands in `pdserve up --autoscale` (the Actuator of
pdserve/autoscale.py over pdserve/launcher.py's live pools).

    scale(P, D) from current (p, d):
        adds first, while the budget allows (p + d + 1 <= max_workers): add_worker(role)
            each starts, is SERVING, and only then is written into the discovery files
        retires: the newest worker of a role first (Launcher.retire: out of the files,
            a discovery interval, SIGTERM -> drain -> SIGKILL after drain + grace)
        adds the budget did not allow before the retires: after them

So a 1P1D -> 2-colocated change under --max-workers 2 retires the prefill worker before
starting the second decode worker, and never runs three. A retire of the last prefill
worker (P = 0) leaves the gateway prefilling on the decode workers (colocated; gateway
--disaggregation auto|never). A worker that fails to start is reported and not retried in
this call (the autoscaler's next interval sees the shape it got). One scale() at a time.
"""
from __future__ import annotations

import logging
import threading

from .launcher import Launcher

log = logging.getLogger(__name__)


class LocalActuator:
    def __init__(self, launcher: Launcher, max_workers: int, ready_timeout_s: float = 300.0):
        self.launcher, self.max_workers, self.ready_timeout_s = launcher, max_workers, ready_timeout_s
        self._lock = threading.Lock()

    def current(self) -> tuple[int, int]:
        return (len(self._live("prefill")), len(self._live("decode")))

    def _live(self, role: str) -> list:
        return [c for c in self.launcher.workers(role) if not c.retired]

    def scale(self, prefill: int, decode: int) -> None:
        with self._lock:
            want = {"prefill": max(0, prefill), "decode": max(1, decode)}
            later = []
            for role in ("decode", "prefill"):          # decode first: prefill needs one
                for _ in range(want[role] - len(self._live(role))):
                    if sum(self.current()) + 1 <= self.max_workers:
                        self._add(role)
                    else:
                        later.append(role)
            for role in ("prefill", "decode"):
                extra = self._live(role)[want[role]:]
                for child in reversed(extra):
                    self.launcher.retire(child)
            for role in later:
                self._add(role)

    def _add(self, role: str) -> None:
        try:
            self.launcher.add_worker(role, self.ready_timeout_s)
        except Exception as e:                          # noqa: BLE001 (reported, not fatal)
            log.error("autoscale: a new %s worker did not start: %s", role, e)
            self.launcher.say(f"a new {role} worker did not start: {e}")
