"""`Launcher`: N prefill + M decode workers and a gateway, as separate local processes (what
`pdserve up`, pdserve/up.py, runs; also the e2e fixtures).

    the gateway's fixed ports free? (else one line, nothing started) -> pick free ports ->
    start workers and, beside them, the gateway told their addresses -> every worker SERVING
    (gRPC health; workers report it only after loading and warm-up) and the gateway SERVING
    (it reports it only once it has probed every worker healthy: `--wait-for-workers-s`, so
    a request sent at the ready line finds them) -> print one line
    "pdserve ready: grpc=HOST:PORT ... id=MODEL-ID" -> supervise

With `zygote=True` (`pdserve up --zygote`; off by default) the workers are forked by a zygote
(pdserve/zygote.py) that the launcher starts first of all: it imports torch and the engine
once while the launcher fetches the model and picks ports, so the workers begin at their
model's load, not at torch's import (the gateway, which never imports torch, is a process of
its own). `pdserve up: zygote: ready in X s` tells its import time. Off by default: its
forked prefill workers ran a 450-token prompt in 3-4 s against 1.6-2 s for plain processes
on the same machine (a third busy thread in the forked worker; cause not found). Each worker's model comes from the build cache when it was built here before
(engine/build_cache.py), and each worker's warm-up timings likewise
(services/prefill_cost.py).

The start-up probes reconnect every 100-250 ms (PROBE_OPTIONS) and poll every 0.1 s: a
process is seen SERVING within a fraction of a second, not after gRPC's exponential
reconnect backoff (which had added seconds, tens of them on a loaded machine).

Start-up is told a line per process on stderr (`say`): "prefill 0: loading M on ADDR ...",
"loaded in 3.1 s, warming up ..." (its health answers NOT_SERVING), "ready in 4.1 s"; and
shutdown by "stopping N process(es) ..." and "stopped in 0.8 s". The API key reaches the
gateway in its environment (PDSERVE_API_KEY), never on a command line (`ps`), and no worker
gets it. Each worker serves /metrics on a port of its own, which the gateway's /metrics
merges (`--worker-metrics`, labelled worker=ID).

Several models (`--models-file`, `ModelPools`): each model gets its own prefill and decode
workers (a model's prefill workers send KV only to its own decode workers), and the one
gateway gets a models file naming each model's pools (gateway/models.py).

`pdserve up`'s options are generated from `UpConfig`: its own fields plus every engine option
(`--device`, `--block-size`, ... from engine.config.EngineOptions), which the launcher hands
to every worker as options (only those that differ from the defaults the workers share).

Supervision (`Launcher.supervise`): SIGINT/SIGTERM stops every child (SIGTERM, then SIGKILL
after a grace period) and exits 0. A worker that dies on its own is restarted on the same
ports and arguments after an exponential backoff (restart_backoff_s, doubling per crash up
to max_backoff_s; a worker that then ran for restart_window_s starts over), logged with its
restart count, which the worker gets as `--restarts N` and exports as the
`pdserve:process_restarts` gauge; the gateway probes it back in while the others keep
serving. The gateway is restarted the same way (on the same ports; the workers abort what
its dead streams held). Only a process crashing more than max_restarts times within
restart_window_s (a crash loop) stops everything and exits non-zero. Children also get
SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG, set by each child
at its start from `--parent-pid`: `processes.die_with_parent`), so none is ever orphaned.
Every wait has a deadline. Each child's spec and command line: processes.py.

Scale-down (`Launcher.retire(child)`, what the autoscaler calls): the child is marked
retired (supervision never restarts it), leaves the discovery files first when the pools
are live (below) and is given two discovery intervals to leave the gateway's routing, gets
SIGTERM and drains (a worker: NOT_SERVING, new work refused; a prefill worker hands its
queued prompts back, a decode worker its streams still running near the end, which the
gateway migrates: services/worker_server.py), and is waited for its --drain-timeout-s +
RETIRE_GRACE_S; SIGKILL only after that. It then leaves `children`.

Live pools (`pdserve up --autoscale`, pdserve/autoscale_local.py): with `discovery_files`
the gateway learns its workers from files (`--prefill-file`, `--decode-file`, re-read every
--discovery-interval-s; `--worker-metrics-file` for their /metrics) and the prefill workers
their decode workers (`--decode-file`), each rewritten atomically (services/address_file.py).
`add_worker(role)` starts one more worker, waits until it is SERVING, and only then writes
it into the files (ready before routed to); `retire` takes it out of them before its drain.

`pdserve up` closes the workers' RPCs (`internal_token`): a fresh random token in a 0600 file,
whose path every child gets as `--internal-token-file` (so `ps` never shows the token); the
file is removed at stop.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from engine.config import EngineOptions
from engine.gguf import model_name
from gateway.auth import API_KEY_ENV
from services.cli_args import config_argv
from services.security import write_token

from .live_pools import LivePools
from .zygote import Zygote
from .processes import (Child, LaunchError, ModelPools, free_port, ports_in_use,  # noqa: F401
                        wait_serving)


DEFAULT_DRAIN_TIMEOUT_S = 30.0          # a worker's --drain-timeout-s when its argv has none
RETIRE_GRACE_S = 10.0                   # past the drain: the server's stop, engine shutdown
# The start-up probes' channels reconnect every 100-250 ms: a channel opened before its
# process binds its port (all of them are: a worker binds after loading) would otherwise back
# off exponentially (gRPC's default: 1 s growing 1.6x to 120 s), and see a process that has
# been SERVING for seconds only at its next attempt.
PROBE_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                 ("grpc.max_reconnect_backoff_ms", 250), ("grpc.enable_retries", 0)]


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in `argv` (the last one wins, as for argparse; None: absent)."""
    return argv[len(argv) - argv[::-1].index(flag)] if flag in argv else None


@dataclass
class Launcher(LivePools):
    """Start/stop a whole local system. Also used by the e2e fixtures."""
    model_dir: str = ""                     # "": the default model (start() fetches it)
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    grpc_port: int = 0                      # 0: a free port
    http_port: int = 0
    log_dir: Path | None = None             # None: children inherit stdout/stderr
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    engine: EngineOptions = field(default_factory=EngineOptions)   # every worker's engine
    mtls: tuple[str, str, str] | None = None  # (CA, cert, key) PEM paths every process uses
    internal_token: bool = False            # a per-deployment credential every worker RPC
                                            # requires (`pdserve up` always makes one)
    tls_cert: str = ""                      # the gateway's public TLS (cert, key) PEM paths;
    tls_key: str = ""                       # the launcher's probe trusts the cert file
    restart_backoff_s: float = 1.0          # first restart delay; doubles per recent crash
    max_backoff_s: float = 30.0
    restart_window_s: float = 60.0          # crashes older than this are forgotten
    max_restarts: int = 5                   # crashes within the window before giving up
    # several models, each with its own pools (replaces model_dir and the two counts)
    models: list[ModelPools] = field(default_factory=list)
    gateway_env: dict[str, str] = field(default_factory=dict)   # the gateway's alone (a key)
    say: Callable[[str], None] = field(default=lambda line: _say(f"pdserve up: {line}"),
                                       repr=False)   # a line a person follows start-up by
    discovery_files: bool = False           # live pools: workers named in files (see above)
    discovery_interval_s: float = 1.0       # the gateway's re-read of them (with the files)
    zygote: bool = False                    # fork the workers from one process that has
    #                                          imported torch and the engine (pdserve/zygote.py)
    children: list[Child] = field(default_factory=list)
    _models_file: str = field(default="", init=False, repr=False)   # the gateway's, if several
    token_file: str = field(default="", init=False, repr=False)     # with internal_token
    _worker_metrics: list[str] = field(default_factory=list, init=False, repr=False)  # ID=URL
    _files: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # kind -> path
    _spawned: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # role -> n
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _zygote: Zygote | None = field(default=None, init=False, repr=False)

    @property
    def grpc_address(self) -> str:
        return next(c.address for c in self.children if c.role == "gateway")

    def workers(self, role: str, model: str | None = None) -> list[Child]:
        return [c for c in self.children if c.role == role and model in (None, c.model)]

    def start(self, timeout_s: float = 300.0, cancel: threading.Event | None = None) -> None:
        """Check the fixed ports are free (the one check: before anything is fetched or
        started, so a busy port is one line, not a probe answered by whoever holds it), fetch
        the default model if model_dir is "" (and no models), start everything and wait
        until it is all SERVING within timeout_s, a line per process as it loads, warms up
        and is ready (`say`); stops all on any failure (or when `cancel` is set)."""
        self._cancel = cancel or threading.Event()
        busy = ports_in_use(self.host, {"the gateway's gRPC (--grpc-port)": self.grpc_port,
                                        "the gateway's REST (--http-port)": self.http_port})
        if busy:
            raise LaunchError(f"{' and '.join(busy)} on {self.host} already in use (another "
                              f"pdserve?); nothing was started")
        if self.zygote and self._zygote is None:   # first: its imports overlap all that follows
            self._zygote = Zygote(drop=(API_KEY_ENV, *self.gateway_env))
        if not self.model_dir and not self.models:
            from .default_model import resolve_default_model
            self.model_dir = str(resolve_default_model())
            if self._cancel.is_set():
                raise LaunchError("interrupted while fetching the default model; nothing was started")
        deadline = time.monotonic() + timeout_s
        engine_args = config_argv(self.engine)   # before extra: a role's own args win
        try:
            if self.internal_token:      # a file: the token itself never shows in `ps`
                fd, self.token_file = tempfile.mkstemp(prefix="pdserve-internal-")
                os.close(fd)
                write_token(self.token_file)
            if self.discovery_files:
                self._make_files()
            for m in self.models or [ModelPools("", self.model_dir, self.num_prefill,
                                                self.num_decode)]:
                self._spawn_workers(m, engine_args)
            self.write_discovery()             # --autoscale: the gateway reads the files
            self._spawn_gateway(timeout_s)     # beside the workers: SERVING once they all are
            self._wait_serving(list(self.children), deadline)
        except BaseException:
            self.stop()
            raise

    def _spawn_gateway(self, timeout_s: float) -> None:
        """The gateway, told every worker's address up front; it reports SERVING only once
        they are all healthy (`--wait-for-workers-s`), so its SERVING is the system's."""
        port = self.grpc_port or free_port(self.host)
        gw = [
            "gateway", *self._gateway_models(), "--host", self.host,
            "--grpc-port", str(port), "--http-port", str(self.http_port),
            *self._metrics_args(),
            "--wait-for-workers-s", f"{timeout_s:g}", *self._mtls_args(), *self._token_args(),
            *(["--tls-cert", self.tls_cert, "--tls-key", self.tls_key] if self.tls_cert else []),
            *self.gateway_args]
        self._spawn(Child("gateway", f"{self.host}:{port}", gw, env=self.gateway_env))

    def _spawn_workers(self, m: ModelPools, engine_args: list[str]) -> None:
        ports = {r: [free_port(self.host) for _ in range(n)]
                 for r, n in (("prefill", m.num_prefill), ("decode", m.num_decode))}
        decoders = ",".join(f"{self.host}:{p}" for p in ports["decode"])
        for role in ("prefill", "decode"):
            for port in ports[role]:
                self._spawn_worker(m, role, port, engine_args, decoders)

    def _spawn_worker(self, m: ModelPools, role: str, port: int, engine_args: list[str],
                      decoders: str = "") -> Child:
        i = self._spawned.get(m.name + role, 0)       # ids never reused: metrics stay apart
        self._spawned[m.name + role] = i + 1
        worker_id = f"{m.name}-{role}-{i}" if m.name else f"{role}-{i}"
        where = ["--decode-file", self._files["decode"]] if self._files else ["--decode", decoders]
        extra = [*where, *self.prefill_args] if role == "prefill" else self.decode_args
        argv = [role, "--model-dir", str(m.model_dir), "--host", self.host,
                "--port", str(port), "--worker-id", worker_id,
                "--metrics-port", str(free_port(self.host)), *engine_args,
                *self._mtls_args(), *self._token_args(), *extra]
        metrics = flag_value(argv, "--metrics-port")
        c = Child(role, f"{self.host}:{port}", argv, model=m.name, zygote=self._zygote,
                  env={k: None for k in {API_KEY_ENV, *self.gateway_env}})   # no key
        c.metrics = f"{worker_id}=http://{self.host}:{metrics}/metrics"
        if not self._files:
            self._worker_metrics.append(c.metrics)
        self._spawn(c)
        return c

    def _gateway_models(self) -> list[str]:
        """The gateway's model and pool options: one model's, or a models file of several."""
        def pool(role, model=None):
            return ",".join(c.address for c in self.workers(role, model))
        if self._files:
            return ["--model", str(self.model_dir), "--prefill-file", self._files["prefill"],
                    "--decode-file", self._files["decode"],
                    "--discovery-interval-s", str(self.discovery_interval_s)]
        if not self.models:
            return ["--model", str(self.model_dir), "--prefill", pool("prefill"),
                    "--decode", pool("decode")]
        fd, self._models_file = tempfile.mkstemp(prefix="pdserve-models-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([{"name": m.name, "model": str(m.model_dir),
                        "prefill": pool("prefill", m.name), "decode": pool("decode", m.name)}
                       for m in self.models], f)
        return ["--models-file", self._models_file]

    def _spawn(self, c: Child) -> None:
        if self.log_dir is not None:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            n = self._spawned.get("log " + c.role, 0)
            self._spawned["log " + c.role] = n + 1
            c.log = open(Path(self.log_dir) / f"{c.role}-{n}.log", "ab")
        c.start()
        self.children.append(c)
        self.say(f"{c.label}: loading {model_name(c.argv[c.argv.index('--model-dir') + 1])} "
                 f"on {c.address} ..." if c.role != "gateway" else
                 f"gateway: starting on {c.address} ...")

    def _mtls_args(self) -> list[str]:
        if self.mtls is None:
            return []
        ca, cert, key = self.mtls
        return ["--mtls-ca", ca, "--mtls-cert", cert, "--mtls-key", key]

    def _token_args(self) -> list[str]:
        return ["--internal-token-file", self.token_file] if self.token_file else []

    def probe_channel(self, c: Child) -> grpc.Channel:
        """A channel the launcher's health probe of `c` can use (mTLS/TLS as configured)."""
        read = lambda p: Path(p).read_bytes()  # noqa: E731
        if c.role == "gateway" and self.tls_cert:
            return grpc.secure_channel(c.address, grpc.ssl_channel_credentials(read(self.tls_cert)),
                                       PROBE_OPTIONS)
        if c.role != "gateway" and self.mtls is not None:
            ca, cert, key = self.mtls
            return grpc.secure_channel(c.address, grpc.ssl_channel_credentials(
                read(ca), private_key=read(key), certificate_chain=read(cert)), PROBE_OPTIONS)
        return grpc.insecure_channel(c.address, PROBE_OPTIONS)

    def _wait_serving(self, children: list[Child], deadline: float) -> None:
        wait_serving(children, deadline, self.probe_channel, self._cancel, self.say)
        if self._zygote is not None and self._zygote.preload_s is not None:
            self.say(f"zygote: ready in {self._zygote.preload_s:.1f} s (torch and the engine "
                     "imported once, every worker forked from it)")

    def supervise(self, stop: threading.Event, interval_s: float = 0.2) -> int:
        """Restart crashed processes (the gateway too) until `stop` is set (returns 0) or
        one crash-loops (returns 1; the caller stops everything)."""
        while not stop.wait(interval_s):
            problem = self.check_children(time.monotonic())
            if problem is not None:
                _say(f"pdserve up: {problem}; stopping everything")
                return 1
        return 0

    def check_children(self, now: float) -> str | None:
        """One supervision pass: note new crashes, restart processes whose backoff is over.
        Returns why everything must stop, or None."""
        for c in list(self.children):        # retire() may remove one meanwhile
            if c.retired:
                continue
            if c.restart_at is not None:
                if now >= c.restart_at:
                    c.restart_at = None
                    c.restarts += 1
                    self.say(f"restarting {c.label} on {c.address} (restart #{c.restarts})")
                    if "--wait-for-workers-s" in c.argv:   # again: it serves with the workers up now
                        i = c.argv.index("--wait-for-workers-s")
                        c.argv = c.argv[:i] + c.argv[i + 2:]
                    c.start()
                continue
            code = c.popen.poll()
            if code is None:
                continue
            c.crashes = [t for t in c.crashes if now - t < self.restart_window_s] + [now]
            if len(c.crashes) > self.max_restarts:
                return (f"{c.label} on {c.address} crashed {len(c.crashes)} times within "
                        f"{self.restart_window_s:g}s (last exit code {code})")
            delay = min(self.restart_backoff_s * 2 ** (len(c.crashes) - 1), self.max_backoff_s)
            c.restart_at = now + delay
            self.say(f"{c.label} on {c.address} exited with code {code}; restart "
                     f"#{c.restarts + 1} in {delay:g}s")
        return None

    def retire(self, child: Child, timeout_s: float | None = None) -> None:
        """Stop `child` for good (scale-down): never restarted, SIGTERM (it drains), waited
        for up to `timeout_s` (None: its --drain-timeout-s + RETIRE_GRACE_S), SIGKILL only
        after; then out of `children`. Blocks, bounded."""
        if timeout_s is None:
            drain = flag_value(child.argv, "--drain-timeout-s")
            timeout_s = (float(drain) if drain else DEFAULT_DRAIN_TIMEOUT_S) + RETIRE_GRACE_S
        child.retired, child.restart_at = True, None
        t0 = time.monotonic()
        if self._files:                      # out of routing before its drain begins
            self.write_discovery()
            time.sleep(2 * self.discovery_interval_s)
        how = "drained"
        if child.popen is not None and child.popen.poll() is None:
            self.say(f"retiring {child.label} on {child.address} (drain, up to {timeout_s:g} s) ...")
            child.popen.send_signal(signal.SIGTERM)
            try:
                child.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                how = "killed (SIGKILL) after its drain"
                child.popen.kill()
                child.popen.wait(5)
        if child.log is not None:
            child.log.close()
        with self._lock:
            self.children = [c for c in self.children if c is not child]
        self.say(f"{child.label} on {child.address} retired: {how} in "
                 f"{time.monotonic() - t0:.1f} s")

    def stop(self, grace_s: float = 35.0) -> None:
        """SIGTERM every child (gateway first), SIGKILL what is left after grace_s: longer
        than the gateway's and workers' default drain (--drain-timeout-s 30), so streams in
        flight finish; an idle system exits at once."""
        for c in reversed(self.children):
            if c.popen is not None and c.popen.poll() is None:
                c.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            if c.popen is None:
                continue
            try:
                c.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.popen.kill()
                c.popen.wait(5)
            if c.log is not None:
                c.log.close()
        for f in (self._models_file, self.token_file, *self._files.values()):
            if f:
                Path(f).unlink(missing_ok=True)
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
