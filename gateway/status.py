"""What the gateway's status page shows: `status_json(models, planner)`, one JSON snapshot.

    GET /status.json   this snapshot (gateway/openai/app.py serves it; it names the workers'
                       internal addresses and errors, so it needs an API key when the
                       gateway has keys, like /v1)
    GET /status        gateway/status_page.html: one self-contained page (inline CSS and JS,
                       no external asset) that fetches /status.json every 2 s and draws it;
                       the page itself holds no data and is open, as /health and /metrics are

The snapshot, per model (each a `Gateway` of gateway/models.py):

    pools       prefill and decode: every worker the registry knows (gateway/registry.py):
                address, worker id, state (healthy | unhealthy | wrong_model, the registry's
                states, with not_serving for an unhealthy one that answers NOT_SERVING:
                draining or warming up, and retiring for one removed from discovery that
                still has calls on it), calls in flight
                and ever opened from here, its last Stats (waiting, running, KV blocks used
                of total, queued prompt tokens), last error
    requests    in flight now, finished by reason, failed by gRPC code (the gateway's own
                counters: what /metrics serves as request_success_total / request_errors_total)
    latency     TTFT and ITL p50/p90/mean over the last minute (services/recent.py, fed by
                the same observations as the /metrics histograms)
    prefills    disaggregated vs local prefills (`Gateway.prefill_counts`, issue 30's
                conditional disaggregation); a gateway without it says "n/a"
    waterfall   `Gateway.waterfall.summary()` (the TTFT phases); none: "no waterfall data"

and once for the gateway: `planner`, the autoscaler's `/plan` (gateway/planner_client.py):
its target, current size, reasons and history, or "no planner attached" / "planner
unreachable: <why>".
"""
from __future__ import annotations

import time

from .registry import Worker, WorkerPool

NO_WATERFALL = "no waterfall data"
NO_PREFILL_COUNTS = "n/a: this gateway does not count local prefills"


def status_json(models, planner: dict) -> dict:
    """The whole snapshot (`models`: gateway.models.Models; `planner`: PlannerClient.get())."""
    return {"generated_unix": time.time(), "models": [model_status(gw) for gw in models],
            "planner": planner}


def model_status(gw) -> dict:
    return {"name": gw.model_name, "max_model_len": gw.max_model_len,
            "pools": {pool.kind: pool_status(pool) for pool in (gw.prefill, gw.decode)},
            "requests": request_counts(gw), "latency": latency(gw),
            "prefills": prefill_counts(gw), "waterfall": waterfall(gw)}


def pool_status(pool: WorkerPool) -> dict:
    workers = [worker_status(w, _state(w)) for w in pool.workers.values()]
    workers += [worker_status(w, "retiring") for w in pool.retiring()]
    return {"states": pool.states(), "workers": sorted(workers, key=lambda w: w["address"])}


def _state(w: Worker) -> str:
    if w.healthy:
        return "healthy"
    if w.wrong_model:
        return "wrong_model"
    return "not_serving" if w.health_status == "NOT_SERVING" else "unhealthy"


def worker_status(w: Worker, state: str) -> dict:
    s = w.stats
    out = {"address": w.address, "id": s.worker_id if s is not None else "", "state": state,
           "in_flight": w.in_flight, "requests_total": w.requests_total,
           "last_error": w.last_error, "stats": s is not None,
           "waiting": None, "running": None, "queued_prefill_tokens": None,
           "kv_used": None, "kv_total": None}
    if s is not None:
        out.update(waiting=s.num_waiting, running=s.num_running,
                   queued_prefill_tokens=s.queued_prefill_tokens,
                   kv_used=s.total_kv_blocks - s.free_kv_blocks, kv_total=s.total_kv_blocks)
    return out


def request_counts(gw) -> dict:
    m = gw.metrics
    finished = _by_label(m.request_success, "finished_reason")
    errors = _by_label(m.request_errors, "code")
    return {"in_flight": gw.in_flight, "finished": finished, "errors": errors,
            "finished_total": sum(finished.values()), "errors_total": sum(errors.values())}


def _by_label(counter, label: str) -> dict[str, int]:
    """A labelled Counter's totals by one label (its other label, role, is constant)."""
    out: dict[str, int] = {}
    for fam in counter.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[s.labels[label]] = out.get(s.labels[label], 0) + int(s.value)
    return out


def latency(gw) -> dict:
    return {"ttft": gw.metrics.recent_ttft.summary(), "itl": gw.metrics.recent_itl.summary()}


def prefill_counts(gw) -> dict:
    counts = getattr(gw, "prefill_counts", None)
    if counts is None:
        return {"disaggregated": None, "local": None, "note": NO_PREFILL_COUNTS}
    return {"disaggregated": int(counts.get("disaggregated", 0)),
            "local": int(counts.get("local", 0)), "note": ""}


def waterfall(gw) -> dict:
    wf = getattr(gw, "waterfall", None)
    if wf is None:
        return {"count": 0, "phases": {}, "note": NO_WATERFALL}
    summary = dict(wf.summary())
    summary.setdefault("phases", {})
    summary["note"] = "" if summary.get("count") else NO_WATERFALL
    return summary
