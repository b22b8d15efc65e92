"""Typed configuration of a decode worker (validated where it is built)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.worker_config import WorkerConfig

KV_FAILURE_POLICIES = ("fail", "recompute")


@dataclass
class DecodeWorkerConfig(WorkerConfig):
    port: int = 50071
    kv_host: str = ""                    # address the KV endpoint binds and advertises; empty: host
    kv_port: int = 0                     # KV endpoint (UCX bootstrap, TCP) port; 0 = a free port
    kv_expiry_s: float = field(default=30.0, metadata={
        "help": "a KV reservation's idle window (requests may ask their own, kv_timeout_ms): it "
                "expires this long after the reservation, or after the last KV message, with "
                "no more KV arriving; the first token is due this long after the last layer"})
    kv_max_reservation_s: float = field(default=600.0, metadata={
        "help": "hard bound on a KV reservation, however steadily its KV arrives: a prompt the "
                "prefill workers cannot compute in this long is refused before any compute"})
    kv_failure_policy: str = "fail"      # fail | recompute (requests may override)
    max_reservations_per_caller: int = field(default=0, metadata={
        "help": "KV reservations (Decode calls waiting for their prompt's KV) one caller may "
                "hold at once: its certificate's name under mTLS, else its address; past it "
                "RESOURCE_EXHAUSTED (0, the default: no cap of its own, max_num_seqs caps them "
                "all; set it when several gateways share the decode workers, so that one cannot "
                "hold every slot: with the internal credential nobody else can call)"})

    max_waiting_reservations: int = field(default=512, metadata={
        "help": "Decode calls that may wait at once for room for their KV reservation (a "
                "running request to end: max_num_seqs or the blocks are taken), in arrival "
                "order, each at most --kv-max-reservation-s; past it RESOURCE_EXHAUSTED (the "
                "gateway tries another worker, then 429). 0: never wait"})

    drain_migrate_s: float = field(default=5.0, metadata={
        "help": "this long before the end of a drain (--drain-timeout-s; at most half of it) "
                "the streams still running end with UNAVAILABLE \"worker draining\" and the "
                "gateway migrates them (prompt + tokens so far, on another decode worker), so "
                "none races the deadline; a structured-output stream (which cannot migrate) "
                "keeps running to the end of the drain"})

    _positive = ("kv_expiry_s", "kv_max_reservation_s", "drain_timeout_s")
    _ports = ("port", "kv_port", "metrics_port", "health_port")

    def __post_init__(self):
        super().__post_init__()
        if self.drain_migrate_s < 0:
            raise ValueError(f"drain_migrate_s must be >= 0, got {self.drain_migrate_s}")
        if self.max_waiting_reservations < 0:
            raise ValueError("max_waiting_reservations must be >= 0")
        if self.max_reservations_per_caller < 0:
            raise ValueError("max_reservations_per_caller must be >= 0")
        if self.kv_max_reservation_s < self.kv_expiry_s:
            raise ValueError(f"kv_max_reservation_s ({self.kv_max_reservation_s}) must be >= "
                             f"kv_expiry_s ({self.kv_expiry_s})")
        if self.kv_failure_policy not in KV_FAILURE_POLICIES:
            raise ValueError(f"kv_failure_policy must be one of {KV_FAILURE_POLICIES}, "
                             f"got {self.kv_failure_policy!r}")
