"""pdserve planner's parts without a cluster: the signals it scrapes (the gateway's /metrics
plus the workers' through DNS), /plan before any decision, holding on an API refusal, and
the API client's bounded failures. Against an emulated API server and real pods:
tests/e2e/test_planner_k8s.py."""
from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.autoscale import AutoscaleConfig, Autoscaler
from pdserve.autoscale_signals import Snapshot
from pdserve.kube_client import InCluster, KubeClient, KubeError
from pdserve.planner_k8s import PlanView, step_or_hold
from pdserve.planner_metrics import ClusterMetrics
from sim.profile import example

GATEWAY = """# TYPE pdserve:request_success_total counter
pdserve:request_success_total{role="gateway",finished_reason="stop"} 7
# TYPE pdserve:num_requests_running gauge
pdserve:num_requests_running{role="gateway"} 1
"""
WORKER = """# TYPE pdserve:num_requests_running gauge
pdserve:num_requests_running{role="decode"} 3
# TYPE pdserve:kv_cache_usage_perc gauge
pdserve:kv_cache_usage_perc{role="decode"} 0.25
"""


def serve(text: str) -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = text.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    s = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s


@pytest.fixture
def servers():
    out = [serve(GATEWAY), serve(WORKER)]
    yield [s.server_address[1] for s in out]
    for s in out:
        s.shutdown()
        s.server_close()


def test_cluster_metrics_add_the_workers_found_by_dns(servers):
    gw, worker = servers
    with socket.socket() as s:   # a port nothing listens on: that worker is down
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    src = ClusterMetrics(f"http://127.0.0.1:{gw}", [f"127.0.0.1:{worker}", f"127.0.0.1:{dead}",
                                                   "no-such-name.invalid:9090"], timeout_s=2)
    snap = Snapshot.parse(src.scrape())
    assert snap.gateway["success"] == 7 and snap.gateway["in_flight"] == 1
    w = snap.workers[f"127.0.0.1:{worker}"]
    assert w["role"] == "decode" and w["up"] == 1.0 and w["running"] == 3 and w["kv_usage"] == 0.25
    assert snap.workers[f"127.0.0.1:{dead}"]["up"] == 0.0   # named, so the autoscaler holds


def test_no_gateway_is_a_failed_scrape(servers):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        ClusterMetrics(f"http://127.0.0.1:{port}", [], timeout_s=2).scrape()


class Refusing:
    """An actuator whose API refuses everything (a ServiceAccount without the Role)."""
    observed: dict = {}

    def current(self):
        raise KubeError(403, 'User "system:serviceaccount:ns:default" cannot get ...')

    def scale(self, p, d):
        raise AssertionError("never reached")


def test_a_refused_api_holds_and_plan_says_why_without_calling_it(servers):
    gw, _ = servers
    cfg = AutoscaleConfig(slo_ttft_ms=100, slo_itl_ms=50, max_workers=3, allow_colocated=False)
    auto = Autoscaler(cfg, ClusterMetrics(f"http://127.0.0.1:{gw}", []), Refusing(), example())
    view = PlanView(auto)
    assert view.state()["reasons"] == ["no decision yet"]
    assert step_or_hold(auto, view) is False
    state = view.state()   # Refusing.current would raise: /plan does not call the API
    assert state["target"] == {} and state["reasons"][0].startswith("kubernetes API: 403")
    assert auto.last is None


def test_an_api_that_never_answers_fails_within_the_timeout(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)   # accepts the TCP connection, never speaks TLS
    (tmp_path / "token").write_text("t")
    from tests.certs import CA
    ca = CA(tmp_path / "ca")
    (tmp_path / "ca.crt").write_bytes(open(ca.cert_path, "rb").read())
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": str(listener.getsockname()[1])}
    client = KubeClient(InCluster.from_env(str(tmp_path), env), timeout_s=0.5)
    began = time.monotonic()
    with pytest.raises(KubeError) as e:
        client.request("GET", "/apis/apps/v1/namespaces/ns/deployments/x")
    assert e.value.status == 0 and time.monotonic() - began < 5
    listener.close()
    with pytest.raises(KubeError, match="not in a cluster"):
        InCluster.from_env(str(tmp_path), {})


def test_a_failure_after_a_decision_is_shown_first_then_cleared(servers):
    gw, _ = servers

    class Flaky:
        observed: dict = {}
        fail = False

        def current(self):
            if self.fail:
                raise KubeError(0, "GET ...: timed out")
            return (1, 1)

        def scale(self, p, d):
            pass
    act = Flaky()
    cfg = AutoscaleConfig(slo_ttft_ms=100, slo_itl_ms=50, max_workers=3, allow_colocated=False)
    auto = Autoscaler(cfg, ClusterMetrics(f"http://127.0.0.1:{gw}", []), act, example())
    view = PlanView(auto)
    assert step_or_hold(auto, view) and view.state()["current"] == {"prefill": 1, "decode": 1}
    act.fail = True
    assert not step_or_hold(auto, view)
    assert view.state()["reasons"][0] == "kubernetes API: no answer: GET ...: timed out: holding"
    act.fail = False
    assert step_or_hold(auto, view) and not view.state()["reasons"][0].startswith("kubernetes")


def test_plan_after_a_decision_makes_no_api_call(servers):
    gw, _ = servers

    class Counting:
        observed: dict = {}
        calls = 0

        def current(self):
            self.calls += 1
            return (1, 1)

        def scale(self, p, d):
            pass
    act = Counting()
    cfg = AutoscaleConfig(slo_ttft_ms=100, slo_itl_ms=50, max_workers=3, allow_colocated=False)
    auto = Autoscaler(cfg, ClusterMetrics(f"http://127.0.0.1:{gw}", []), act, example())
    view = PlanView(auto)
    assert step_or_hold(auto, view)
    calls = act.calls
    states = [view.state() for _ in range(5)]
    assert act.calls == calls, "GET /plan called the Kubernetes API"
    assert all(s["current"] == {"prefill": 1, "decode": 1} for s in states)
    assert auto.state()["current"] == {"prefill": 1, "decode": 1} and act.calls == calls + 1
