"""A Kubernetes API server in miniature, for the rendered manifests run by tests/e2e/kubelet.py.

What it serves, over HTTPS (a certificate for 127.0.0.1 from a test CA, tests/certs.py):

    GET   /api, /apis, /apis/apps/v1                         discovery (what kubectl asks first)
    GET   /apis/apps/v1/namespaces/NS/deployments/NAME        the rendered Deployment + status
    GET   /apis/apps/v1/namespaces/NS/deployments/NAME/scale  autoscaling/v1 Scale
    PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale  merge or strategic-merge patch of
                                                              spec.replicas (other types: 415)

Authentication: `Authorization: Bearer TOKEN`, a token this server issued for a ServiceAccount
(`token_for`, what the kubelet's TokenRequest gets for a pod); anything else is 401.
Authorization is RBAC evaluated from the RENDERED Roles and RoleBindings (a Role that does not
allow the call fails it, 403, with the API's Status message): the request's verb (GET -> get,
PATCH -> patch, PUT -> update), API group, resource ("deployments", "deployments/scale") and
name against each rule's apiGroups, resources, verbs and resourceNames ("*" as the API
does), for the Roles bound to `system:serviceaccount:NS:NAME`. Discovery is open to any
authenticated caller (the system:discovery ClusterRole). ClusterRoles are not emulated.

`ReplicaController` is the Deployment controller's part that matters here: each Deployment's
running pods follow spec.replicas (a pod started through the cluster's `start_pod`, which
waits for its startup probe; a removed pod, the newest, terminated as a scale-down does:
out of the endpoints, SIGTERM, its grace period), and status.readyReplicas is the number of
its pods in the endpoints (their readiness probe passed). Not emulated: rollouts,
ReplicaSets, resourceVersion preconditions, watches.
"""
from __future__ import annotations

import json
import secrets
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCALE_PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
VERBS = {"GET": "get", "PATCH": "patch", "PUT": "update"}


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def rule_allows(rule: dict, verb: str, group: str, resource: str, name: str) -> bool:
    def has(key, value):
        return "*" in rule.get(key, []) or value in rule.get(key, [])
    names = rule.get("resourceNames")
    return (has("verbs", verb) and has("apiGroups", group) and has("resources", resource)
            and (not names or name in names))


class KubeAPI:
    def __init__(self, docs: list[dict], ca, workdir):
        self.deployments = {(d["metadata"]["namespace"], d["metadata"]["name"]): d
                            for d in docs if d["kind"] == "Deployment"}
        self.roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d
                      for d in docs if d["kind"] == "Role"}
        self.bindings = [d for d in docs if d["kind"] == "RoleBinding"]
        self.ready: dict[tuple[str, str], int] = {}   # the controller's readyReplicas
        self.calls: list[tuple[str, str, str, int]] = []   # (user, method, path, code)
        self._tokens: dict[str, str] = {}
        self._lock = threading.Lock()
        self.ca_path = ca.cert_path
        cert, key = ca.issue("kube-apiserver", ips=("127.0.0.1",), dns=("kubernetes.default.svc",))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.host, self.port = self.server.server_address
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "KubeAPI":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    def token_for(self, namespace: str, service_account: str) -> str:
        token = secrets.token_urlsafe(32)
        self._tokens[token] = f"system:serviceaccount:{namespace}:{service_account}"
        return token

    def replicas(self, namespace: str, name: str) -> int:
        with self._lock:
            return self.deployments[(namespace, name)]["spec"].get("replicas", 1)

    # ------------------------------------------------------------------ RBAC
    def allowed(self, user: str, verb: str, group: str, namespace: str, resource: str,
                name: str) -> bool:
        for b in self.bindings:
            if b["metadata"]["namespace"] != namespace or b["roleRef"]["kind"] != "Role":
                continue
            if not any(s["kind"] == "ServiceAccount" and user ==
                       f"system:serviceaccount:{s.get('namespace', namespace)}:{s['name']}"
                       for s in b.get("subjects", [])):
                continue
            role = self.roles.get((namespace, b["roleRef"]["name"]))
            if role and any(rule_allows(r, verb, group, resource, name) for r in role["rules"]):
                return True
        return False

    # ---------------------------------------------------------------- objects
    def deployment(self, key) -> dict:
        dep = self.deployments[key]
        n = dep["spec"].get("replicas", 1)
        ready = self.ready.get(key, 0)
        return {**dep, "status": {"observedGeneration": 1, "replicas": n, "updatedReplicas": n,
                                  "readyReplicas": ready, "availableReplicas": ready}}

    def scale(self, key) -> dict:
        dep = self.deployments[key]
        labels = dep["spec"]["selector"]["matchLabels"]
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": key[1], "namespace": key[0], "resourceVersion": "1"},
                "spec": {"replicas": dep["spec"].get("replicas", 1)},
                "status": {"replicas": dep["spec"].get("replicas", 1),
                           "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))}}

    def handle(self, method: str, path: str, user: str, body: bytes, ctype: str):
        """(code, JSON object) for one authenticated request."""
        parts = path.split("?")[0].strip("/").split("/")
        if method == "GET" and parts in (["api"], ["apis"], ["apis", "apps", "v1"]):
            return 200, DISCOVERY["/".join(parts)]
        if (parts[:4] != ["apis", "apps", "v1", "namespaces"] or len(parts) not in (7, 8)
                or parts[5] != "deployments" or (len(parts) == 8 and parts[7] != "scale")):
            return 404, status(404, "NotFound", f"the server could not find {path}")
        ns, name, sub = parts[4], parts[6], parts[7] if len(parts) == 8 else ""
        resource, verb = "deployments" + ("/scale" if sub else ""), VERBS.get(method, "")
        if not self.allowed(user, verb, "apps", ns, resource, name):
            return 403, status(403, "Forbidden", f'deployments.apps "{name}" is forbidden: User '
                               f'"{user}" cannot {verb} resource "{resource}" in API group '
                               f'"apps" in the namespace "{ns}"')
        key = (ns, name)
        if key not in self.deployments:
            return 404, status(404, "NotFound", f'deployments.apps "{name}" not found')
        with self._lock:
            if method == "GET":
                return 200, self.scale(key) if sub else self.deployment(key)
            if method != "PATCH" or not sub:
                return 405, status(405, "MethodNotAllowed", f"{method} is not emulated here")
            if ctype.split(";")[0] not in SCALE_PATCH_TYPES:
                return 415, status(415, "UnsupportedMediaType", f"patch type {ctype} not emulated")
            replicas = json.loads(body).get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return 422, status(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}")
            self.deployments[key]["spec"]["replicas"] = replicas
            return 200, self.scale(key)


def _handler(api: KubeAPI):
    class Handler(BaseHTTPRequestHandler):
        def _serve(self):
            auth = self.headers.get("Authorization", "")
            user = api._tokens.get(auth[7:]) if auth.startswith("Bearer ") else None
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if user is None:
                code, obj = 401, status(401, "Unauthorized", "Unauthorized")
            else:
                code, obj = api.handle(self.command, self.path, user, body,
                                       self.headers.get("Content-Type", ""))
            api.calls.append((user or "", self.command, self.path, code))
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_PUT = _serve

        def log_message(self, *args):
            pass
    return Handler


def _resource(name, kind, verbs, namespaced=True):
    return {"name": name, "singularName": "", "namespaced": namespaced, "kind": kind,
            "verbs": verbs}


DISCOVERY = {
    "api": {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                            "serverAddress": "127.0.0.1:443"}]},
    "apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
        {"name": "apps", "versions": [{"groupVersion": "apps/v1", "version": "v1"}],
         "preferredVersion": {"groupVersion": "apps/v1", "version": "v1"}}]},
    "apis/apps/v1": {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "apps/v1",
                     "resources": [
                         _resource("deployments", "Deployment", ["get", "patch"]),
                         {**_resource("deployments/scale", "Scale", ["get", "patch"]),
                          "group": "autoscaling", "version": "v1"}]},
}


class ReplicaController:
    """Each managed Deployment's pods follow its spec.replicas; readyReplicas from the
    endpoints. `cluster` is tests/e2e/test_manifests.py's Cluster."""

    def __init__(self, api: KubeAPI, cluster, names: list[str], period_s: float = 0.5):
        self.api, self.cluster, self.names, self.period_s = api, cluster, names, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.errors: list[str] = []
        self.exits: list[tuple[str, int]] = []   # (pod, exit code; -9: killed after its grace)

    def start(self) -> "ReplicaController":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def pods(self, name: str) -> list:
        dep = self.cluster.deployments[name]
        return [p for p in self.cluster.pods if p.deployment is dep and not p.terminating
                and p.proc is not None and p.proc.poll() is None]

    def _sync(self, name: str) -> None:
        ns = self.cluster.deployments[name]["metadata"]["namespace"]
        want, pods = self.api.replicas(ns, name), self.pods(name)
        if len(pods) < want:
            self.cluster.start_pod(name)   # blocks until its startup probe passes
        elif len(pods) > want:
            self.exits.append((pods[-1].name, self.cluster.terminate(pods[-1])))
        self.api.ready[(ns, name)] = sum(p.name in self.cluster.endpoints.ready
                                         for p in self.pods(name))

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            for name in self.names:
                try:
                    self._sync(name)
                except Exception as e:   # noqa: BLE001 - a test reads them
                    self.errors.append(f"{name}: {e!r}")
