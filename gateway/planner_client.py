"""The gateway's view of the autoscaler: its `GET /plan` JSON (pdserve/autoscale.py), for the
status page (gateway/status.py).

    --planner-url URL   the autoscaler's /plan (`pdserve up --autoscale` or `pdserve
                        planner` serve it); empty: "no planner attached"

`PlannerClient.get()` fetches it server-side (the browser never reaches the planner's
port), with a short timeout (TIMEOUT_S), and keeps the answer CACHE_S seconds: a page
refreshing every 2 s, or several open pages, cost the planner one fetch per CACHE_S. One
fetch at a time (callers meanwhile wait for it); a failure is cached too, so an unreachable
planner never makes every status request wait its timeout.

    {"attached": false, "url": "", "ok": false, "message": "no planner attached", "plan": null}
    {"attached": true, "url": U, "ok": true, "message": "", "plan": {mode, target, current,
        reasons, signals, updated_unix, history}, "fetched_unix": T}
    {"attached": true, "url": U, "ok": false, "message": "planner unreachable: <why>",
        "plan": null, "fetched_unix": T}
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

TIMEOUT_S = 1.0
CACHE_S = 3.0
NOT_ATTACHED = "no planner attached"
MAX_BYTES = 1 << 20


class PlannerClient:
    def __init__(self, url: str = "", timeout_s: float = TIMEOUT_S, cache_s: float = CACHE_S,
                 clock=time.monotonic):
        self.url, self.timeout_s, self.cache_s = url, timeout_s, cache_s
        self._clock = clock
        self._cached: dict | None = None
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def get(self) -> dict:
        if not self.url:
            return {"attached": False, "url": "", "ok": False, "message": NOT_ATTACHED,
                    "plan": None}
        async with self._lock:
            if self._cached is None or self._clock() - self._at >= self.cache_s:
                self._cached = await asyncio.to_thread(self._fetch)
                self._at = self._clock()
            return self._cached

    def _fetch(self) -> dict:
        out = {"attached": True, "url": self.url, "ok": False, "message": "", "plan": None,
               "fetched_unix": time.time()}
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:
                plan = json.loads(r.read(MAX_BYTES))
            check_plan(plan)
        except urllib.error.HTTPError as e:
            out["message"] = f"planner unreachable: HTTP {e.code} {e.reason}"
        except (OSError, ValueError) as e:    # URLError, timeouts, refused; bad JSON
            why = getattr(e, "reason", None) or e
            out["message"] = f"planner unreachable: {type(e).__name__}: {why}"
        else:
            out.update(ok=True, plan=plan)
        return out


def check_plan(plan) -> None:
    """ValueError unless `plan` has the shape of Autoscaler.state() (the fields the page
    draws: target and current sizes, reasons, history)."""
    if not isinstance(plan, dict):
        raise ValueError(f"expected a JSON object, got {type(plan).__name__}")
    for key in ("target", "current"):
        size = plan.get(key)
        if not isinstance(size, dict) or not all(isinstance(size.get(p), int)
                                                 for p in ("prefill", "decode")):
            raise ValueError(f"{key!r} must be {{'prefill': int, 'decode': int}}, got {size!r}")
    if not isinstance(plan.get("reasons", []), list) or not isinstance(plan.get("history", []), list):
        raise ValueError("'reasons' and 'history' must be lists")
