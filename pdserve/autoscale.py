"""Live autoscaling: every interval, read the load from the gateway's /metrics, ask the
simulator which shape (P prefill, D decode workers) meets the SLOs for it, and change the
pools through an `Actuator` (pdserve up: `LocalActuator`, pdserve/autoscale_local.py; on
Kubernetes: the planner's `KubeActuator`), slowly enough never to oscillate.

    every interval_s:  scrape -> Snapshot (pdserve/autoscale_signals.py); the rate and
        lengths over the last rate_intervals intervals, the step costs over the last one
        |-- scrape failed / a pool's metrics missing: "unknown": HOLD (a reason says why;
        |   the streaks restart), never read as zero load
        '-- Signals of the interval: rate, lengths, TTFT / ITL, queues, step costs
              -> CostCorrection (measured steps of workers past their first N intervals)
              -> Planner.recommend: the best shape (pdserve/autoscale_plan.py)
              -> hysteresis:
                   cool-down (cooldown_intervals after a change)         HOLD
                   bigger (or a reshape of equal size): up_streak += 1;   APPLY when the
                       same recommendation held up_intervals in a row, or at once while
                       the measured TTFT/ITL p90 breaks an SLO
                   smaller: down_streak += 1; APPLY after down_intervals in a row AND the
                       smaller shape meets the target at rate x down_margin (else HOLD)
                   same: both streaks restart
        -> Decision(prefill, decode, reasons, signals, at_unix); actuator.scale(P, D) on a
           change; history (the last `history` decisions that changed something)

Never above max_workers (the planner's shapes are P + D <= max_workers; the actuator
orders adds and retires to stay within it). P = 0 (colocated: decode workers prefill
their own prompts, gateway --disaggregation auto|never) is a target only when
`allow_colocated`. Every decision carries reasons (strings). `state()` is the JSON of GET
/plan, served by `serve_plan` on a small HTTP port of its own:

    {"mode": "autoscale", "target": {"prefill", "decode"}, "current": {"prefill", "decode"},
     "reasons": [...], "signals": {...}, "updated_unix": float,
     "history": [{"at_unix", "prefill", "decode", "reasons"}]}
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from .autoscale_plan import CostCorrection, Planner, smallest
from .autoscale_signals import Signals, Snapshot

log = logging.getLogger(__name__)


@dataclass
class AutoscaleConfig:
    slo_ttft_ms: float
    slo_itl_ms: float
    max_workers: int
    interval_s: float = 10.0
    up_intervals: int = 2          # K: an up recommendation held this long is applied
    down_intervals: int = 6        # a down recommendation held this long (and with margin)
    cooldown_intervals: int = 3    # no change for this many intervals after one
    new_worker_intervals: int = 2  # a new worker's first intervals: not in measured costs
    down_margin: float = 1.3       # the smaller shape must meet the SLOs at rate x this
    attainment: float = 0.9        # the share of requests meeting both SLOs
    allow_colocated: bool = True   # P = 0 a legal target (gateway --disaggregation auto|never)
    window_s: float = 30.0         # simulated arrivals per plan
    seeds: int = 1
    cores: float = 0.0             # 0: the profile's machine
    rate_intervals: int = 3        # the rate and lengths: over the last this many intervals
    history: int = 50

    def __post_init__(self):
        if self.max_workers < (1 if self.allow_colocated else 2):
            raise ValueError(f"--max-workers must be >= {1 if self.allow_colocated else 2} "
                             f"(one decode{'' if self.allow_colocated else ' and one prefill'} "
                             f"worker), got {self.max_workers}")
        if self.slo_ttft_ms <= 0 or self.slo_itl_ms <= 0:
            raise ValueError("--slo-ttft-ms and --slo-itl-ms must be > 0 with --autoscale")
        if self.interval_s <= 0 or min(self.up_intervals, self.down_intervals) < 1:
            raise ValueError("the autoscale interval must be > 0 and the holds >= 1 interval")
        if self.down_margin < 1:
            raise ValueError("down_margin must be >= 1")


@dataclass
class Decision:
    prefill: int
    decode: int
    reasons: list[str]
    signals: dict
    at_unix: float


class Actuator(Protocol):
    def current(self) -> tuple[int, int]: ...
    def scale(self, prefill: int, decode: int) -> None: ...


class Autoscaler:
    """See the module docstring. `source.scrape() -> str` (Prometheus text); `planner`:
    the shapes' predictions (default: a `Planner` on `profile`), replaceable in tests."""

    def __init__(self, cfg: AutoscaleConfig, source, actuator: Actuator, profile,
                 planner: Planner | None = None, clock=time.monotonic, scheduler=None):
        """`scheduler`: the workers' SchedulerConfig (batch limits the plan simulates)."""
        self.cfg, self.source, self.actuator, self.clock = cfg, source, actuator, clock
        self.planner = planner or Planner(
            profile, cfg.max_workers, (cfg.slo_ttft_ms, cfg.slo_itl_ms), cfg.allow_colocated,
            cfg.attainment, cfg.window_s, cfg.seeds, cfg.cores,
            CostCorrection(profile, cfg.new_worker_intervals), scheduler)
        self._snaps: list[Snapshot] = []          # the last rate_intervals + 1 scrapes
        self._streak: tuple[str, tuple[int, int] | None, int] = ("", None, 0)
        self._cooldown = 0
        self._lock = threading.Lock()
        self.last: Decision | None = None
        self._current: tuple[int, int] | None = None     # the last step's actuator.current()
        self.history: list[dict] = []
        self.notify = None        # notify(line) on each change, before it is made (pdserve up)

    # ------------------------------------------------------------------ one interval
    def step(self) -> Decision:
        current = tuple(self.actuator.current())
        cooling, self._cooldown = self._cooldown, max(0, self._cooldown - 1)
        signals, reasons = self._read(current)
        target = current
        if signals is not None:
            target, more = self._decide(current, signals, cooling)
            reasons += more
        clamped = self._clamp(target)
        if clamped != target:
            reasons.append(f"clamped to {clamped[0]}P{clamped[1]}D (budget {self.cfg.max_workers})")
            target = clamped
        decision = Decision(target[0], target[1], reasons,
                            self._signals_json(signals, current), time.time())
        if target != current:
            self._cooldown = self.cfg.cooldown_intervals
            self._streak = ("", None, 0)
            line = f"autoscale: {_name(current)} -> {_name(target)}: {'; '.join(reasons)}"
            log.warning("%s", line)
            if self.notify is not None:
                self.notify(line)
            self.actuator.scale(*target)
            self.history = (self.history + [{"at_unix": decision.at_unix, "prefill": target[0],
                                             "decode": target[1], "reasons": reasons}])[-self.cfg.history:]
        with self._lock:
            self.last, self._current = decision, current
        return decision

    def _read(self, current: tuple[int, int]) -> tuple[Signals | None, list[str]]:
        """This interval's signals, or None with the reason to hold."""
        try:
            snap = Snapshot.parse(self.source.scrape(), self.clock())
        except Exception as e:                      # noqa: BLE001 (any failure: unknown)
            self._streak, self._snaps = ("", None, 0), []
            return None, [f"metrics unknown (scrape failed: {type(e).__name__}: {e}): holding"]
        self._snaps = (self._snaps + [snap])[-(self.cfg.rate_intervals + 1):]
        if len(self._snaps) < 2:
            return None, ["first scrape: a second one gives the interval's rates; holding"]
        pools = {"prefill": current[0], "decode": current[1]}
        sig = Signals.between(self._snaps[0], snap, pools)           # rates: the window
        sig.steps = Signals.between(self._snaps[-2], snap, pools).steps   # costs: this interval
        if sig.unknown:
            self._streak, self._snaps = ("", None, 0), [snap]
            return None, ["metrics unknown: " + "; ".join(sig.unknown) + ": holding"]
        sig.correction = self.planner.correction.observe(sig.steps, set(sig.workers))
        return sig, []

    def _decide(self, current: tuple[int, int], sig: Signals,
                cooling: int) -> tuple[tuple[int, int], list[str]]:
        rec = self.planner.recommend(sig.rate_rps, sig.input_mean, sig.output_mean)
        sig.plan = {"recommended": {"prefill": rec.shape[0], "decode": rec.shape[1]},
                    "ranked": rec.ranked, "took_ms": round(rec.took_ms, 1)}
        name = _name(rec.shape)
        load = (f"{sig.rate_rps:.3g} req/s, {sig.input_mean:.0f} in / {sig.output_mean:.0f} "
                f"out tokens")
        if rec.shape == current:
            self._streak = ("", None, 0)
            return current, [f"plan: {name} for {load}: no change"]
        if cooling > 0:
            self._streak = ("", None, 0)
            return current, [f"plan: {name} for {load}; cool-down after the last change "
                             f"({cooling} interval(s) left): holding"]
        up = sum(rec.shape) >= sum(current)
        kind = "up" if up else "down"
        n = self._streak[2] + 1 if self._streak[:2] == (kind, rec.shape) else 1
        self._streak = (kind, rec.shape, n)
        need = self.cfg.up_intervals if up else self.cfg.down_intervals
        if up:
            breach = self._breach(sig)
            if breach or n >= need:
                return rec.shape, [f"scale up to {name} for {load}: " + (
                    breach or f"recommended {n} interval(s) in a row")]
            return current, [f"plan: {name} for {load} ({n}/{need} intervals): holding"]
        if n < need:
            return current, [f"plan: {name} for {load} ({n}/{need} intervals): holding"]
        rate = sig.rate_rps * self.cfg.down_margin
        if not self.planner.meets(rec.shape, rate, sig.input_mean, sig.output_mean):
            return current, [f"plan: {name} for {load}, but it misses the SLOs at "
                             f"{rate:.3g} req/s (margin x{self.cfg.down_margin:g}): holding"]
        return rec.shape, [f"scale down to {name} for {load}: recommended {n} intervals in "
                           f"a row and it meets the SLOs at x{self.cfg.down_margin:g} the rate"]

    def _breach(self, sig: Signals) -> str:
        """The measured SLO breach of the interval ("" if none)."""
        out = []
        if sig.ttft_p90_s is not None and sig.ttft_p90_s * 1e3 > self.cfg.slo_ttft_ms:
            out.append(f"TTFT p90 {sig.ttft_p90_s * 1e3:.0f} ms > SLO {self.cfg.slo_ttft_ms:g} ms")
        if sig.itl_p90_s is not None and sig.itl_p90_s * 1e3 > self.cfg.slo_itl_ms:
            out.append(f"ITL p90 {sig.itl_p90_s * 1e3:.0f} ms > SLO {self.cfg.slo_itl_ms:g} ms")
        return ("SLO breach: " + ", ".join(out)) if out else ""

    def _clamp(self, t: tuple[int, int]) -> tuple[int, int]:
        p, d = max(0, t[0]), max(1, t[1])
        if p == 0 and not self.cfg.allow_colocated:
            p = 1
        while p + d > self.cfg.max_workers and (d > 1 or p > (0 if self.cfg.allow_colocated else 1)):
            if d > 1 and (d >= p or p <= (0 if self.cfg.allow_colocated else 1)):
                d -= 1
            else:
                p -= 1
        return p, d

    def _signals_json(self, sig: Signals | None, current: tuple[int, int]) -> dict:
        if sig is None:
            return {"known": False}
        d = {k: v for k, v in asdict(sig).items() if k not in ("steps", "unknown")}
        d["known"] = True
        return json.loads(json.dumps(d, default=str))

    # ------------------------------------------------------------------ running
    def run(self, stop: threading.Event) -> None:
        """step() every interval until `stop` is set; a failing step is logged, never fatal."""
        while not stop.is_set():
            try:
                self.step()
            except Exception:                       # noqa: BLE001
                log.exception("autoscale step failed; trying again next interval")
            stop.wait(self.cfg.interval_s)

    def state(self, live: bool = True) -> dict:
        """The /plan JSON. "current" is the actuator's now when `live` (a change under way
        shows; cheap for the local launcher), else, or when that call fails, the last step's
        (the Kubernetes planner: no API call per /plan request)."""
        with self._lock:
            d, cur = self.last, self._current
        if live or cur is None:
            try:
                cur = tuple(self.actuator.current())
            except Exception:                      # noqa: BLE001 (an API call may fail)
                if cur is None:
                    raise
        if d is None:
            d = Decision(cur[0], cur[1], ["no decision yet"], {"known": False}, 0.0)
        return {"mode": "autoscale", "target": {"prefill": d.prefill, "decode": d.decode},
                "current": {"prefill": cur[0], "decode": cur[1]}, "reasons": list(d.reasons),
                "signals": d.signals, "updated_unix": d.at_unix, "history": list(self.history),
                "max_workers": self.cfg.max_workers,
                "slo": {"ttft_ms": self.cfg.slo_ttft_ms, "itl_ms": self.cfg.slo_itl_ms}}


def _name(shape: tuple[int, int]) -> str:
    return f"{shape[1]} colocated" if shape[0] == 0 else f"{shape[0]}P{shape[1]}D"


def serve_plan(autoscaler: Autoscaler, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """GET /plan -> autoscaler.state() as JSON, on a daemon thread; .server_address: where."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] not in ("/plan", "/plan/"):
                body, code = b'{"error": {"message": "not found: GET /plan"}}', 404
            else:
                body, code = json.dumps(autoscaler.state()).encode(), 200
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="autoscale-plan", daemon=True).start()
    return server


__all__ = ["Actuator", "AutoscaleConfig", "Autoscaler", "Decision", "serve_plan", "smallest"]
