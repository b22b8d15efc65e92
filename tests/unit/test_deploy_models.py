"""deploy/k8s/overlays/{prod,dev}-two-models: two models behind one gateway, as rendered by
kustomize.

Each model's pools must be its own: no selector (Deployment, Service, PodDisruptionBudget)
matches another pool's pods, each prefill pool sends KV to its own model's decode Service,
each pool has its own HPA; the gateway's models file, read by gateway/models.py itself,
names for each model the headless Services of exactly that model's pools; the gateway's
arguments parse with the real command line; the NetworkPolicies cover the second model's
pods as they cover the first's. (Run as processes: tests/e2e/test_multimodel.py runs two
models through `pdserve up`; tests/e2e/test_manifests.py executes dev-two-models.)
"""
from __future__ import annotations


import pytest

from tests.unit.test_deploy import K8S_VERSION, _allowed, _by_kind, _render, _validate_docs

NAMESPACES = {"prod-two-models": "pdserve", "dev-two-models": "pdserve-dev"}
POOLS = {"pdserve-prefill", "pdserve-decode", "second-pdserve-prefill", "second-pdserve-decode"}


@pytest.fixture(scope="module", params=sorted(NAMESPACES))
def overlay(request):
    return request.param


@pytest.fixture(scope="module")
def docs(overlay):
    return _render(f"overlays/{overlay}")


def _args(dep) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def _flag(args, name):
    return args[args.index(name) + 1]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _selected(selector: dict, deps: dict) -> set[str]:
    """The Deployments whose pods `selector` (matchLabels) matches."""
    return {n for n, d in deps.items() if _selects(selector, d["spec"]["template"]["metadata"]["labels"])}


def test_renders_and_validates_in_one_namespace(docs, overlay):
    _validate_docs(docs, f"kubectl kustomize overlays/{overlay} (k8s {K8S_VERSION})")
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == \
        {NAMESPACES[overlay]}
    assert set(_by_kind(docs, "Deployment")) == POOLS | {"pdserve-gateway"}


def test_no_selector_reaches_another_pool(docs):
    deps = _by_kind(docs, "Deployment")
    for name, dep in deps.items():
        assert _selected(dep["spec"]["selector"]["matchLabels"], deps) == {name}, name
    for kind in ("Service", "PodDisruptionBudget"):
        for name, obj in _by_kind(docs, kind).items():
            sel = obj["spec"]["selector"]
            assert _selected(sel.get("matchLabels", sel), deps) == {name}, (kind, name)


def test_each_pool_has_its_model_its_decoders_and_its_hpa(docs, overlay):
    deps, services = _by_kind(docs, "Deployment"), _by_kind(docs, "Service")
    model = {n: _flag(_args(deps[n]), "--model") for n in POOLS}
    assert model == {"pdserve-prefill": "/models/M", "pdserve-decode": "/models/M",
                     "second-pdserve-prefill": "/models/second",
                     "second-pdserve-decode": "/models/second"}
    for prefill in ("pdserve-prefill", "second-pdserve-prefill"):
        svc = _flag(_args(deps[prefill]), "--decode-dns").split(".")[0]
        decoders = _selected(services[svc]["spec"]["selector"], deps)
        assert len(decoders) == 1 and _args(deps[next(iter(decoders))])[0] == "decode"
        assert model[next(iter(decoders))] == model[prefill]
    hpas = _by_kind(docs, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == \
        (set() if overlay.startswith("dev") else POOLS)      # dev has no autoscaling
    for name, hpa in hpas.items():      # the second model's pools scale on the same signals
        twin = hpas.get(name.removeprefix("second-"))
        assert hpa["spec"]["metrics"] == twin["spec"]["metrics"], name


def test_gateway_models_file_names_each_models_own_pools(docs, tmp_path):
    from gateway.config import GatewayConfig
    from gateway.models import model_configs
    from pdserve.cli import ROLES, build_parser
    from services.cli_args import config_from_args

    deps, services = _by_kind(docs, "Deployment"), _by_kind(docs, "Service")
    gw = deps["pdserve-gateway"]
    args = [a.replace("$(POD_NAMESPACE)", gw["metadata"]["namespace"]) for a in _args(gw)]
    cfg = config_from_args(ROLES["gateway"][1], build_parser().parse_args(args))
    assert cfg.host == "0.0.0.0" and not cfg.model and not cfg.prefill_dns
    # the file at --models-file is the ConfigMap's key, through the pod's volume mount
    pod = gw["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"]
                 if cfg.models_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = _by_kind(docs, "ConfigMap")[volume["configMap"]["name"]]
    key = cfg.models_file.removeprefix(mount["mountPath"] + "/")
    path = tmp_path / key
    path.write_text(cm["data"][key])
    entries = model_configs(GatewayConfig(models_file=str(path)))
    assert [e.served_model_name for e in entries] == ["M", "second"]
    for e in entries:
        for role, dns in (("prefill", e.prefill_dns), ("decode", e.decode_dns)):
            host, port = dns.rsplit(":", 1)
            svc_name, ns, *_ = host.split(".")
            assert ns == gw["metadata"]["namespace"] and host.endswith(".svc.cluster.local")
            svc = services[svc_name]
            assert svc["spec"]["clusterIP"] == "None"
            assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
            (pool,) = _selected(svc["spec"]["selector"], deps)
            assert _args(deps[pool])[0] == role and _flag(_args(deps[pool]), "--model") == e.model


def test_network_policies_cover_the_second_models_pods(docs, overlay):
    policies = list(_by_kind(docs, "NetworkPolicy").values())
    deps = _by_kind(docs, "Deployment")
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deps.items()}
    ns = NAMESPACES[overlay]
    other = {"app": "something-else"}
    for prefix in ("", "second-"):
        prefill, decode = labels[prefix + "pdserve-prefill"], labels[prefix + "pdserve-decode"]
        assert _allowed(policies, prefill, 50061, labels["pdserve-gateway"], ns, ns)
        assert not _allowed(policies, prefill, 50061, other, ns, ns)
        assert _allowed(policies, decode, 50081, prefill, ns, ns)
        assert not _allowed(policies, decode, 50081, other, ns, ns)
        assert not _allowed(policies, decode, 50071, other, ns, ns)
        assert _allowed(policies, decode, 9090, {}, "monitoring", ns)


def test_every_pod_writes_a_model_with_the_same_arguments(docs, overlay):
    """dev-two-models: each pod writes the models it reads (init containers); every writer of
    one model path gives make-tiny-model (deterministic) the same arguments, so the gateway's
    tokenizer is its workers'. prod reads the models from the volume."""
    writers: dict[str, set] = {}
    for dep in _by_kind(docs, "Deployment").values():
        for init in dep["spec"]["template"]["spec"].get("initContainers", []):
            assert init["args"][0] == "make-tiny-model"
            writers.setdefault(init["args"][1], set()).add(tuple(init["args"]))
    want = {} if overlay.startswith("prod") else {"/models/M": 1, "/models/second": 1}
    assert {path: len(args) for path, args in writers.items()} == want
