"""The few Kubernetes API calls the planner makes, with stdlib urllib + ssl (no client library).

In-cluster auth as client libraries do it (client-go's `rest.InClusterConfig`): the API
server is `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, verified with the
ServiceAccount's `ca.crt`; every request carries `Authorization: Bearer <token>`, the token
file re-read on each request (projected tokens rotate under a running pod); the namespace
defaults to the ServiceAccount's `namespace` file. All three files are in the ServiceAccount
directory the kubelet mounts (/var/run/secrets/kubernetes.io/serviceaccount).

`KubeActuator` is the autoscaler's `Actuator` (pdserve/autoscale.py) over two Deployments:

    current()  GET   /apis/apps/v1/namespaces/NS/deployments/NAME        spec.replicas
                                                                          (status.readyReplicas
                                                                          kept in .observed)
    scale(p,d) PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale  {"spec":{"replicas":n}}
               (merge patch, only the pools whose count changes, removals first;
               refused above the budget)

Every call has a timeout; a refusal or an unreachable API raises `KubeError` (with the
HTTP status and the API's Status message), which the planner logs before it holds and
retries at its next interval. Nothing is retried here.
"""
from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MERGE_PATCH = "application/merge-patch+json"


class KubeError(Exception):
    """A call the API refused (status: its HTTP code) or that never got an answer (status 0)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status or 'no answer'}: {message}")
        self.status, self.message = status, message


@dataclass
class InCluster:
    server: str
    token_file: Path
    ca_file: Path
    namespace: str

    @classmethod
    def from_env(cls, sa_dir: str = SA_DIR, environ=os.environ) -> "InCluster":
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise KubeError(0, "not in a cluster: KUBERNETES_SERVICE_HOST/PORT are not set")
        if ":" in host:   # an IPv6 address
            host = f"[{host}]"
        d = Path(sa_dir)
        ns = d / "namespace"
        return cls(f"https://{host}:{port}", d / "token", d / "ca.crt",
                   ns.read_text().strip() if ns.exists() else "")


class KubeClient:
    def __init__(self, cfg: InCluster, timeout_s: float = 5.0):
        self.cfg, self.timeout_s = cfg, timeout_s
        self._ssl = ssl.create_default_context(cafile=str(cfg.ca_file))

    def request(self, method: str, path: str, body: dict | None = None,
                content_type: str = "application/json") -> dict:
        token = self.cfg.token_file.read_text().strip()
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.cfg.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token}", "Accept": "application/json",
            **({"Content-Type": content_type} if data is not None else {})})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise KubeError(e.code, _status_message(e)) from None
        except (OSError, ValueError) as e:   # refused, timed out, TLS, a body not JSON
            raise KubeError(0, f"{method} {path}: {e}") from None


def _status_message(e: urllib.error.HTTPError) -> str:
    """The message of the API's Status object, or the raw body."""
    raw = e.read().decode(errors="replace")
    try:
        return json.loads(raw).get("message") or raw
    except ValueError:
        return raw or e.reason


class KubeActuator:
    """The prefill and decode Deployments' replicas, through the scale subresource."""

    def __init__(self, client: KubeClient, namespace: str, prefill_deployment: str,
                 decode_deployment: str, max_workers: int):
        self.client, self.max_workers = client, max_workers
        self.names = {"prefill": prefill_deployment, "decode": decode_deployment}
        self.base = f"/apis/apps/v1/namespaces/{namespace}/deployments/"
        self.observed: dict[str, dict] = {}   # pool -> {"spec", "ready"} at the last current()

    def _get(self, pool: str) -> dict:
        dep = self.client.request("GET", self.base + self.names[pool])
        return {"spec": int(dep["spec"].get("replicas", 1)),
                "ready": int(dep.get("status", {}).get("readyReplicas", 0))}

    def current(self) -> tuple[int, int]:
        self.observed = {pool: self._get(pool) for pool in self.names}
        return self.observed["prefill"]["spec"], self.observed["decode"]["spec"]

    def scale(self, prefill: int, decode: int) -> None:
        if prefill < 0 or decode < 0 or prefill + decode > self.max_workers:
            raise ValueError(f"refusing {prefill}P{decode}D: the budget is "
                             f"{self.max_workers} workers")
        # Removals first, so the pools never add up to more than the budget in between.
        wanted = {"prefill": prefill, "decode": decode}
        have = {pool: self.observed.get(pool, {}).get("spec") for pool in wanted}
        for pool, n in sorted(wanted.items(), key=lambda kv: have[kv[0]] is None
                              or kv[1] >= have[kv[0]]):
            if have[pool] == n:
                continue
            self.client.request("PATCH", self.base + self.names[pool] + "/scale",
                                {"spec": {"replicas": n}}, MERGE_PATCH)
            self.observed.setdefault(pool, {})["spec"] = n
