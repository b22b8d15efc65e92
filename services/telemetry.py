"""What one server process sets up for operators: tracing, its metrics (and a /metrics
server), and for a worker on a GPU an energy meter. See `start_role_telemetry`."""
from __future__ import annotations

import logging
from typing import Any

from .energy import EnergyMeter, gpu_index, nvml_power_reader
from .metrics import Metrics, start_metrics_server
from .kv_tier_metrics import KvTierMetrics
from .step_metrics import StepMetrics
from .tracing import setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)


class RoleTelemetry:
    """What one server process sets up: tracing, its Metrics (+ /metrics server), and for a
    worker on a GPU an EnergyMeter, a step observer of its engine. See `start_role_telemetry`."""

    def __init__(self, metrics: Metrics, meter: EnergyMeter, server: Any, port: int):
        self.metrics, self.meter, self.server, self.port = metrics, meter, server, port
        # step time by shape (services/step_metrics.py), for `pdserve profile --from-url`
        self.steps = StepMetrics(metrics.role, metrics.registry) if metrics.role != "gateway" else None
        # the KV offload tiers' (services/kv_tier_metrics.py)
        self.tiers = KvTierMetrics(metrics.role, metrics.registry) if metrics.role != "gateway" else None

    def step_observers(self) -> list:
        """What the worker's engine should tell each step: the step-time counters, the
        decode worker's token path (engine_step), and the meter where it has a power reading. `watch_steps(engine)` once the engine exists."""
        path = self.metrics.token_path if self.metrics.role == "decode" else None   # engine_step
        return [o for o in (self.steps, self.meter if self.meter.available else None, path) if o]

    def watch_steps(self, engine) -> None:
        """The step counters read their requests' context from `engine`, the tier metrics
        its offload tiers."""
        if self.steps is not None:
            self.steps.bind(engine)
        if self.tiers is not None:
            self.tiers.bind(engine)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        shutdown_tracing()


def start_role_telemetry(role: str, *, host: str = "0.0.0.0", metrics_port: int | None = None,
                         trace_file: str = "", device: str = "cpu",
                         service_name: str = "", restarts: int = 0) -> RoleTelemetry:
    """Tracing as `pdserve-<role>` (trace_file: JSON-lines spans, see setup_tracing), a
    Metrics (`restarts`: a worker's --restarts), a /metrics server on metrics_port when it
    is given (0: a free port; None: none, e.g. the gateway serves /metrics on its HTTP app),
    an EnergyMeter for a CUDA device."""
    setup_tracing(service_name or f"pdserve-{role}", span_file=trace_file or None)
    metrics = Metrics(role, restarts=restarts)
    server, port = (None, 0)
    if metrics_port is not None:
        server, port = start_metrics_server(metrics.registry, host, metrics_port)
        log.info("%s metrics on http://%s:%d/metrics", role, host, port)
    idx = gpu_index(device) if role != "gateway" else None
    meter = EnergyMeter(nvml_power_reader(idx) if idx is not None else None, metrics.add_energy)
    return RoleTelemetry(metrics, meter, server, port)
