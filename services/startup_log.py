"""One line per server process telling where its start-up went (bench/startup.py reads it):

    start-up (prefill-0): imports 2.1 s, config 0.3 s, weights 1.2 s, ..., warm-up 0.7 s; ready 7.4 s after exec

"imports" is the process's age when its serve() began (the interpreter, the role's imports
and its command line: `process_age_s`, from /proc); the other phases are what the role timed
itself (a worker: EngineConfig's and LLMEngine's `startup_s`, its server, its warm-up).
Stdlib only: the gateway uses it too.
"""
from __future__ import annotations

import os
import time


def process_age_s() -> float:
    """Seconds since this process was exec'd (its start time in /proc, clock ticks since
    boot; 0.0 where /proc is not there)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()   # after the command's name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class StartupClock:
    """Phases in order: `mark(name)` ends the phase `name` (it began at the previous mark, or
    at the clock's making); `add(dict)` takes phases timed elsewhere (seconds)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {"imports": process_age_s()}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def add(self, phases: dict[str, float]) -> None:
        """Phases timed inside the last one (e.g. the engine's, inside "engine"): they
        replace that much of the one marked next."""
        for name, s in phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + s
        self._last += sum(phases.values())

    def line(self, who: str) -> str:
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in self.phases.items())
        return f"start-up ({who}): {parts}; ready {process_age_s():.2f} s after exec"
