"""A kubelet and endpoints controller in miniature, for executing rendered manifests locally.

A `Pod` runs one Deployment's pod template as local processes, the way a kubelet would, with
what cannot be had without a cluster made explicit:

- the pod IP is a distinct loopback address (127.a.b.c); a pod's network namespace is
  emulated by binding that address where the manifest binds the wildcard 0.0.0.0 (in a pod,
  0.0.0.0 means the pod IP and its own loopback);
- env: `value`s, and `valueFrom.fieldRef` filled as the downward API does (metadata.name,
  metadata.namespace, status.podIP); `$(VAR)` in args and env expanded as the kubelet does;
- volumes: each mount path is a directory of the pod (emptyDir: fresh; a PVC: one directory
  shared by every pod; a Secret: its files, from the test; a ConfigMap: its files, from the
  rendered ConfigMap) and arguments naming a path under a mount are rewritten to that
  directory, as are such paths in a ConfigMap's JSON files (JSON strings that are paths, e.g.
  a models file's model directories);
- with an API server (tests/e2e/kube_api.py), the ServiceAccount as the kubelet mounts it:
  a token the API issued for the pod's serviceAccountName (default "default"), its CA and the
  namespace in /var/run/secrets/kubernetes.io/serviceaccount (a pod directory, arguments
  rewritten as above), and KUBERNETES_SERVICE_HOST/PORT naming the API server; not for a pod
  with automountServiceAccountToken: false;
- the image's ENTRYPOINT (`pdserve`, deploy/Dockerfile) is `pdserve.cli.main` from this
  checkout, run through tests/e2e/cluster_dns_shim.py (cluster DNS); init containers run to
  completion first;
- probes as the kubelet sends them: gRPC health Check (service "") or HTTP GET at the pod IP
  and the probe's port, each with the probe's timeoutSeconds.

One thing is not emulated faithfully: UCX's TCP transport does not connect to loopback
addresses other than 127.0.0.1 (ucxx 0.45: "Endpoint is not connected"), so the KV endpoint
a decode pod advertises on its pod IP (`--kv-host $(POD_IP)`) is moved to 127.0.0.1 with a
free port of its own (`kv_loopback`); the tests check the manifest's `--kv-host` separately.

`Endpoints` is what a headless Service's DNS name answers: the IPs of the Service's ready
pods, written to the JSON file that tests/e2e/cluster_dns_shim.py reads.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DNS_SHIM = [sys.executable, str(Path(__file__).with_name("cluster_dns_shim.py"))]
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined names are replaced, others left as written."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def probe_ok(probe: dict, ip: str) -> bool:
    """One probe as the kubelet sends it, with its timeoutSeconds (default 1 s)."""
    timeout = probe.get("timeoutSeconds", 1)
    if "grpc" in probe:
        with grpc.insecure_channel(f"{ip}:{probe['grpc']['port']}") as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
                    timeout=timeout)
            except grpc.RpcError:
                return False
            return r.status == health_pb2.HealthCheckResponse.SERVING
    if "httpGet" in probe:
        h = probe["httpGet"]
        try:
            with urllib.request.urlopen(f"http://{ip}:{h['port']}{h.get('path', '/')}",
                                        timeout=timeout) as r:
                return 200 <= r.status < 400
        except OSError:
            return False
    raise AssertionError(f"probe kind not emulated: {probe}")


def host_path(path: str, mounts: dict[str, Path]) -> str:
    """A path as a container sees it -> the pod's directory holding it (unchanged if no
    mount holds it)."""
    for mount, host_dir in mounts.items():
        if path == mount or path.startswith(mount + "/"):
            return str(host_dir) + path[len(mount):]
    return path


def kv_loopback(argv: list[str], pod_ip: str) -> list[str]:
    """`--kv-host POD_IP --kv-port N` -> `--kv-host 127.0.0.1 --kv-port FREE` (see above)."""
    argv = list(argv)
    i = argv.index("--kv-host") + 1
    assert argv[i] == pod_ip, f"the KV endpoint must be advertised on the pod IP, not {argv[i]}"
    argv[i] = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        argv[argv.index("--kv-port") + 1] = str(s.getsockname()[1])
    return argv


class Pod:
    def __init__(self, deployment: dict, name: str, ip: str, workdir: Path,
                 shared_volumes: dict[str, Path], secrets: dict[str, dict[str, bytes]],
                 hosts_file: Path, config_maps: dict[str, dict[str, str]] | None = None,
                 api=None):
        self.deployment, self.name, self.ip = deployment, name, ip
        self.namespace = deployment["metadata"]["namespace"]
        self.template = deployment["spec"]["template"]
        self.spec = self.template["spec"]
        self.labels = self.template["metadata"]["labels"]
        self.dir = workdir / name
        self.hosts_file = hosts_file
        self.mounts = self._volumes(shared_volumes, secrets, config_maps or {})
        self.api_env, self.sa_mount = self._service_account(api)
        self.proc: subprocess.Popen | None = None
        self.terminating = False
        self.log_path = self.dir / "container.log"

    def _volumes(self, shared: dict[str, Path], secrets: dict[str, dict[str, bytes]],
                 config_maps: dict[str, dict[str, str]]) -> dict[str, Path]:
        out, texts = {}, {}
        for v in self.spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                path = shared[v["persistentVolumeClaim"]["claimName"]]
            elif "emptyDir" in v:
                path = self.dir / "volumes" / v["name"]
            elif "secret" in v:
                path = self.dir / "secrets" / v["name"]
                files = secrets[v["secret"]["secretName"]]
                path.mkdir(parents=True)
                for key, data in files.items():
                    (path / key).write_bytes(data)
            elif "configMap" in v:
                path = self.dir / "configmaps" / v["name"]
                texts.update({path / k: t for k, t in config_maps[v["configMap"]["name"]].items()})
            else:
                raise AssertionError(f"volume kind not emulated: {v}")
            path.mkdir(parents=True, exist_ok=True)
            out[v["name"]] = path
        mounts = {m["mountPath"]: out[m["name"]] for m in self.container.get("volumeMounts", [])}
        for path, text in texts.items():
            if path.suffix == ".json":
                text = re.sub(r'"(/[^"]*)"', lambda m: json.dumps(host_path(m.group(1), mounts)),
                              text)
            path.write_text(text)
        return out

    def _service_account(self, api) -> tuple[dict[str, str], dict[str, Path]]:
        if api is None or self.spec.get("automountServiceAccountToken") is False:
            return {}, {}
        path = self.dir / "serviceaccount"
        path.mkdir(parents=True)
        sa = self.spec.get("serviceAccountName", "default")
        (path / "token").write_text(api.token_for(self.namespace, sa))
        (path / "ca.crt").write_bytes(Path(api.ca_path).read_bytes())
        (path / "namespace").write_text(self.namespace)
        return ({"KUBERNETES_SERVICE_HOST": api.host, "KUBERNETES_SERVICE_PORT": str(api.port)},
                {SA_MOUNT: path})

    def _env(self, container: dict) -> dict[str, str]:
        fields = {"metadata.name": self.name, "metadata.namespace": self.namespace,
                  "status.podIP": self.ip}
        env: dict[str, str] = dict(self.api_env)
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            else:
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    def _argv(self, container: dict, env: dict[str, str]) -> list[str]:
        mounts = {m["mountPath"]: self.mounts[m["name"]] for m in container.get("volumeMounts", [])}
        mounts.update(self.sa_mount)
        argv = []
        for a in container.get("command", []) + container.get("args", []):
            a = expand(a, env)
            argv.append(self.ip if a == "0.0.0.0" else host_path(a, mounts))
        if "--kv-host" in argv:
            argv = kv_loopback(argv, self.ip)
        assert "command" not in container, "the manifests use the image's entrypoint"
        # Cluster DNS names resolve through the test's endpoints file (make-tiny-model, an
        # init container, resolves none).
        return DNS_SHIM + [str(self.hosts_file)] + argv

    def _popen(self, container: dict, log) -> subprocess.Popen:
        env = self._env(container)
        proc_env = {"PATH": os.environ["PATH"], "HOME": str(self.dir), "PYTHONPATH": str(ROOT),
                    "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **env}
        return subprocess.Popen(self._argv(container, env), env=proc_env, cwd=self.dir,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for init in self.spec.get("initContainers", []):
            path = self.dir / f"init-{init['name']}.log"
            with open(path, "wb") as log:
                rc = self._popen(init, log).wait(timeout=120)
            assert rc == 0, f"{self.name}: init container {init['name']} exited {rc}: " \
                            f"{path.read_text()[-2000:]}"
        self._log = open(self.log_path, "wb")
        self.proc = self._popen(self.spec["containers"][0], self._log)

    @property
    def container(self) -> dict:
        return self.spec["containers"][0]

    def probe(self, kind: str) -> bool:
        return probe_ok(self.container[kind], self.ip)

    def wait_started(self, poll_s: float = 0.5) -> None:
        """The startup probe until it passes, within its periodSeconds x failureThreshold
        budget (polled more often than periodSeconds, to keep the test short)."""
        p = self.container["startupProbe"]
        deadline = time.monotonic() + p.get("periodSeconds", 10) * p.get("failureThreshold", 3)
        while not self.probe("startupProbe"):
            assert self.proc.poll() is None, f"{self.name} exited {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name} never started:\n{self.tail()}"
            time.sleep(poll_s)

    def terminate(self) -> int:
        """The preStop sleep (a kubelet's sleep action; it counts within the grace), SIGTERM,
        then SIGKILL after terminationGracePeriodSeconds; the exit code (-9: it had to be
        killed)."""
        grace = self.spec.get("terminationGracePeriodSeconds", 30)
        pre_stop = self.container.get("lifecycle", {}).get("preStop", {}).get("sleep", {})
        time.sleep(min(pre_stop.get("seconds", 0), grace))
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=max(grace - pre_stop.get("seconds", 0), 1))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            return -9

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self.proc is not None:
            self._log.close()

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions; a Service's plain map) on `labels`."""
    match = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if not all(labels.get(k) == v for k, v in match.items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": present and value in e.get("values", []),
              "NotIn": not present or value not in e.get("values", []),
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True


class Endpoints:
    """Headless Services' DNS answers: the IPs of their ready pods (the JSON file the
    gateway's resolver reads)."""

    def __init__(self, services: list[dict], path: Path):
        self.services, self.path = services, path
        self.ready: dict[str, Pod] = {}
        self.write()

    def set_ready(self, pod: Pod, ready: bool) -> None:
        if ready:
            self.ready[pod.name] = pod
        else:
            self.ready.pop(pod.name, None)
        self.write()

    def write(self) -> None:
        records = {}
        for svc in self.services:
            name = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
            records[name] = sorted(p.ip for p in self.ready.values()
                                   if selects(svc["spec"]["selector"], p.labels))
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        tmp.replace(self.path)
