"""Typed configuration of a prefill worker (validated where it is built)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.worker_config import WorkerConfig


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    port: int = 50061
    kv_connect_timeout_s: float = 5.0    # connect + handshake to a decode KV endpoint
    kv_send_timeout_s: float = 30.0      # all layers sent after compute finished
    max_queued_prefill_tokens: int = field(default=65536, metadata={
        "help": "prompt tokens queued or computing at once; past it (or when a busy worker's "
                "measured prefill cost cannot finish a prompt before its decode reservation "
                "expires) new work is refused with RESOURCE_EXHAUSTED (a longer prompt runs "
                "alone)"})
    max_queue_delay_factor: float = field(default=10.0, metadata={
        "help": "refuse (RESOURCE_EXHAUSTED: the gateway tries another worker, then 429 with "
                "Retry-After) a prompt whose wait behind the work queued ahead would exceed "
                "this many times its own compute, as this worker measures it (at least 1 s; "
                "an idle worker refuses nothing; 0: off). Keeps latency under overload "
                "without SLOs"})
    decode: str = field(default="", metadata={
        "help": "decode workers (gRPC host:port,...) this worker may push KV to: it sends only "
                "to the KV endpoints they announce"})
    decode_dns: str = field(default="", metadata={
        "help": "the decode workers as one DNS name:port (e.g. a headless Service)"})
    decode_file: str = field(default="", metadata={
        "help": "the decode workers as a file of addresses, one per line, re-read as "
                "--decode-refresh-s says (`pdserve up --autoscale` rewrites it)"})
    decode_refresh_s: float = field(default=5.0, metadata={
        "help": "re-read the decode workers' listing and KV endpoints this often, besides "
                "whenever a Prefill names an endpoint not known (0: only then)"})
    mtls_server_name: str = field(default="", metadata={
        "help": "name to verify in decode workers' certificates (empty: the address's host)"})

    _positive = ("kv_connect_timeout_s", "kv_send_timeout_s", "drain_timeout_s")
    _ports = ("port", "metrics_port", "health_port")

    def __post_init__(self):
        super().__post_init__()
        if sum(map(bool, (self.decode, self.decode_dns, self.decode_file))) > 1:
            raise ValueError("give one of --decode, --decode-dns, --decode-file")
        if self.max_queued_prefill_tokens < 1:
            raise ValueError("max_queued_prefill_tokens must be >= 1")
        if self.decode_refresh_s < 0:
            raise ValueError("decode_refresh_s must be >= 0 (0: only when an endpoint is not known)")
        if self.max_queue_delay_factor < 0:
            raise ValueError("max_queue_delay_factor must be >= 0 (0: off)")
