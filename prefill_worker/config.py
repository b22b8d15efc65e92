"""Typed configuration of a prefill worker (validated where it is built)."""
from __future__ import annotations

from dataclasses import dataclass

from services.worker_config import WorkerConfig


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    port: int = 50061
    kv_connect_timeout_s: float = 5.0    # connect + handshake to a decode KV endpoint
    kv_send_timeout_s: float = 30.0      # all layers sent after compute finished

    _positive = ("kv_connect_timeout_s", "kv_send_timeout_s", "drain_timeout_s")
    _ports = ("port", "metrics_port")
