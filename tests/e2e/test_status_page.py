"""The gateway's /status page, rendered by a real browser (headless Chromium), against a real
system: a gateway, one prefill and two decode workers (tiny model) as processes.

After known requests (the openai SDK as the client), the numbers the page SHOWS (read from
the DOM Chromium dumps once the page's script has fetched /status.json and drawn it) are
checked against the gateway's own /metrics (Prometheus text, the workers' merged in) and
/status.json: workers and their health, finished and failed requests, first-token counts
and TTFT p50 in its histogram bucket, each worker's KV blocks. The planner (--planner-url)
is a small HTTP server here answering an autoscaler-shaped /plan: the page shows its target,
reasons and history; once it is stopped, the page says it is unreachable. A gateway with
API keys: the page (open) says its data needs a key and offers a field for one.

Chromium is Debian's `chromium` (.ci/run installs it): without it this test fails, it does
not skip. A screenshot of the page is left in the test's tmp dir (status.png).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PLAN = {"mode": "autoscale", "target": {"prefill": 2, "decode": 3},
        "current": {"prefill": 1, "decode": 2},
        "reasons": ["ttft p90 412 ms > SLO 300 ms: +1 prefill", "itl p90 38 ms > SLO 30 ms: +1 decode"],
        "signals": {"ttft_p90_ms": 412.0, "itl_p90_ms": 38.0}, "updated_unix": 1764770000.0,
        "history": [{"at_unix": 1764769990.0, "prefill": 1, "decode": 2, "reasons": ["start"]},
                    {"at_unix": 1764770000.0, "prefill": 2, "decode": 3, "reasons": ["slo"]}]}
REQUESTS = 6
BROWSER_TIMEOUT_S = 120.0


class PlanHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = json.dumps(PLAN).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def planner():
    server = ThreadingHTTPServer(("127.0.0.1", 0), PlanHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def system(start_system, planner):
    http = free_port()
    url = f"http://127.0.0.1:{planner.server_address[1]}/plan"
    launcher = start_system(1, 2, gateway_args=["--http-port", str(http), "--health-interval-s",
                                                "0.5", "--planner-url", url])
    return launcher, f"http://127.0.0.1:{http}"


# -- the DOM as Chromium drew it ------------------------------------------------------------

class Node:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent, self.kids, self.text = tag, dict(attrs), parent, [], []

    def all_text(self) -> str:
        return "".join(self.text_parts()).strip()

    def text_parts(self):
        for k in self.kids:
            yield from ([k] if isinstance(k, str) else k.text_parts())

    def find(self, k: str) -> list["Node"]:
        out = [self] if self.attrs.get("data-k") == k else []
        for c in self.kids:
            if isinstance(c, Node):
                out += c.find(k)
        return out

    def one(self, k: str) -> str:
        (node,) = self.find(k)
        return node.all_text()


class Tree(HTMLParser):
    VOID = {"meta", "input", "br", "img", "link", "hr"}

    def __init__(self, html: str):
        super().__init__()
        self.root = self.cur = Node("#root", {}, None)
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.cur)
        self.cur.kids.append(node)
        if tag not in self.VOID:
            self.cur = node

    def handle_endtag(self, tag):
        n = self.cur
        while n is not None and n.tag != tag:
            n = n.parent
        if n is not None and n.parent is not None:
            self.cur = n.parent

    def handle_data(self, data):
        if self.cur.tag not in ("script", "style"):
            self.cur.kids.append(data)


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is required (apt-get install -y chromium; .ci/run installs it)"
    return exe


def browser(args: list[str], profile) -> str:
    cmd = [chromium(), "--headless", "--disable-gpu", "--no-first-run",
           f"--user-data-dir={profile}", *(["--no-sandbox"] if os.geteuid() == 0 else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc.stdout


def drawn(root: Node) -> bool:
    return root.one("updated") != "never"


def rendered(url: str, profile, ready=lambda root: True, tries: int = 5, first=drawn) -> Node:
    """The page's DOM after its script ran (virtual time lets its first fetch and draw
    finish); dumped again while `first` (it drew a status) or `ready` is false (at most
    `tries` times)."""
    for _ in range(tries):
        root = Tree(browser(["--virtual-time-budget=5000", "--dump-dom", url], profile)).root
        if first(root) and ready(root):
            return root
    raise AssertionError(f"{url} never drew its status: {root.all_text()[:2000]}")


# -- the gateway's own numbers --------------------------------------------------------------

def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def metrics(base: str) -> list:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def send_requests(base: str, model: str) -> None:
    from openai import OpenAI
    client = OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
    for i in range(REQUESTS):
        kw = dict(model=model, max_tokens=8, temperature=0.0,
                  messages=[{"role": "user", "content": f"status page request {i}"}])
        if i % 2:
            assert len(list(client.chat.completions.create(stream=True, **kw))) > 0
        else:
            assert client.chat.completions.create(**kw).choices[0].finish_reason


def settled(base: str, deadline_s: float = 60.0) -> dict:
    """/status.json once every request has finished and every worker's last Stats (probed
    every 0.5 s) agree with its own /metrics gauges on KV blocks used (the system is idle:
    nothing changes them any more)."""
    end = time.monotonic() + deadline_s
    while True:
        s = get_json(base + "/status.json")
        m, samples = s["models"][0], metrics(base)
        workers = [w for pool in m["pools"].values() for w in pool["workers"]]
        if m["requests"]["finished_total"] >= REQUESTS and m["requests"]["in_flight"] == 0 \
                and all(w["stats"] and w["kv_used"] == round(
                    total(samples, "pdserve:kv_cache_usage_perc", worker=w["id"]) * w["kv_total"])
                        for w in workers):
            return s
        assert time.monotonic() < end, f"not settled: {m}"
        time.sleep(0.2)


def bucket_bounds(samples, name: str, q: float) -> tuple[float, float]:
    """(lower, upper] of the histogram bucket holding the nearest-rank q-quantile."""
    buckets = sorted((float(s.labels["le"]), s.value) for s in samples if s.name == name + "_bucket")
    count = buckets[-1][1]
    rank = max(1, math.ceil(q * count))
    lower = 0.0
    for le, cum in buckets:
        if cum >= rank:
            return lower, le
        lower = le
    raise AssertionError(buckets)


# -- the tests --------------------------------------------------------------------------------

def test_the_page_shows_what_the_gateway_counts(system, tmp_path):
    launcher, base = system
    model = get_json(base + "/v1/models")["data"][0]["id"]
    send_requests(base, model)
    s = settled(base)
    root = rendered(base + "/status", tmp_path / "profile",
                    ready=lambda r: r.one("finished") == str(REQUESTS))
    samples = metrics(base)
    (sec,) = root.find("model")
    assert sec.one("model-name") == model
    m = s["models"][0]

    # workers: every one the launcher started, healthy, as /metrics counts them
    rows = sec.find("worker")
    for kind in ("prefill", "decode"):
        shown = {r.attrs["data-address"]: r for r in rows if r.attrs["data-pool"] == kind}
        assert set(shown) == {c.address for c in launcher.workers(kind)}
        assert [r.one("state") for r in shown.values()] == ["healthy"] * len(shown)
        assert len(shown) == total(samples, "pdserve:gateway_workers", pool=kind, state="healthy")
        for addr, r in shown.items():
            w = next(x for x in m["pools"][kind]["workers"] if x["address"] == addr)
            assert r.one("address") == addr and r.one("id") == w["id"] != ""
            assert r.one("requests_total") == str(w["requests_total"])
            assert r.one("in_flight") == "0" and r.one("waiting") == str(w["waiting"]) == "0"
            assert r.one("queued_prefill_tokens") == str(w["queued_prefill_tokens"])
            # KV blocks: the worker's own gauges (merged into the gateway's /metrics)
            kv_total = total(samples, "pdserve:kv_cache_blocks", worker=w["id"])
            usage = total(samples, "pdserve:kv_cache_usage_perc", worker=w["id"])
            assert kv_total > 0
            assert r.one("kv") == f"{round(usage * kv_total)} / {int(kv_total)}"
            assert r.one("kv") == f"{w['kv_used']} / {w['kv_total']}"
    decode_calls = sum(int(r.one("requests_total")) for r in rows if r.attrs["data-pool"] == "decode")
    assert decode_calls >= REQUESTS

    # requests and latency, against the gateway's counters and histograms
    assert sec.one("finished") == str(REQUESTS) == str(int(total(samples, "pdserve:request_success_total")))
    assert sec.one("errors") == "0" == str(int(total(samples, "pdserve:request_errors_total")))
    assert sec.one("in-flight") == "0"
    ttft_count = total(samples, "pdserve:time_to_first_token_seconds_count")
    assert sec.one("ttft-count") == str(int(ttft_count)) == str(REQUESTS)
    assert sec.one("itl-count") == str(int(total(samples, "pdserve:inter_token_latency_seconds_count")))
    p50, p90 = (float(x.strip().removesuffix("ms")) for x in sec.one("ttft").split("/"))
    assert p50 == pytest.approx(m["latency"]["ttft"]["p50_ms"], abs=0.051)
    lo, hi = bucket_bounds(samples, "pdserve:time_to_first_token_seconds", 0.5)
    assert lo * 1e3 - 0.05 <= p50 <= hi * 1e3 + 0.05 and p50 <= p90

    # prefills and the waterfall: the page shows what /status.json has (or says there is none)
    pf = m["prefills"]
    if pf["disaggregated"] is None:
        assert sec.one("prefills-disaggregated") == sec.one("prefills-local") == "n/a"
    else:
        assert sec.one("prefills-disaggregated") == str(pf["disaggregated"]) == \
            str(int(total(samples, "pdserve:prefills_total", kind="disaggregated")))
        assert sec.one("prefills-local") == str(pf["local"])
    if m["waterfall"]["note"]:
        assert sec.one("waterfall-note") == "no waterfall data"
    else:
        rows = sec.find("phase")
        assert [p.attrs["data-phase"] for p in rows] == list(m["waterfall"]["phases"])
        assert sec.one("waterfall-count") == f"({REQUESTS} requests)"
        # a phase's share of the mean TTFT: its part of the phase histogram's sums
        sums = {p.attrs["data-phase"]: total(samples, "pdserve:ttft_phase_seconds_sum",
                                             phase=p.attrs["data-phase"]) for p in rows}
        for p in rows:
            share = 100 * sums[p.attrs["data-phase"]] / sum(sums.values())
            assert float(p.one("share").removesuffix("%")) == pytest.approx(share, abs=0.051)

    # the planner's answer, fetched by the gateway
    assert [root.one(f"planner-{w}-{p}") for w in ("target", "current") for p in ("prefill", "decode")] \
        == ["2", "3", "1", "2"]
    assert [n.all_text() for n in root.find("planner-reason")] == PLAN["reasons"]
    assert {n.attrs["data-signal"]: n.one("value") for n in root.find("planner-signal")} == \
        {"ttft_p90_ms": "412", "itl_p90_ms": "38"}
    hist = root.find("planner-history")
    assert [(h.one("prefill"), h.one("decode")) for h in hist] == [("2", "3"), ("1", "2")]

    png = tmp_path / "status.png"
    browser(["--virtual-time-budget=5000", "--window-size=1280,1500", f"--screenshot={png}",
             base + "/status"], tmp_path / "profile")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unreachable_planner_is_shown(system, planner, tmp_path):
    _, base = system
    planner.shutdown()
    planner.server_close()
    end = time.monotonic() + 30          # the cache (3 s) and one fetch timeout (1 s)
    while not (p := get_json(base + "/status.json")["planner"])["message"]:
        assert time.monotonic() < end, p
        time.sleep(0.2)
    assert p["attached"] and not p["ok"] and p["message"].startswith("planner unreachable: ")
    root = rendered(base + "/status", tmp_path / "profile",
                    ready=lambda r: bool(r.find("planner-message")))
    assert root.one("planner-message") == p["message"]
    assert not root.find("planner-target-prefill")


def test_a_gateway_with_keys_asks_for_one(model_dir, tmp_path):
    """The page is open, its data is not: without a key the page says so and offers a
    field for one (an in-process gateway whose workers never answer)."""
    import asyncio

    from gateway.auth import KeyStore
    from gateway.config import GatewayConfig
    from gateway.core import Gateway
    from gateway.models import Models
    from gateway.openai import start_http

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    async def start():
        gw = Gateway(GatewayConfig(model=model_dir, grpc_port=0, prefill="127.0.0.1:9",
                                   decode="127.0.0.1:9"))    # nothing listens there
        await gw.start()
        return gw, await start_http(Models([gw]), "127.0.0.1", 0, KeyStore(api_key="sekret"))
    gw, http = run(start())
    try:
        root = rendered(f"http://127.0.0.1:{http.port}/status", tmp_path / "profile",
                        first=lambda r: bool(r.one("fetch-error")))
        assert root.one("fetch-error") == "this gateway needs an API key for its status"
        assert root.one("updated") == "never" and not root.find("model")
        (form,) = [n for n in _walk(root) if n.attrs.get("id") == "keyform"]
        assert "display: block" in form.attrs.get("style", "")
    finally:
        run(http.stop())
        run(gw.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _walk(node: Node):
    yield node
    for k in node.kids:
        if isinstance(k, Node):
            yield from _walk(k)
