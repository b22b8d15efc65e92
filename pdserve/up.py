"""The `pdserve up` command: its options (`UpConfig`: the system's shape and ports plus every
engine option), what it hands each process (`worker_args`, `gateway_argv`), and `main`: check
the ports, fetch the default model if none is given, start everything through
`pdserve.launcher.Launcher` (its docstring draws the start-up, supervision and shutdown),
print the ready line and supervise until SIGINT/SIGTERM. With `--autoscale` the pools are
live (pdserve/autoscale_up.py: the Autoscaler in a thread of this supervisor, its /plan on
a free port handed to the gateway as --planner-url).
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from engine.config import EngineOptions
from gateway.auth import API_KEY_ENV
from gateway.config import DISAGGREGATION_MODES, check_metrics_prefix, default_model_id
from services.cli_args import check_ports
from services.security import exposed, mtls_triple, tls_pair
from services.worker_config import available_cores

from .launcher import Launcher, _say, flag_value
from .processes import LaunchError, ModelPools

# --disaggregation auto's two bounds, (--disagg-max-local-tokens, --disagg-max-stall-ms): the
# gateway's defaults, and this command's on the CPU, where every worker it starts shares this
# host's cores: a prefill worker isolates nothing from a decode worker's streams there (its
# compute takes the same cores, and the handover more), so a prompt whose uncached part is
# short is computed where it is decoded, and no stall bound applies (longer ones go by the
# measured costs). 16 streams of 96-token prompts on 2 cores: 2.23x llama-server's output
# against 1.88x with the gateway's bounds, ITL p90 0.49x against 0.62x (bench/RESULTS.md).
GATEWAY_DISAGG = (64, 50.0)
CPU_DISAGG = (256, 0.0)


@dataclass
class UpConfig:
    """`pdserve up`: the system's shape and ports, and the engine options of every worker."""
    model: str = field(default="", metadata={
        "help": "HF model directory, or a .gguf file (empty: SmolLM2-135M-Instruct, fetched "
                "on first use; see pdserve/default_model.py)"})
    models_file: str = field(default="", metadata={
        "help": "serve several models, each with its own workers: a JSON list of {name, model, "
                "prefill, decode} (worker counts); replaces --model, --prefill, --decode"})
    served_model_name: str = field(default="", metadata={
        "help": "the model id clients send (empty: the model directory's name, or a GGUF "
                "file's less .gguf and its weight type, e.g. SmolLM2-135M-Instruct)"})
    prefill: int = field(default=1, metadata={
        "help": "number of prefill workers (0: none; the decode workers compute every prompt, "
                "a colocated server: needs --disaggregation never or auto)"})
    decode: int = field(default=1, metadata={"help": "number of decode workers"})
    host: str = field(default="127.0.0.1", metadata={"help": "address every process binds"})
    grpc_port: int = field(default=50051, metadata={"help": "gateway gRPC port (0: any free)"})
    http_port: int = field(default=8000, metadata={
        "help": "gateway OpenAI-compatible REST port (0: off)"})
    ready_timeout: float = field(default=300.0, metadata={
        "help": "seconds to wait for every process to be SERVING"})
    api_key: str = field(default="", metadata={
        "help": "an accepted API key (shows in `ps`: prefer --api-key-file or the "
                f"{API_KEY_ENV} environment variable); the gateway gets it by its environment"})
    api_key_file: str = field(default="", metadata={"help": "the gateway's --api-key-file"})
    tls_cert: str = field(default="", metadata={"help": "the gateway's --tls-cert (public ports)"})
    tls_key: str = field(default="", metadata={"help": "the gateway's --tls-key"})
    mtls_ca: str = field(default="", metadata={
        "help": "internal mTLS for every process: the operator's CA (PEM)"})
    mtls_cert: str = field(default="", metadata={
        "help": "the certificate every process presents (signed by --mtls-ca)"})
    mtls_key: str = field(default="", metadata={"help": "PEM private key of --mtls-cert"})
    metrics_prefix: str = field(default="pdserve", metadata={
        "help": "the gateway's --metrics-prefix: pdserve or vllm (vllm:..., vLLM's names)"})
    # issue 31, peer fetch: the gateway's --peer-fetch and --peer-fetch-min-blocks
    peer_fetch: str = field(default="on", metadata={"help": "the gateway's --peer-fetch: on or off"})
    peer_fetch_min_blocks: int = field(default=4, metadata={
        "help": "the gateway's --peer-fetch-min-blocks"})
    restart_backoff: float = field(default=1.0, metadata={
        "help": "seconds before a crashed worker is restarted (doubles per recent crash)"})
    max_restarts: int = field(default=5, metadata={
        "help": "crashes of one worker within a minute before `up` gives up (a crash loop)"})
    prefill_threads: int = field(default=0, metadata={
        "help": "torch threads of each prefill worker (0: its share of this process's cores, "
                "all of them split among the prefill workers: prefill is the compute-bound burst)"})
    decode_threads: int = field(default=0, metadata={
        "help": "torch threads of each decode worker (0: half the cores split among the "
                "decode workers, at least 1)"})
    prefill_num_blocks: int = field(default=0, metadata={
        "help": "KV blocks of each prefill worker (0: --num-blocks, every worker's); e.g. "
                "prefill pools sized to a workload's prefixes, decode pools to its requests"})
    kv_expiry_s: float = field(default=30.0, metadata={
        "help": "the decode workers' --kv-expiry-s: a KV reservation expires this long without "
                "KV arriving"})
    kv_max_reservation_s: float = field(default=600.0, metadata={
        "help": "the decode workers' --kv-max-reservation-s: the hard bound on a reservation "
                "(a prompt that cannot be computed in this long is refused up front)"})
    max_queue_delay_factor: float = field(default=10.0, metadata={
        "help": "the prefill workers' --max-queue-delay-factor: a prompt that would wait in a "
                "prefill queue longer than this many times its own compute is refused up front "
                "(429 with Retry-After; keeps latency under overload; 0: off)"})
    zygote: bool = field(default=False, metadata={
        "help": "fork the workers from one process that imported torch and the engine once "
                "(pdserve/zygote.py): a faster start, but its forked prefill workers ran "
                "prompts 1.5-2.5x slower here (cause not found, bench/RESULTS.md), so off"})
    autoscale: bool = field(default=False, metadata={
        "help": "change the pools live to meet --slo-ttft-ms / --slo-itl-ms within "
                "--max-workers (pdserve/autoscale.py; its plan at the printed /plan URL)"})
    slo_ttft_ms: float = field(default=0.0, metadata={
        "help": "with --autoscale: the time-to-first-token SLO the pools are sized for"})
    slo_itl_ms: float = field(default=0.0, metadata={
        "help": "with --autoscale: the inter-token latency SLO the pools are sized for"})
    max_workers: int = field(default=0, metadata={
        "help": "with --autoscale: the most prefill + decode workers at once"})
    autoscale_interval_s: float = field(default=10.0, metadata={
        "help": "with --autoscale: seconds between its scrapes and decisions"})
    profile: str = field(default="", metadata={
        "help": "with --autoscale: the step costs to plan from (`pdserve profile`; empty: "
                "bench/profiles/smollm2-2core.json, corrected live by the workers' measured "
                "steps)"})
    drain_timeout_s: float = field(default=30.0, metadata={
        "help": "every worker's --drain-timeout-s: a retired (or stopped) worker's time to "
                "finish its streams"})
    disaggregation: str = field(default="auto", metadata={
        "help": "the gateway's --disaggregation: always (every prompt on a prefill worker), "
                "never (on the decode worker that streams it), auto (per request, whichever "
                "pays; gateway/disagg.py)"})
    disagg_max_local_tokens: int = field(default=-1, metadata={
        "help": "the gateway's --disagg-max-local-tokens (auto: a prompt whose uncached part "
                "is at most this is computed by its decode worker; -1: by device, "
                f"{CPU_DISAGG[0]} on cpu, else the gateway's {GATEWAY_DISAGG[0]})"})
    disagg_max_stall_ms: float = field(default=-1.0, metadata={
        "help": "the gateway's --disagg-max-stall-ms (auto: a decode worker with streams "
                "running computes no prompt estimated longer than this; 0: no bound; -1: by "
                f"device, {CPU_DISAGG[1]:g} on cpu, else the gateway's {GATEWAY_DISAGG[1]:g})"})
    # routing on the workers' KV (issue 31): the gateway's flags, passed through
    prefix_routing: str = field(default="events", metadata={"help": "the gateway's --prefix-routing"})
    prefix_weight_host: float = field(default=0.75, metadata={"help": "the gateway's --prefix-weight-host"})
    prefix_weight_disk: float = field(default=0.5, metadata={"help": "the gateway's --prefix-weight-disk"})
    prefix_weight_recompute: float = field(default=1.0, metadata={
        "help": "the gateway's --prefix-weight-recompute"})
    engine: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self):
        if self.prefill < 0 or self.decode < 1:
            raise ValueError("--prefill must be >= 0 and --decode >= 1")
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"--disaggregation must be one of {', '.join(DISAGGREGATION_MODES)}, "
                             f"got {self.disaggregation!r}")
        if self.disagg_max_local_tokens < -1 or self.disagg_max_stall_ms < -1:
            raise ValueError("--disagg-max-local-tokens and --disagg-max-stall-ms must be >= 0 "
                             "(-1: by device)")
        if self.prefix_routing not in ("events", "none"):
            raise ValueError(f"--prefix-routing must be events or none, got {self.prefix_routing!r}")
        if self.prefill == 0 and self.disaggregation == "always" and not self.models_file:
            raise ValueError("--prefill 0 --disaggregation always: no prefill worker would "
                             "compute any prompt (use --disaggregation never or auto)")
        if self.models_file and (self.model or self.served_model_name):
            raise ValueError("--models-file names each model: give no --model or "
                             "--served-model-name with it")
        tls_pair("tls_cert", self.tls_cert, "tls_key", self.tls_key)
        mtls_triple(self.mtls_ca, self.mtls_cert, self.mtls_key)
        check_ports(grpc_port=self.grpc_port, http_port=self.http_port)
        check_metrics_prefix(self.metrics_prefix)
        if self.restart_backoff <= 0 or self.max_restarts < 0:
            raise ValueError("--restart-backoff must be > 0 and --max-restarts >= 0")
        if self.prefill_threads < 0 or self.decode_threads < 0:
            raise ValueError("--prefill-threads and --decode-threads must be >= 0 (0: a share)")
        if self.prefill_num_blocks < 0:
            raise ValueError("--prefill-num-blocks must be >= 0 (0: --num-blocks)")
        if self.max_queue_delay_factor < 0:
            raise ValueError("--max-queue-delay-factor must be >= 0 (0: off)")
        if not 0 < self.kv_expiry_s <= self.kv_max_reservation_s:
            raise ValueError("--kv-expiry-s must be > 0 and at most --kv-max-reservation-s")
        if self.autoscale:
            if self.models_file:
                raise ValueError("--autoscale serves one model: not with --models-file")
            if self.slo_ttft_ms <= 0 or self.slo_itl_ms <= 0 or self.max_workers < 1:
                raise ValueError("--autoscale needs --slo-ttft-ms, --slo-itl-ms (> 0) and "
                                 "--max-workers (>= 1)")
            if self.prefill + self.decode > self.max_workers:
                raise ValueError(f"--prefill {self.prefill} + --decode {self.decode} is over "
                                 f"--max-workers {self.max_workers}")
            if self.autoscale_interval_s <= 0:
                raise ValueError("--autoscale-interval-s must be > 0")

    def threads(self, models: list[ModelPools] = (), cores: int | None = None) -> tuple[int, int]:
        """(prefill, decode) torch threads per worker: as given, else each role's share of
        `cores` (default: the cores this process may run on)."""
        cores = available_cores() if cores is None else cores
        n_prefill = sum(m.num_prefill for m in models) if models else self.prefill
        n_decode = sum(m.num_decode for m in models) or self.decode
        # no prefill worker: the decode workers compute the prompts too, with every core
        return (self.prefill_threads or max(1, cores // max(n_prefill, 1)),
                self.decode_threads or max(1, cores // ((2 if n_prefill else 1) * n_decode)))


def plain_text_ports(cfg: UpConfig, launcher: Launcher) -> list[str]:
    """One warning per port that listens beyond loopback without TLS (none on loopback):
    the gateway's, each worker's gRPC and its /metrics and health ports (HTTP, always plain)."""
    tls, mtls = bool(cfg.tls_cert), bool(cfg.mtls_ca)
    ports = {"gateway gRPC": (int(launcher.grpc_address.rpartition(":")[2]), tls),
             "gateway REST": (launcher.http_port, tls)}
    for c in launcher.children:
        if c.role != "gateway":
            worker = f"{c.role} worker %s ({flag_value(c.argv, '--worker-id')})"
            ports[worker % "gRPC"] = (int(c.address.rpartition(":")[2]), mtls)
            for flag, what in (("--metrics-port", "/metrics"), ("--health-port", "health")):
                ports[worker % what] = (int(flag_value(c.argv, flag) or 0), False)
    lines = [f"{p} listens in plain text beyond loopback" for p in exposed(cfg.host, ports)]
    if lines:    # UCX carries KV without encryption: the KV ports too
        lines.append(f"decode workers' KV (UCX) ports on {cfg.host} are never encrypted: "
                     "keep them on a private network")
    return lines


def worker_args(cfg: UpConfig, models: list[ModelPools] = ()) -> tuple[list[str], list[str]]:
    """The options `up` hands every (prefill, decode) worker of its own: threads, the
    prefill workers' queue-delay bound (and KV pool, when given) and the decode workers'
    reservation deadlines. A role's own options come after the engine's: they win."""
    prefill_threads, decode_threads = cfg.threads(models)
    pool = ["--num-blocks", str(cfg.prefill_num_blocks)] if cfg.prefill_num_blocks else []
    return (["--threads", str(prefill_threads), "--max-queue-delay-factor",
             str(cfg.max_queue_delay_factor), *pool],
            ["--threads", str(decode_threads), "--kv-expiry-s", str(cfg.kv_expiry_s),
             "--kv-max-reservation-s", str(cfg.kv_max_reservation_s)])


def drain_args(cfg: UpConfig) -> list[str]:
    """Every worker's drain, as `up` was told (only when it is not the workers' default)."""
    return [] if cfg.drain_timeout_s == 30.0 else ["--drain-timeout-s", str(cfg.drain_timeout_s)]


def gateway_argv(cfg: UpConfig) -> list[str]:
    """The gateway's own options from `up`'s (its key goes by environment: gateway_env)."""
    values = {"--api-key-file": cfg.api_key_file, "--served-model-name": cfg.served_model_name,
              "--disaggregation": cfg.disaggregation,
              **disagg_args(cfg),
              "--metrics-prefix": "" if cfg.metrics_prefix == "pdserve" else cfg.metrics_prefix,
              "--peer-fetch": "" if cfg.peer_fetch == "on" else cfg.peer_fetch,
              "--peer-fetch-min-blocks": "" if cfg.peer_fetch_min_blocks == 4 else str(cfg.peer_fetch_min_blocks),
              **route_args(cfg)}
    return [x for flag, value in values.items() if value for x in (flag, value)]


def disagg_args(cfg: UpConfig) -> dict[str, str]:
    """The gateway's --disagg-max-local-tokens and --disagg-max-stall-ms, where they are not
    its defaults: as given, else by device (CPU_DISAGG on cpu)."""
    by_device = CPU_DISAGG if cfg.engine.device == "cpu" else GATEWAY_DISAGG
    tokens = cfg.disagg_max_local_tokens if cfg.disagg_max_local_tokens >= 0 else by_device[0]
    stall = cfg.disagg_max_stall_ms if cfg.disagg_max_stall_ms >= 0 else by_device[1]
    return {flag: f"{v:g}" for flag, v, default in (
        ("--disagg-max-local-tokens", tokens, GATEWAY_DISAGG[0]),
        ("--disagg-max-stall-ms", stall, GATEWAY_DISAGG[1])) if v != default}


def route_args(cfg: UpConfig) -> dict[str, str]:
    """The gateway's prefix-routing flags, where they are not its defaults."""
    given = {"--prefix-routing": (cfg.prefix_routing, "events"),
             "--prefix-weight-host": (cfg.prefix_weight_host, 0.75),
             "--prefix-weight-disk": (cfg.prefix_weight_disk, 0.5),
             "--prefix-weight-recompute": (cfg.prefix_weight_recompute, 1.0)}
    return {flag: str(v) for flag, (v, default) in given.items() if v != default}


def main(cfg: UpConfig, autoscaler=None) -> int:
    """`autoscaler`: with --autoscale, its maker (pdserve/autoscale_up.py's UpAutoscaler,
    given by pdserve/cli.py: `up` itself does not import the simulator)."""
    try:
        models = ModelPools.read(cfg.models_file) if cfg.models_file else []
        planner = autoscaler(cfg) if cfg.autoscale and autoscaler is not None else None
        if cfg.disaggregation == "always" and any(m.num_prefill == 0 for m in models):
            raise ValueError("--disaggregation always: every model needs a prefill worker "
                             "(the models file gives one prefill 0)")
    except (OSError, ValueError) as e:
        print(f"pdserve up: {e}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    http_port = cfg.http_port
    prefill_args, decode_args = (a + drain_args(cfg) for a in worker_args(cfg, models))
    launcher = Launcher(cfg.model, cfg.prefill, cfg.decode, cfg.host, cfg.grpc_port, http_port,
                        prefill_args=prefill_args, decode_args=decode_args,
                        gateway_args=gateway_argv(cfg), engine=cfg.engine,   # the key: by env,
                        gateway_env={API_KEY_ENV: cfg.api_key} if cfg.api_key else {},  # not ps
                        mtls=(cfg.mtls_ca, cfg.mtls_cert, cfg.mtls_key) if cfg.mtls_ca else None,
                        tls_cert=cfg.tls_cert, tls_key=cfg.tls_key, internal_token=True,
                        restart_backoff_s=cfg.restart_backoff, max_restarts=cfg.max_restarts,
                        models=models, discovery_files=cfg.autoscale, zygote=cfg.zygote)
    launcher.gateway_args += planner.gateway_args() if planner is not None else []
    try:
        try:
            launcher.start(cfg.ready_timeout, cancel=stop)
        except LaunchError as e:
            print(f"pdserve up: {e}", file=sys.stderr, flush=True)
            return 1
        http = f" http=http://{cfg.host}:{http_port}/v1" if http_port else ""
        for m in models:    # each model's pools on a line of its own, before the ready line
            w = {r: ",".join(c.address for c in launcher.workers(r, m.name))
                 for r in ("prefill", "decode")}
            print(f"pdserve model {m.name}: prefill={w['prefill']} decode={w['decode']} "
                  f"model={m.model_dir}", flush=True)
        w = {r: ",".join(c.address for c in launcher.workers(r)) for r in ("prefill", "decode")}
        model = launcher.model_dir       # the default model's, fetched by start() if not given
        print(f"pdserve ready: grpc={launcher.grpc_address}{http} prefill={w['prefill']} "
              f"decode={w['decode']} model={model or ','.join(m.name for m in models)}"
              + ("" if models else f" id={cfg.served_model_name or default_model_id(model)}"),
              flush=True)
        for line in plain_text_ports(cfg, launcher):
            print(f"pdserve up: WARNING: {line}", file=sys.stderr, flush=True)
        if planner is not None:
            planner.start(launcher, stop)
        return launcher.supervise(stop)
    finally:
        if planner is not None:
            planner.stop()
        began, alive = time.monotonic(), sum(c.popen.poll() is None for c in launcher.children)
        if alive:
            _say(f"pdserve up: stopping {alive} process(es) (requests in flight may finish) ...")
        launcher.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        if alive:
            _say(f"pdserve up: stopped in {time.monotonic() - began:.1f} s")
