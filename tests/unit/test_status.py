"""The status page's parts in one process: the recent latency window (exact percentiles,
weights, expiry), the gateway metrics feeding it with what its histograms get, the planner
client against a real HTTP server (answer, cache, unreachable, wrong shape), and the REST
routes: /status.json's shape for a gateway whose workers never answer, API keys on
/status.json but not on the page, a page with no external asset."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from gateway.auth import KeyStore
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.models import Models
from gateway.openai import create_app
from gateway.planner_client import NOT_ATTACHED, PlannerClient
from services.metrics import Metrics
from services.recent import RecentWindow

PLAN = {"mode": "autoscale", "target": {"prefill": 2, "decode": 3},
        "current": {"prefill": 1, "decode": 3}, "reasons": ["ttft p90 312 ms > SLO 200 ms"],
        "signals": {"ttft_p90_ms": 312.0}, "updated_unix": 1.0,
        "history": [{"at_unix": 1.0, "prefill": 2, "decode": 3, "reasons": ["ttft"]}]}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_recent_window_percentiles_weights_and_expiry():
    clock = Clock()
    w = RecentWindow(window_s=10.0, clock=clock)
    assert w.summary() == {"count": 0, "window_s": 10.0, "p50_ms": None, "p90_ms": None,
                           "mean_ms": None}
    for v in (0.001, 0.002, 0.003, 0.004):
        w.add(v)
    w.add(0.010, weight=6)             # six tokens that arrived together, 10 ms apart each
    s = w.summary()
    assert s["count"] == 10 and s["p50_ms"] == pytest.approx(10.0)
    assert s["mean_ms"] == pytest.approx((1 + 2 + 3 + 4 + 60) / 10)
    clock.t += 5
    w.add(0.5)
    clock.t += 6                       # the first ten are 11 s old now
    assert w.summary()["count"] == 1 and w.summary()["p90_ms"] == pytest.approx(500.0)
    clock.t += 11
    assert w.summary()["count"] == 0


def test_nearest_rank():
    w = RecentWindow()
    for v in range(1, 11):
        w.add(v / 1000)
    assert (w.summary()["p50_ms"], w.summary()["p90_ms"]) == pytest.approx((5.0, 9.0))


def test_gateway_metrics_feed_the_window_with_the_histograms_observations():
    m = Metrics("gateway")
    m.observe_first_token(0.05)
    m.observe_finished(1.0, 3, 4, "stop", ttft_s=0.07)
    m.observe_itl(0.03, 3)
    m.observe_itl(0.01)
    samples = {s.name: s.value for fam in m.registry.collect() for s in fam.samples}
    assert m.recent_ttft.summary()["count"] == samples["pdserve:time_to_first_token_seconds_count"] == 2
    assert m.recent_itl.summary()["count"] == samples["pdserve:inter_token_latency_seconds_count"] == 4
    assert m.recent_itl.summary()["p90_ms"] == pytest.approx(10.0)


class _Plan(BaseHTTPRequestHandler):
    body = json.dumps(PLAN).encode()
    hits = 0

    def do_GET(self):  # noqa: N802
        type(self).hits += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def plan_server():
    handler = type("Handler", (_Plan,), {"hits": 0, "body": _Plan.body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, handler, f"http://127.0.0.1:{server.server_address[1]}/plan"
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_planner_client_answer_cache_and_failures(plan_server):
    _, handler, url = plan_server
    clock = Clock()
    client = PlannerClient(url, cache_s=3.0, clock=clock)
    got = asyncio.run(client.get())
    assert got["ok"] and got["plan"] == PLAN and got["message"] == ""
    asyncio.run(client.get())
    assert handler.hits == 1           # cached
    clock.t += 3.0
    asyncio.run(client.get())
    assert handler.hits == 2
    handler.body = b'{"target": {"prefill": "two"}}'
    clock.t += 3.0
    bad = asyncio.run(client.get())
    assert not bad["ok"] and bad["message"].startswith("planner unreachable: ValueError") \
        and "'target'" in bad["message"]
    down = asyncio.run(PlannerClient(f"http://127.0.0.1:{closed_port()}/plan").get())
    assert down["attached"] and not down["ok"] and down["plan"] is None
    assert down["message"].startswith("planner unreachable: ") and "refused" in down["message"].lower()
    none = asyncio.run(PlannerClient("").get())
    assert none == {"attached": False, "url": "", "ok": False, "message": NOT_ATTACHED, "plan": None}


def test_planner_url_is_checked():
    with pytest.raises(ValueError, match="--planner-url"):
        GatewayConfig(model="x", planner_url="localhost:9000/plan")


@pytest.fixture(scope="module")
def model_dir():
    from engine.tiny_model import ensure_default_model
    return str(ensure_default_model())


async def _with_app(model_dir, fn, keys=None, planner_url=""):
    gw = Gateway(GatewayConfig(model=model_dir, grpc_port=0, prefill="127.0.0.1:9",
                               decode="127.0.0.1:9,127.0.0.1:10"))   # nothing listens there
    await gw.start()
    try:
        app = create_app(Models([gw]), keys, planner_url)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            return await fn(client)
    finally:
        await gw.stop()


def test_status_json_of_a_gateway_without_live_workers(model_dir, plan_server):
    _, _, url = plan_server

    async def get(client):
        return (await client.get("/status.json")).json()
    s = asyncio.run(_with_app(model_dir, get, planner_url=url))
    (m,) = s["models"]
    assert m["pools"]["prefill"]["states"] == {"healthy": 0, "wrong_model": 0, "unhealthy": 1}
    decode = m["pools"]["decode"]["workers"]
    assert [w["address"] for w in decode] == ["127.0.0.1:10", "127.0.0.1:9"]   # by address
    assert all(w["state"] == "unhealthy" and w["last_error"].startswith("UNAVAILABLE")
               and w["kv_total"] is None and not w["stats"] for w in decode)
    assert m["requests"] == {"in_flight": 0, "finished": {}, "errors": {}, "finished_total": 0,
                             "errors_total": 0}
    assert m["latency"]["ttft"]["count"] == 0 and m["latency"]["itl"]["p50_ms"] is None
    assert s["planner"]["ok"] and s["planner"]["plan"]["target"] == {"prefill": 2, "decode": 3}


def test_status_json_needs_the_key_the_page_does_not(model_dir):
    async def check(client):
        page = await client.get("/status")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        # self-contained: nothing loaded from anywhere else (no src/href to another origin)
        assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page.text)
        assert 'fetch("/status.json"' in page.text
        denied = await client.get("/status.json")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        ok = await client.get("/status.json", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["planner"]["message"] == NOT_ATTACHED
        assert (await client.get("/metrics")).status_code == 200      # open, as before
    asyncio.run(_with_app(model_dir, check, keys=KeyStore(api_key="sekret")))


def test_a_workers_stats_as_the_page_shows_them():
    from gateway.registry import Worker
    from gateway.status import _state, worker_status
    from protos.pdserve.v1 import decode_pb2, decode_pb2_grpc

    async def build():
        w = Worker("decode", "127.0.0.1:9", decode_pb2_grpc.DecodeWorkerStub)
        w.stats = decode_pb2.DecodeStats(worker_id="decode-3", num_waiting=2, num_running=5,
                                         free_kv_blocks=10, total_kv_blocks=64,
                                         queued_prefill_tokens=33)
        w.attach(object())
        w.last_error = "health status NOT_SERVING"
        w.health_status = "NOT_SERVING"
        out = worker_status(w, _state(w))
        await w.close()
        return out
    assert asyncio.run(build()) == {
        "address": "127.0.0.1:9", "id": "decode-3", "state": "not_serving", "in_flight": 1,
        "requests_total": 1, "last_error": "health status NOT_SERVING", "stats": True, "waiting": 2,
        "running": 5, "queued_prefill_tokens": 33, "kv_used": 54, "kv_total": 64}


def test_planner_client_reads_the_real_autoscalers_plan():
    """Against pdserve/autoscale.py's own /plan (its Autoscaler after a scale-up)."""
    from pdserve.autoscale import serve_plan
    from tests.unit.test_autoscale import make, steps
    auto, _, _ = make((0, 1), rate=2.5)
    steps(auto, 3)
    server = serve_plan(auto)
    try:
        got = asyncio.run(PlannerClient(f"http://127.0.0.1:{server.server_address[1]}/plan").get())
    finally:
        server.shutdown()
        server.server_close()
    assert got["ok"], got["message"]
    assert got["plan"] == json.loads(json.dumps(auto.state()))
    assert got["plan"]["target"] == {"prefill": 1, "decode": 1} and got["plan"]["reasons"]


def test_a_removed_worker_with_calls_on_it_shows_as_retiring(model_dir):
    async def check(client):
        return (await client.get("/status.json")).json()

    async def run():
        gw = Gateway(GatewayConfig(model=model_dir, grpc_port=0, prefill="127.0.0.1:9",
                                   decode="127.0.0.1:9,127.0.0.1:10"))
        await gw.start()
        holder = type("Holder", (), {"cut": lambda self, w, why: None})()
        gw.decode.workers["127.0.0.1:10"].attach(holder)
        await gw.decode.on_change([], ["127.0.0.1:10"])
        try:
            app = create_app(Models([gw]))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gw") as client:
                return await check(client)
        finally:
            await gw.stop()
    decode = asyncio.run(run())["models"][0]["pools"]["decode"]
    assert [(w["address"], w["state"], w["in_flight"]) for w in decode["workers"]] == [
        ("127.0.0.1:10", "retiring", 1), ("127.0.0.1:9", "unhealthy", 0)]
    assert decode["states"]["unhealthy"] == 1       # the gauge counts pool members only


def test_every_model_has_its_section(model_dir):
    """A models file's gateways: one entry each, in order, each with its own pools."""
    from gateway.status import status_json

    async def run():
        gws = [Gateway(GatewayConfig(model=model_dir, served_model_name=name, grpc_port=0,
                                     prefill=f"127.0.0.1:{port}", decode=f"127.0.0.1:{port}"))
               for name, port in (("small", 9), ("large", 10))]
        for gw in gws:
            await gw.start()
        try:
            return status_json(Models(gws), await PlannerClient("").get())
        finally:
            for gw in gws:
                await gw.stop()
    s = asyncio.run(run())
    assert [(m["name"], m["pools"]["decode"]["workers"][0]["address"]) for m in s["models"]] \
        == [("small", "127.0.0.1:9"), ("large", "127.0.0.1:10")]
    assert s["planner"]["message"] == NOT_ATTACHED


def test_prefill_counts_and_waterfall_present_or_absent():
    from types import SimpleNamespace

    from gateway.status import NO_PREFILL_COUNTS, NO_WATERFALL, prefill_counts, waterfall
    from gateway.waterfall import Waterfall
    assert prefill_counts(SimpleNamespace()) == {"disaggregated": None, "local": None,
                                                 "note": NO_PREFILL_COUNTS}
    assert prefill_counts(SimpleNamespace(prefill_counts={"disaggregated": 3, "local": 2})) == \
        {"disaggregated": 3, "local": 2, "note": ""}
    assert waterfall(SimpleNamespace())["note"] == NO_WATERFALL
    wf = Waterfall()
    assert waterfall(SimpleNamespace(waterfall=wf))["note"] == NO_WATERFALL     # nothing yet
    wf.observe({"routing": 1.0, "prefill_compute": 3.0})
    got = waterfall(SimpleNamespace(waterfall=wf))
    assert got["note"] == "" and got["count"] == 1
    assert got["phases"]["prefill_compute"]["share"] == pytest.approx(0.75)
