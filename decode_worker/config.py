"""Typed configuration of a decode worker (validated where it is built)."""
from __future__ import annotations

from dataclasses import dataclass

KV_FAILURE_POLICIES = ("fail", "recompute")


@dataclass
class DecodeWorkerConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 50071
    worker_id: str = ""                  # empty: "decode-<host>:<port>"
    kv_host: str = ""                    # address advertised for KV; empty: host
    kv_port: int = 0                     # KV receiver (UCX) port; 0 = a free port
    kv_expiry_s: float = 30.0            # reservation deadline (KV + first token) by default
    kv_failure_policy: str = "fail"      # fail | recompute (requests may override)
    block_size: int = 16
    num_blocks: int | None = None        # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 0.5
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: str = "auto"
    kernel_backend: str = "auto"
    num_threads: int = 1                 # torch intra-op threads (CPU)
    drain_timeout_s: float = 30.0
    metrics_port: int = 0                # /metrics (plain text) on this port; 0 = off
    trace_file: str = ""                 # append finished spans as JSON lines (tests); OTLP: OTEL_* env

    def __post_init__(self):
        if not self.model_dir:
            raise ValueError("model_dir is required")
        if self.kv_failure_policy not in KV_FAILURE_POLICIES:
            raise ValueError(f"kv_failure_policy must be one of {KV_FAILURE_POLICIES}, "
                             f"got {self.kv_failure_policy!r}")
        for name in ("kv_expiry_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("port", "kv_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")
        if self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
