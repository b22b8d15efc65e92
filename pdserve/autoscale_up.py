"""`pdserve up --autoscale`: the Autoscaler (pdserve/autoscale.py) in a thread of the
supervisor, over the launcher's live pools (pdserve/autoscale_local.py).

    UpAutoscaler(cfg)        before the launcher starts: a free port for /plan and one for
                             the gateway's /metrics; gateway_args() hands the gateway
                             --planner-url http://HOST:PORT/plan and --metrics-port
    start(launcher, stop)    after "pdserve ready": GET /plan served, one line
                             "pdserve autoscale: plan=URL ...", the loop in a daemon thread
                             (each change told as a line: "autoscale: 1 colocated -> 1P1D: ...")
    stop()                   the loop and /plan stopped (the launcher then stops everything)

The profile: --profile, else bench/profiles/smollm2-2core.json of this checkout, else the
built-in example; the workers' measured steps correct it as they run. P = 0 (colocated) is
a target only where the gateway prefills locally (`--disaggregation` auto or never).
"""
from __future__ import annotations

import threading
from pathlib import Path

from sim.profile import Profile, example

from .autoscale import AutoscaleConfig, Autoscaler, serve_plan
from .autoscale_local import LocalActuator
from .autoscale_signals import MetricsSource
from .processes import free_port

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "bench" / "profiles" / "smollm2-2core.json"


def load_profile(path: str) -> tuple[Profile, str]:
    if path:
        return Profile.load(path), path
    if DEFAULT_PROFILE.is_file():
        return Profile.load(DEFAULT_PROFILE), str(DEFAULT_PROFILE)
    return example(), "the built-in example profile"


class UpAutoscaler:
    def __init__(self, cfg):
        self.cfg = cfg
        self.allow_colocated = getattr(cfg, "disaggregation", "always") != "always"
        self.config = AutoscaleConfig(cfg.slo_ttft_ms, cfg.slo_itl_ms, cfg.max_workers,
                                      interval_s=cfg.autoscale_interval_s,
                                      allow_colocated=self.allow_colocated)
        self.profile, self.profile_from = load_profile(cfg.profile)
        self.plan_port = free_port(cfg.host)
        self.metrics_port = free_port(cfg.host)
        self._stop = threading.Event()
        self.server = None

    @property
    def plan_url(self) -> str:
        return f"http://{self.cfg.host}:{self.plan_port}/plan"

    def gateway_args(self) -> list[str]:
        return ["--planner-url", self.plan_url, "--metrics-port", str(self.metrics_port)]

    def start(self, launcher, stop: threading.Event) -> Autoscaler:
        source = MetricsSource(f"http://{self.cfg.host}:{self.metrics_port}/metrics")
        actuator = LocalActuator(launcher, self.cfg.max_workers, self.cfg.ready_timeout)
        self.autoscaler = Autoscaler(self.config, source, actuator, self.profile,
                                     scheduler=self.cfg.engine.scheduler)
        self.autoscaler.notify = launcher.say
        self.server = serve_plan(self.autoscaler, self.cfg.host, self.plan_port)
        print(f"pdserve autoscale: plan={self.plan_url} every {self.config.interval_s:g} s, "
              f"at most {self.config.max_workers} workers, SLO TTFT {self.cfg.slo_ttft_ms:g} ms "
              f"ITL {self.cfg.slo_itl_ms:g} ms, colocated "
              f"{'allowed' if self.allow_colocated else 'not allowed'}, profile "
              f"{self.profile_from}", flush=True)

        def loop():
            self._stop.wait(self.config.interval_s / 2)    # the gateway's first probes
            self.autoscaler.run(self._stop)
        threading.Thread(target=loop, name="autoscale", daemon=True).start()
        threading.Thread(target=lambda: (stop.wait(), self._stop.set()), daemon=True).start()
        return self.autoscaler

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
