"""Typed configuration of the gateway; `pdserve gateway` options are generated from it."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.gguf import find_gguf, open_gguf
from engine.tokenizer import has_tokenizer
from services.cli_args import check_ports
from services.security import mtls_triple, tls_pair


METRICS_PREFIXES = ("pdserve", "vllm")      # pdserve:... or vLLM's own names (vllm:...)
DISAGGREGATION_MODES = ("always", "never", "auto")     # gateway/disagg.py's MODES


def check_metrics_prefix(prefix: str) -> None:
    """--metrics-prefix of the gateway and of `pdserve up` (ValueError unless one of them)."""
    if prefix not in METRICS_PREFIXES:
        raise ValueError(f"--metrics-prefix must be one of {', '.join(METRICS_PREFIXES)}, "
                         f"got {prefix!r}")


@dataclass
class GatewayConfig:
    model: str = field(default="", metadata={
        "help": "HF model directory (only its tokenizer and config.json are read); "
                "`pdserve gateway` without it: the embedded tiny model"})
    served_model_name: str = field(default="", metadata={
        "help": "model id clients use; empty: the model directory's name, or a GGUF file's "
                "less .gguf and its weight type (SmolLM2-135M-Instruct.Q4_1.gguf -> "
                "SmolLM2-135M-Instruct)"})
    models_file: str = field(default="", metadata={
        "help": "serve several models, each with its own pools: a JSON list of {name, model, "
                "prefill|prefill_dns, decode|decode_dns} (gateway/models.py); replaces "
                "--model, --served-model-name and the pool options"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    grpc_port: int = field(default=50051, metadata={"help": "public gRPC port (0: any free)"})
    http_port: int = field(default=0, metadata={"help": "OpenAI REST port (0: disabled)"})
    api_key: str = field(default="", metadata={
        "help": "an accepted API key: REST 'Authorization: Bearer KEY', gRPC metadata "
                "'authorization: Bearer KEY' (no key and no key file: open); it shows in "
                "`ps`: the PDSERVE_API_KEY environment variable (read when this is empty) "
                "or --api-key-file does not"})
    api_key_file: str = field(default="", metadata={
        "help": "API keys, one a line ('KEY [rpm=N] [concurrency=N]', # comments), re-read "
                "when the file changes"})
    api_key_rpm: int = field(default=0, metadata={
        "help": "requests per minute per key, unless its line says (0: unlimited; over: 429)"})
    api_key_concurrency: int = field(default=0, metadata={
        "help": "requests in flight per key, unless its line says (0: unlimited; over: 429)"})
    tls_cert: str = field(default="", metadata={
        "help": "PEM certificate chain of the public gRPC and REST ports (with --tls-key: TLS)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    mtls_ca: str = field(default="", metadata={
        "help": "the operator's CA (PEM): workers are reached over mTLS, verified against it"})
    mtls_cert: str = field(default="", metadata={
        "help": "this gateway's client certificate (PEM, signed by --mtls-ca)"})
    mtls_key: str = field(default="", metadata={"help": "PEM private key of --mtls-cert"})
    mtls_server_name: str = field(default="", metadata={
        "help": "name to verify in worker certificates (empty: the address's host)"})
    internal_token_file: str = field(default="", metadata={
        "help": "the deployment's internal credential (a file holding one token, `pdserve up` "
                "makes one): sent on every call to the workers, which require it"})
    metrics_port: int = field(default=0, metadata={
        "help": "serve Prometheus /metrics (plain text) on this port (0: off; the REST app "
                "serves /metrics too)"})
    worker_metrics: str = field(default="", metadata={
        "help": "workers' /metrics to include in this gateway's, each labelled worker=ID: "
                "ID=URL,ID=URL (`pdserve up` passes its workers')"})
    worker_metrics_file: str = field(default="", metadata={
        "help": "more workers' /metrics as a file of ID=URL lines, re-read at every scrape "
                "(`pdserve up --autoscale` rewrites it as workers come and go)"})
    planner_url: str = field(default="", metadata={
        "help": "the autoscaler's GET /plan URL, shown on the REST port's /status page "
                "(fetched by the gateway, cached a few seconds; empty: no planner attached)"})
    metrics_prefix: str = field(default="pdserve", metadata={
        "help": "metric name prefix: pdserve (pdserve:...) or vllm (vllm:..., the names "
                "vLLM's dashboards query)"})
    trace_file: str = field(default="", metadata={
        "help": "append finished trace spans as JSON lines to this file (tests); OTLP export "
                "is enabled by OTEL_EXPORTER_OTLP_ENDPOINT"})
    prefill: str = field(default="", metadata={"help": "prefill workers, host:port,host:port"})
    decode: str = field(default="", metadata={"help": "decode workers, host:port,host:port"})
    prefill_dns: str = field(default="", metadata={
        "help": "prefill workers as one DNS name:port (e.g. a headless Service)"})
    decode_dns: str = field(default="", metadata={"help": "decode workers as one DNS name:port"})
    prefill_file: str = field(default="", metadata={
        "help": "prefill workers as a file of addresses, one per line, re-read every "
                "--discovery-interval-s (`pdserve up --autoscale` rewrites it)"})
    decode_file: str = field(default="", metadata={
        "help": "decode workers as a file of addresses, as --prefill-file"})
    discovery_interval_s: float = field(default=5.0, metadata={
        "help": "seconds between DNS or file refreshes"})
    health_interval_s: float = field(default=1.0, metadata={
        "help": "seconds between health/Stats probes of each worker"})
    probe_timeout_s: float = field(default=1.0, metadata={"help": "deadline of one probe"})
    wait_for_workers_s: float = field(default=0.0, metadata={
        "help": "at start, report SERVING (and print the ready line) only once every worker "
                "listed is healthy, probing those that are not every 0.1 s, for up to this "
                "long (0: at once); `pdserve up` starts the gateway beside its workers so"})
    stall_timeout_s: float = field(default=3.0, metadata={
        "help": "a worker whose probes go unanswered this long (stalled, not draining) has "
                "its calls moved: decode streams migrate, Prefills are retried elsewhere"})
    drain_timeout_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM: NOT_SERVING, stop accepting, and wait up to this long for the "
                "requests in flight (then they are cancelled) before exiting"})
    request_timeout_s: float = field(default=120.0, metadata={
        "help": "deadline of one request, end to end, before its tokens: the deadline is this "
                "+ (prompt tokens + max_tokens) x --request-timeout-per-token-s, at most "
                "--max-request-timeout-s (max_tokens unset: the context's room)"})
    request_timeout_per_token_s: float = field(default=0.1, metadata={
        "help": "seconds the deadline grows per token asked for (prompt + max_tokens)"})
    max_request_timeout_s: float = field(default=3600.0, metadata={
        "help": "the longest deadline a request gets, however many tokens it asks for"})
    kv_timeout_ms: int = field(default=0, metadata={
        "help": "KV reservation idle window asked of decode workers: a reservation expires "
                "this long without KV arriving (0: their --kv-expiry-s)"})
    max_model_len: int = field(default=0, metadata={
        "help": "context length until the workers report theirs (Stats); 0: "
                "max_position_embeddings from config.json"})
    migrate_on_decode_failure: bool = field(default=True, metadata={
        "help": "if a decode worker dies mid-stream, re-prefill prompt + tokens so far on "
                "another pair and continue the stream"})
    max_in_flight: int = field(default=4096, metadata={
        "help": "requests in flight at once (each choice of n counts); over: 429 / "
                "RESOURCE_EXHAUSTED with a retry hint"})
    slo_ttft_ms: float = field(default=0.0, metadata={
        "help": "time-to-first-token SLO: new requests are refused (429) while admitting them "
                "would break it (an adaptive limit on requests in flight; 0: off)"})
    slo_itl_ms: float = field(default=0.0, metadata={
        "help": "inter-token latency SLO (mean time per output token), as --slo-ttft-ms"})
    peer_fetch: str = field(default="on", metadata={
        "help": "on: a Prefill names a peer prefill worker holding more of the prompt's leading "
                "blocks (KV events) for the chosen one to fetch over the KV transport instead "
                "of computing them (gateway/peer_prefix.py); off: never"})
    peer_fetch_min_blocks: int = field(default=4, metadata={
        "help": "fetch from a peer only when it holds at least this many more leading blocks"})
    affinity_slack: int = field(default=16, metadata={
        "help": "prefix affinity wins while its worker has at most this many more requests "
                "in flight than the least loaded one"})
    affinity_slack_ratio: float = field(default=1.5, metadata={
        "help": "prefix affinity also wins while its worker has at most this many times the "
                "least loaded one's requests in flight (0: the absolute slack alone)"})
    decode_affinity_slack: int = field(default=2, metadata={
        "help": "a decode worker: prefix affinity wins only while its worker has at most this "
                "many more requests in flight than the least loaded one (decode load sets "
                "every stream's token rate; a decode-side prefix hit saves only KV transfer)"})
    prefix_routing: str = field(default="events", metadata={
        "help": "events: pick workers by the prompt tokens their KV cache holds (the workers' "
                "KV events) against their load (gateway/affinity.py); none: least loaded only"})
    prefix_weight_host: float = field(default=0.75, metadata={
        "help": "a prompt block a worker holds in host memory counts this much of one it holds "
                "on the device (it must be copied back)"})
    prefix_weight_disk: float = field(default=0.5, metadata={
        "help": "a prompt block a worker holds on local disk counts this much of a device one"})
    prefix_weight_recompute: float = field(default=1.0, metadata={
        "help": "a prompt token a worker's cache saves counts 1 + this many queued tokens "
                "(it is not computed again, for this request or those queued after it; 0: "
                "this request's wait alone; gateway/affinity.py)"})
    disaggregation: str = field(default="auto", metadata={
        "help": "who computes a prompt: always a prefill worker (its KV handed to the decode "
                "worker), never (the decode worker itself: colocated; no prefill workers "
                "needed), or auto: per request, whichever pays (gateway/disagg.py)"})
    profile: str = field(default="", metadata={
        "help": "a cost profile from `pdserve profile` (JSON) seeding --disaggregation auto's "
                "prefill and handover costs (empty: defaults; both are learnt online)"})
    disagg_max_local_tokens: int = field(default=64, metadata={
        "help": "auto: the decode worker computes a prompt itself when the part of it that "
                "worker does not hold (its prefix cache, as its KV events say) is "
                "at most this many tokens, unless it is too loaded"})
    disagg_max_stall_ms: float = field(default=50.0, metadata={
        "help": "auto: a decode worker with streams running computes no prompt whose "
                "estimated prefill takes longer than this (it stalls them; 0: no bound)"})

    def __post_init__(self):
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"--disaggregation must be one of {', '.join(DISAGGREGATION_MODES)}, "
                             f"got {self.disaggregation!r}")
        if self.disagg_max_local_tokens < 0 or self.disagg_max_stall_ms < 0:
            raise ValueError("disagg_max_local_tokens and disagg_max_stall_ms must be >= 0")
        if self.wait_for_workers_s < 0:
            raise ValueError(f"wait_for_workers_s must be >= 0, got {self.wait_for_workers_s}")
        if self.health_interval_s <= 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.peer_fetch not in ("on", "off"):
            raise ValueError(f"--peer-fetch must be on or off, got {self.peer_fetch!r}")
        if self.peer_fetch_min_blocks < 1:
            raise ValueError(f"--peer-fetch-min-blocks must be >= 1, got {self.peer_fetch_min_blocks}")
        if self.affinity_slack_ratio < 0:
            raise ValueError(f"affinity_slack_ratio must be >= 0, got {self.affinity_slack_ratio}")
        if self.prefix_routing not in ("events", "none"):
            raise ValueError(f"--prefix-routing must be events or none, got {self.prefix_routing!r}")
        for name in ("prefix_weight_host", "prefix_weight_disk"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.prefix_weight_recompute < 0:
            raise ValueError(f"prefix_weight_recompute must be >= 0, got {self.prefix_weight_recompute}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.request_timeout_per_token_s < 0 or self.max_request_timeout_s < self.request_timeout_s:
            raise ValueError("request_timeout_per_token_s must be >= 0 and max_request_timeout_s "
                             ">= request_timeout_s")
        per_model = ("model", "served_model_name", "prefill", "decode", "prefill_dns",
                     "decode_dns", "prefill_file", "decode_file", "max_model_len")
        if self.models_file and any(getattr(self, k) for k in per_model):
            raise ValueError("--models-file names each model and its pools: give none of "
                             + ", ".join("--" + k.replace("_", "-") for k in per_model))
        for pool in ("prefill", "decode"):
            if sum(bool(getattr(self, pool + x)) for x in ("", "_dns", "_file")) > 1:
                raise ValueError(f"give only one of --{pool}, --{pool}-dns, --{pool}-file (not both)")
        if self.max_in_flight < 1 or self.slo_ttft_ms < 0 or self.slo_itl_ms < 0:
            raise ValueError("max_in_flight must be >= 1, slo_ttft_ms and slo_itl_ms >= 0")
        if self.api_key_rpm < 0 or self.api_key_concurrency < 0:
            raise ValueError("api_key_rpm and api_key_concurrency must be >= 0")
        tls_pair("tls_cert", self.tls_cert, "tls_key", self.tls_key)
        mtls_triple(self.mtls_ca, self.mtls_cert, self.mtls_key)
        check_metrics_prefix(self.metrics_prefix)
        if any("=" not in x for x in self.worker_metrics.split(",") if x.strip()):
            raise ValueError(f"--worker-metrics: expected ID=URL,ID=URL, got {self.worker_metrics!r}")
        if self.planner_url and not re.match(r"https?://", self.planner_url):
            raise ValueError(f"--planner-url must be an http(s) URL, got {self.planner_url!r}")
        check_ports(grpc_port=self.grpc_port, http_port=self.http_port,
                    metrics_port=self.metrics_port)

    def worker_metrics_urls(self) -> dict[str, str]:
        """--worker-metrics, and the lines of --worker-metrics-file as it reads now (a file
        that cannot be read adds nothing: its workers are then absent from a scrape)."""
        items = [x for x in self.worker_metrics.split(",") if x.strip()]
        if self.worker_metrics_file:
            try:
                items += Path(self.worker_metrics_file).read_text().splitlines()
            except OSError:
                pass
        return dict(x.strip().split("=", 1) for x in items if "=" in x)

    def resolved_model_dir(self) -> Path:
        """The model directory (the launcher fills in the embedded default: making it needs
        torch, which the gateway process never imports)."""
        if not self.model:
            raise ValueError("the gateway needs --model (a directory with tokenizer.json, "
                             "or a GGUF file)")
        d = Path(self.model).expanduser()
        if not has_tokenizer(d):
            raise ValueError(f"model directory {str(d)!r} has no tokenizer.json")
        return d

    def model_name(self, model_dir: Path) -> str:
        """The id clients send: --served-model-name, else `default_model_id`."""
        return self.served_model_name or default_model_id(model_dir)

    def context_length(self, model_dir: Path) -> int:
        """max_model_len, else config.json's max_position_embeddings (0: unknown)."""
        return self.max_model_len or int(_model_config(model_dir).get("max_position_embeddings") or 0)

    def vocab_size(self, model_dir: Path) -> int:
        """config.json's vocab_size: prompt ids must be below it (0: unknown). The tokenizer's
        own count may be smaller (models pad their embedding table)."""
        return int(_model_config(model_dir).get("vocab_size") or 0)


# llama.cpp's weight-type tags as GGUF file names end in them: .Q4_1, -Q4_K_M, .IQ4_XS, .F16
_GGUF_TYPE = re.compile(r"[.-](?:I?Q\d\w*|BF16|FP?16|FP?32)$", re.IGNORECASE)


def default_model_id(model_dir: Path) -> str:
    """A model's id without --served-model-name: its directory's name, or a GGUF file's name
    less `.gguf` and its weight-type tag (SmolLM2-135M-Instruct.Q4_1.gguf ->
    SmolLM2-135M-Instruct), as Ollama and LM Studio name such files."""
    name = Path(model_dir).name
    if not name.lower().endswith(".gguf"):
        return name
    return _GGUF_TYPE.sub("", name[:-len(".gguf")]) or name[:-len(".gguf")]


def _model_config(model_dir: Path) -> dict:
    if find_gguf(model_dir) is not None:
        return open_gguf(model_dir).hf_config()
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
