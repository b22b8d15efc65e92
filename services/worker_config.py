"""The configuration both workers share: which model, how its engine is built, how the
process serves. Each worker's config extends it with its own fields (see prefill_worker/ and
decode_worker/config.py); the CLI options are generated from the dataclass fields, the
engine's flattened (`--block-size`, `--device`, ...: see engine.config.EngineOptions, which
holds their one default each)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from engine.config import EngineOptions

from .cli_args import check_ports
from .security import mtls_triple


def available_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota
    (a Kubernetes CPU limit) where one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = open(cpu_max).read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


@dataclass
class WorkerConfig:
    model_dir: str = field(metadata={"aliases": ["--model"], "help": "Hugging Face model directory"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    worker_id: str = field(default="", metadata={"help": "empty: <role>-<host>:<port>"})
    engine: EngineOptions = field(default_factory=EngineOptions)
    num_threads: int = field(default=0, metadata={"aliases": ["--threads"], "help": (
        "torch intra-op threads (CPU); 0: OMP_NUM_THREADS if set, else every core this "
        "process may run on (`pdserve up` gives each worker its share: --prefill-threads, "
        "--decode-threads)")})
    drain_timeout_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM, seconds to let requests in flight finish: a prefill worker hands "
                "its queued prompts back at once (UNAVAILABLE: the gateway retries them "
                "elsewhere); a decode worker ends the streams still running near the end "
                "(--drain-migrate-s) with UNAVAILABLE \"worker draining\", which the gateway "
                "migrates to another decode worker"})
    metrics_port: int = field(default=0, metadata={
        "help": "serve /metrics (plain text) on this port (0: off)"})
    trace_file: str = field(default="", metadata={
        "help": "append finished spans as JSON lines (tests); OTLP export: OTEL_* env"})
    kv_staging: str = field(default="host", metadata={
        "help": "where KV messages are staged: host (pinned host memory, any UCX transport) or "
                "device (GPU memory over UCX cuda_ipc/cuda_copy, one node; both workers alike)"})
    health_port: int = field(default=0, metadata={
        "help": "also serve grpc.health.v1 alone, plain text, on this port (0: off): for "
                "probes that cannot present the client certificate mTLS requires (the kubelet's)"})
    mtls_ca: str = field(default="", metadata={
        "help": "the operator's CA (PEM): internal RPCs only from peers with a certificate it signed"})
    mtls_cert: str = field(default="", metadata={
        "help": "this worker's certificate (PEM, signed by --mtls-ca)"})
    mtls_key: str = field(default="", metadata={"help": "PEM private key of --mtls-cert"})
    restarts: int = field(default=0, metadata={
        "help": "times a supervisor restarted this worker (`pdserve up` passes it from the "
                "second start on): its pdserve:process_restarts gauge"})
    internal_token_file: str = field(default="", metadata={
        "help": "the deployment's internal credential: a file holding one token (`pdserve up` "
                "makes one); every RPC of this worker then needs it (metadata 'authorization: "
                "Bearer TOKEN'), its own calls send it, transfer ids are signed with it "
                "(empty: internal RPCs are open)"})
    mtls_callers: str = field(default="", metadata={
        "help": "certificate common names (comma-separated) that may call this worker's RPCs "
                "other than Stats and health, i.e. the gateway's (empty: any certificate "
                "--mtls-ca signed)"})

    # fields each subclass checks as positive seconds / as ports
    _positive = ("drain_timeout_s",)
    _ports = ("metrics_port", "health_port")

    def __post_init__(self):
        if not self.model_dir:
            raise ValueError("model_dir is required")
        for name in self._positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        check_ports(**{name: getattr(self, name) for name in self._ports})
        if self.kv_staging not in ("host", "device"):
            raise ValueError(f"kv_staging must be 'host' or 'device', got {self.kv_staging!r}")
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0 (0: every core)")
        if self.restarts < 0:
            raise ValueError(f"restarts must be >= 0, got {self.restarts}")
        mtls_triple(self.mtls_ca, self.mtls_cert, self.mtls_key)
        if self.mtls_callers and not self.mtls_ca:
            raise ValueError("--mtls-callers needs --mtls-ca (callers are named by their certificates)")

    def build_engine(self, kv_connector=None, step_observers=(), decode_graphs: bool | None = None):
        """The LLMEngine this config describes (loads the model: call it off the event loop),
        with the worker's seams (engine/kv_connector.py, engine/step_observer.py).
        `decode_graphs=False`: no decode CUDA graphs (a prefill worker never replays them)."""
        from engine.llm_engine import LLMEngine
        return LLMEngine.from_model_dir(self.model_dir, self.engine, kv_connector=kv_connector,
                                        step_observers=step_observers, decode_graphs=decode_graphs)
