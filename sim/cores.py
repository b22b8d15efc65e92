"""Processor sharing of the machine's cores among the workers' steps.

Rule: a step costs `work` seconds when its worker has its threads to itself (the profile's
cost). While the busy workers (those with a step in progress) together run more threads
than the system has cores, each gets a fair share, so every busy step advances at
    rate = min(1, cores / sum of the busy workers' threads)
seconds of work per simulated second: with 2 cores, one busy single-threaded worker runs at
full speed, three run at 2/3 speed (each step stretches by 1.5). Idle workers take nothing
(a worker waiting for work blocks, it does not spin). The rate changes only when a step
starts or ends, so between those events every busy step's remaining work falls linearly.
"""
from __future__ import annotations

import math


class Cores:
    def __init__(self, cores: float):
        if cores <= 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        self.cores = cores
        self.busy: dict = {}             # worker -> remaining work (seconds at full speed)
        self.now = 0.0                   # when `busy` was last brought up to date
        self._threads = 0

    def rate(self) -> float:
        return min(1.0, self.cores / self._threads) if self._threads else 1.0

    def advance(self, now: float) -> None:
        done = (now - self.now) * self.rate()
        if done:
            for w in self.busy:
                self.busy[w] -= done
        self.now = now

    def start(self, now: float, worker, work: float) -> None:
        self.advance(now)
        self.busy[worker] = max(0.0, work)
        self._threads += worker.threads

    def next_done(self) -> tuple[float, object]:
        """(time, worker) of the next step to end at the current rate; (inf, None) if idle."""
        if not self.busy:
            return math.inf, None
        w = min(self.busy, key=self.busy.__getitem__)
        return self.now + max(0.0, self.busy[w]) / self.rate(), w

    def finish(self, now: float, worker) -> None:
        self.advance(now)
        del self.busy[worker]
        self._threads -= worker.threads
