"""`pdserve planner`: the autoscaler of `pdserve up --autoscale`, acting on a Kubernetes cluster.

It runs the same `Autoscaler` (pdserve/autoscale.py) on the same signals (the gateway's
/metrics, plus the ready worker pods' found through their headless Services' DNS:
pdserve/planner_metrics.py), with a `KubeActuator` (pdserve/kube_client.py) in place of
the local launcher: a decision sets the prefill and decode Deployments' replicas through
their scale subresource, with the pod's ServiceAccount token. The Deployment controller
then starts or stops pods; a new worker is routed to only once its readiness probe passes
(the headless Services list ready pods only), and a removed one drains on SIGTERM (its
preStop and terminationGracePeriodSeconds, deploy/k8s/base). deploy/k8s/components/planner
holds the ServiceAccount, the Role (get on the two Deployments, get/patch on their scale
subresource, by name, nothing else), the RoleBinding and this Deployment.

Each interval:

    step()  ->  actuator.current()   GET both Deployments  (spec.replicas; readyReplicas kept)
            ->  signals: the gateway's /metrics + the pods'  (a failed scrape: hold, "unknown")
            ->  decision                              (never above --max-workers)
            ->  actuator.scale(p, d) if it changed    PATCH .../deployments/NAME/scale

A call the API refuses (401/403: the Role does not allow it; 409; 5xx) or cannot answer is
logged, with the API's message, and the planner holds: nothing changes until a later
interval's calls succeed. The plan (`Autoscaler.state()`; before the first decision, the
reason it holds) is served at `GET /plan` on --plan-port for the probes and the gateway's
status page (--planner-url), without an API call per request.

Do not run it together with HorizontalPodAutoscalers on the same Deployments: both would
write spec.replicas. The planner component deletes the autoscaling component's HPAs from
the render (deploy/README.md, "A planner instead of the HPAs").
"""
from __future__ import annotations

import logging
import signal
import ssl
import threading
from dataclasses import dataclass, field

from services.cli_args import config_from_args, dataclass_args

from .autoscale import AutoscaleConfig, Autoscaler, serve_plan
from .kube_client import SA_DIR, InCluster, KubeActuator, KubeClient, KubeError
from .planner_metrics import ClusterMetrics

log = logging.getLogger("pdserve.planner")


@dataclass
class PlannerConfig:
    gateway_url: str = field(metadata={
        "help": "the gateway's REST base URL, whose /metrics the planner reads (e.g. "
                "http://pdserve-gateway.NS.svc.cluster.local:8000)"})
    prefill_deployment: str = field(metadata={"help": "the prefill pool's Deployment"})
    decode_deployment: str = field(metadata={"help": "the decode pool's Deployment"})
    autoscale: AutoscaleConfig   # --slo-ttft-ms, --slo-itl-ms, --max-workers, --interval-s, ...
    namespace: str = field(default="", metadata={
        "help": "the Deployments' namespace (empty: the ServiceAccount's)"})
    prefill_metrics_dns: str = field(default="", metadata={
        "help": "host:port of the prefill pods' /metrics through their headless Service (one "
                "record per ready pod), added to the gateway's (pdserve/planner_metrics.py)"})
    decode_metrics_dns: str = field(default="", metadata={
        "help": "the same for the decode pods"})
    profile: str = field(default="", metadata={
        "help": "a profile from `pdserve profile` (JSON) measured on the pools' hardware "
                "(empty: the built-in example profile, a small CPU model's)"})
    kube_sa_dir: str = field(default=SA_DIR, metadata={
        "help": "the ServiceAccount directory the kubelet mounts (token, ca.crt, namespace)"})
    api_timeout_s: float = field(default=5.0, metadata={
        "help": "timeout of each Kubernetes API call and of each /metrics scrape"})
    gateway_ca: str = field(default="", metadata={
        "help": "CA (PEM) that signs an https --gateway-url's certificate (empty: the "
                "system's trust store)"})
    plan_host: str = field(default="0.0.0.0", metadata={"help": "address /plan binds"})
    plan_port: int = field(default=8090, metadata={"help": "port of GET /plan (0: off)"})


def add_parser(sub) -> None:
    p = sub.add_parser("planner", allow_abbrev=False,
                       help="autoscale the prefill and decode Deployments of a Kubernetes "
                            "cluster through the API (in a pod, with its ServiceAccount)",
                       description=__doc__.splitlines()[0])
    dataclass_args(p, PlannerConfig)
    p.set_defaults(func=_run)


def _run(args) -> int:
    try:
        cfg = config_from_args(PlannerConfig, args)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"pdserve planner: {e}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())   # the pod's termination: exit 0
    return run(cfg, stop)


def build(cfg: PlannerConfig) -> Autoscaler:
    kube = InCluster.from_env(cfg.kube_sa_dir)
    namespace = cfg.namespace or kube.namespace
    if not namespace:
        raise SystemExit("pdserve planner: no --namespace and no ServiceAccount namespace file")
    actuator = KubeActuator(KubeClient(kube, cfg.api_timeout_s), namespace,
                            cfg.prefill_deployment, cfg.decode_deployment,
                            cfg.autoscale.max_workers)
    context = ssl.create_default_context(cafile=cfg.gateway_ca or None) \
        if cfg.gateway_url.startswith("https:") else None
    source = ClusterMetrics(cfg.gateway_url, [cfg.prefill_metrics_dns, cfg.decode_metrics_dns],
                            cfg.api_timeout_s, context)
    return Autoscaler(cfg.autoscale, source, actuator, load_profile(cfg.profile))


def load_profile(path: str):
    from sim.profile import Profile, example
    if path:
        return Profile.load(path)
    log.warning("planner: no --profile: planning with the built-in example profile")
    return example()


class PlanView:
    """What GET /plan serves: the autoscaler's state() once it has decided, before that the
    I2 shape with the reason it holds, so /plan (the probes', the status page's) never calls
    the Kubernetes API itself. `holding`: why the last interval held on a failure ("" after
    a step that succeeded), put first in the reasons."""

    def __init__(self, autoscaler: Autoscaler):
        self.autoscaler, self.holding = autoscaler, "no decision yet"

    def state(self) -> dict:
        if self.autoscaler.last is None:
            return {"mode": "autoscale", "target": {}, "current": {}, "reasons": [self.holding],
                    "signals": {"known": False}, "updated_unix": 0.0, "history": [],
                    "max_workers": self.autoscaler.cfg.max_workers}
        state = self.autoscaler.state(live=False)   # the last step's replicas: no API call
        if self.holding:
            state["reasons"] = [self.holding] + state["reasons"]
        return state


def step_or_hold(autoscaler: Autoscaler, view: PlanView) -> bool:
    """One interval; a refused or unanswered API call (or any other failure) is logged and
    held (False): the next interval tries again."""
    try:
        d = autoscaler.step()
    except KubeError as e:
        view.holding = f"kubernetes API: {e}: holding"
        log.warning("kubernetes API: %s; holding, retrying next interval", e)
        return False
    except Exception as e:   # noqa: BLE001 - the budget check, a planning bug: never fatal
        view.holding = f"step failed ({type(e).__name__}: {e}): holding"
        log.exception("planner step failed; holding, retrying next interval")
        return False
    view.holding = ""
    obs = autoscaler.actuator.observed
    log.info("plan %dP%dD (ready %sP%sD): %s", d.prefill, d.decode,
             obs.get("prefill", {}).get("ready"), obs.get("decode", {}).get("ready"),
             "; ".join(d.reasons))
    return True


def run(cfg: PlannerConfig, stop: threading.Event) -> int:
    autoscaler = build(cfg)
    view = PlanView(autoscaler)
    server = serve_plan(view, cfg.plan_host, cfg.plan_port) if cfg.plan_port else None
    log.info("planner: %s and %s in %s, budget %d workers, every %.1f s", cfg.prefill_deployment,
             cfg.decode_deployment, autoscaler.actuator.base, cfg.autoscale.max_workers,
             cfg.autoscale.interval_s)
    try:
        while not stop.is_set():
            step_or_hold(autoscaler, view)
            stop.wait(cfg.autoscale.interval_s)
    finally:
        if server is not None:
            server.shutdown()
    return 0
