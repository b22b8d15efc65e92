"""deploy/k8s/components/planner: the planner Deployment, its ServiceAccount, Role and binding.

Rendered with `kubectl kustomize` (dev-planner, prod-planner) and validated strict against the
1.30 schemas like the other overlays; the planner's arguments parsed by the real `pdserve`
command line; the Role read as RBAC reads it (tests/e2e/kube_api.py's rule matcher, which the
e2e test uses to authorize the planner's real calls). And the rule that the planner and an
HPA never scale the same Deployment, checked on every overlay.
"""
from __future__ import annotations

import pytest

from tests.e2e.kube_api import rule_allows
from tests.e2e.kubelet import selects
from tests.unit.test_deploy import K8S, _render, _validate_docs

PLANNER_OVERLAYS = ("dev-planner", "prod-planner")
ALL_OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))


@pytest.fixture(scope="module")
def rendered():
    return {name: _render(f"overlays/{name}") for name in ALL_OVERLAYS}


def _kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _planner_cfg(dep):
    from pdserve.cli import build_parser
    from pdserve.planner_k8s import PlannerConfig
    from services.cli_args import config_from_args
    args = [a.replace("$(POD_NAMESPACE)", "ns") for a in
            dep["spec"]["template"]["spec"]["containers"][0]["args"]]
    return config_from_args(PlannerConfig, build_parser().parse_args(args))


@pytest.mark.parametrize("overlay", PLANNER_OVERLAYS)
def test_planner_overlay_validates_and_parses(rendered, overlay):
    docs = rendered[overlay]
    _validate_docs(docs, overlay)
    dep = _kind(docs, "Deployment")["pdserve-planner"]
    cfg = _planner_cfg(dep)
    assert (cfg.prefill_deployment, cfg.decode_deployment) == ("pdserve-prefill", "pdserve-decode")
    assert cfg.namespace == "ns" and cfg.kube_sa_dir == "/var/run/secrets/kubernetes.io/serviceaccount"
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] != "pdserve", "the overlay names the real image"
    # --gateway-url is the gateway Service's REST port, http in dev, https in prod
    svc = _kind(docs, "Service")["pdserve-gateway"]
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    scheme = "https" if overlay.startswith("prod") else "http"
    assert cfg.gateway_url == f"{scheme}://pdserve-gateway.ns.svc.cluster.local:{port}"
    if scheme == "https":
        mount = next(m for m in c["volumeMounts"] if cfg.gateway_ca.startswith(m["mountPath"] + "/"))
        vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        assert vol["secret"]["secretName"] == "pdserve-gateway-tls"
    # the gateway's status page reads the plan through the planner's Service
    gw = _kind(docs, "Deployment")["pdserve-gateway"]["spec"]["template"]["spec"]["containers"][0]
    url = gw["args"][gw["args"].index("--planner-url") + 1]
    plan_svc = _kind(docs, "Service")["pdserve-planner"]
    assert plan_svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert url == f"http://pdserve-planner.$(POD_NAMESPACE).svc.cluster.local:" \
                  f"{plan_svc['spec']['ports'][0]['port']}/plan"
    assert cfg.autoscale.max_workers == (3 if overlay == "dev-planner" else 16)
    assert all(c[k]["httpGet"]["port"] == cfg.plan_port
               for k in ("startupProbe", "readinessProbe", "livenessProbe"))


@pytest.mark.parametrize("overlay", PLANNER_OVERLAYS)
def test_the_role_allows_only_the_pools_replicas(rendered, overlay):
    docs = rendered[overlay]
    dep = _kind(docs, "Deployment")["pdserve-planner"]
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    ns = dep["metadata"]["namespace"]
    assert sa in _kind(docs, "ServiceAccount")
    binding = _kind(docs, "RoleBinding")["pdserve-planner"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
    assert binding["roleRef"]["kind"] == "Role"
    assert not _kind(docs, "ClusterRole") and not _kind(docs, "ClusterRoleBinding")
    rules = _kind(docs, "Role")[binding["roleRef"]["name"]]["rules"]
    cfg = _planner_cfg(dep)

    def allowed(verb, resource, name):
        return any(rule_allows(r, verb, "apps", resource, name) for r in rules)
    for pool in (cfg.prefill_deployment, cfg.decode_deployment):
        assert allowed("get", "deployments", pool) and allowed("patch", "deployments/scale", pool)
        assert not allowed("patch", "deployments", pool) and not allowed("delete", "deployments", pool)
    for other in ("pdserve-gateway", "pdserve-planner", ""):
        assert not any(allowed(v, r, other) for v in ("get", "patch", "update", "list")
                       for r in ("deployments", "deployments/scale"))
    assert all(r["apiGroups"] == ["apps"] and r["resourceNames"] and "*" not in r["verbs"]
               for r in rules)


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_never_a_planner_and_an_hpa_on_the_same_deployment(rendered, overlay):
    docs = rendered[overlay]
    planners = [_planner_cfg(d) for n, d in _kind(docs, "Deployment").items()
                if d["spec"]["template"]["metadata"]["labels"].get(
                    "app.kubernetes.io/component") == "planner"]
    planned = {n for cfg in planners for n in (cfg.prefill_deployment, cfg.decode_deployment)}
    hpa_targets = {h["spec"]["scaleTargetRef"]["name"]
                   for h in _kind(docs, "HorizontalPodAutoscaler").values()}
    assert not planned & hpa_targets, (overlay, planned & hpa_targets)


def test_prod_planner_is_prod_without_its_hpas(rendered):
    assert _kind(rendered["prod"], "HorizontalPodAutoscaler")
    assert not _kind(rendered["prod-planner"], "HorizontalPodAutoscaler")
    prod = {(d["kind"], d["metadata"]["name"]) for d in rendered["prod"]} - {
        ("HorizontalPodAutoscaler", n) for n in _kind(rendered["prod"], "HorizontalPodAutoscaler")}
    assert prod < {(d["kind"], d["metadata"]["name"]) for d in rendered["prod-planner"]}


@pytest.mark.parametrize("overlay", PLANNER_OVERLAYS)
def test_only_gateways_reach_the_planner(rendered, overlay):
    pol = _kind(rendered[overlay], "NetworkPolicy")["pdserve-planner"]
    (rule,) = pol["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8090}]
    assert rule["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "gateway"}}}]


@pytest.mark.parametrize("overlay", PLANNER_OVERLAYS)
def test_the_planner_reads_every_workers_metrics_port(rendered, overlay):
    """Its --*-metrics-dns name each pool's headless Service and the port the pods serve
    /metrics on, and a NetworkPolicy lets the planner's pods reach that port (the base lets
    only Prometheus)."""
    docs = rendered[overlay]
    deps, svcs = _kind(docs, "Deployment"), _kind(docs, "Service")
    planner = deps["pdserve-planner"]
    cfg = _planner_cfg(planner)
    planner_labels = planner["spec"]["template"]["metadata"]["labels"]
    for pool, dns in (("pdserve-prefill", cfg.prefill_metrics_dns),
                      ("pdserve-decode", cfg.decode_metrics_dns)):
        host, port = dns.rsplit(":", 1)
        assert host == f"{pool}.ns.svc.cluster.local" and svcs[pool]["spec"]["clusterIP"] == "None"
        c = deps[pool]["spec"]["template"]["spec"]["containers"][0]
        assert c["args"][c["args"].index("--metrics-port") + 1] == port
        labels = deps[pool]["spec"]["template"]["metadata"]["labels"]
        assert any(selects(pol["spec"]["podSelector"], labels) and any(
            any(int(p["port"]) == int(port) for p in rule.get("ports", []))
            and any("podSelector" in f and "namespaceSelector" not in f
                    and selects(f["podSelector"], planner_labels) for f in rule.get("from", []))
            for rule in pol["spec"].get("ingress", []))
            for pol in _kind(docs, "NetworkPolicy").values()), (overlay, pool)


def test_the_planners_profile(rendered):
    """dev-planner: the built-in example profile; prod-planner: one measured on the pools'
    GPUs, from a ConfigMap the operator creates (the pod waits for it)."""
    assert _planner_cfg(_kind(rendered["dev-planner"], "Deployment")["pdserve-planner"]).profile == ""
    dep = _kind(rendered["prod-planner"], "Deployment")["pdserve-planner"]
    cfg, spec = _planner_cfg(dep), dep["spec"]["template"]["spec"]
    mount = next(m for m in spec["containers"][0]["volumeMounts"]
                 if cfg.profile.startswith(m["mountPath"] + "/"))
    vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert vol["configMap"] == {"name": "pdserve-planner-profile"}   # not optional
    assert not cfg.autoscale.allow_colocated
