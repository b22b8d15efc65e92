"""Typed configuration of a prefill worker (validated where it is built)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillWorkerConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 50061
    worker_id: str = ""                  # empty: "prefill-<host>:<port>"
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
    kv_connect_timeout_s: float = 5.0    # connect + handshake to a decode KV endpoint
    kv_send_timeout_s: float = 30.0      # all layers sent after compute finished
    drain_timeout_s: float = 30.0
    metrics_port: int = 0                # /metrics (plain text) on this port; 0 = off
    trace_file: str = ""                 # append finished spans as JSON lines (tests); OTLP: OTEL_* env

    def __post_init__(self):
        if not self.model_dir:
            raise ValueError("model_dir is required")
        for name in ("kv_connect_timeout_s", "kv_send_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
