"""The worker server skeleton: what both workers share. A worker supplies a `WorkerRole`
(its gRPC servicer and its KV endpoint); `serve` does the rest, in this order:

    KV transport (default UCX, imported lazily; tests pass a LoopbackTransport)
    telemetry (tracing, metrics, the energy meter)
    role.kv_connector()            the engine's KV seam, made before the engine (prefill)
    build the engine               (off the loop, on one torch thread: build_on_one_thread)
                                   with the connector and the step observers
    gRPC server bound              (worker id: "<role>-<host>:<port>" unless configured)
    role.open_kv()                 its KV endpoint (prefill: the connector; decode: a receiver)
    AsyncEngine thread started; role.servicer_class(parts) added to the server (its
                                   KvEvents RPC streams the engine's KV event log:
                                   kv_events_rpc.py, ended on drain)
    WorkerServer.run:
      start  -> health NOT_SERVING -> warm-up (role.warm_up: one tiny request through the
             engine, then a long and a short one, timed: the worker's prompt cost, for a
             prefill worker's admission and both workers' Stats, or those timings from the
             build cache: services/prefill_cost.py)
             -> health SERVING, `ready` set; NOT_SERVING while the engine is unhealthy
             (consecutive failed steps, see AsyncEngine.healthy)
      SIGTERM (or `stop` set) -> draining: health NOT_SERVING, new work refused with
             UNAVAILABLE, each `on_drain` hook called with the drain's deadline (the role
             hands work back: a prefill worker its queued prompts at once, a decode worker
             its streams still running near the deadline, which the gateway migrates),
             in-flight calls get up to drain_timeout_s -> server stopped
    shutdown: engine thread, KV endpoint (and its transport), telemetry
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from engine.async_engine import AsyncEngine, EngineError
from engine.kv_connector import KVConnector
from engine.sampling_params import SamplingParams
from kvtransfer.transport import Transport
from kvtransfer.wire import CompatKey

from . import protoconv, telemetry
from .cli_args import config_from_argv
from .energy import EnergyMeter
from .kv_events_rpc import KvEventStreams
from .grpc_options import SERVER_OPTIONS
from .metrics import Metrics
from .security import MTLS, RequestGuard, add_port, read_token
from .startup_log import StartupClock
from .worker_config import available_cores

log = logging.getLogger(__name__)


def limit_threads(num_threads: int) -> int:
    """torch's intra-op threads: `num_threads`, or (0) OMP_NUM_THREADS when the environment
    sets it, else every core this process may run on. Returns the count."""
    import torch
    if num_threads <= 0:
        num_threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or available_cores()
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    torch.set_num_threads(num_threads)
    return num_threads


def build_on_one_thread(build, *args):
    """`build(*args)` with one torch intra-op thread, then the worker's own count again. A
    model loads in small per-layer conversions, where more threads mostly add OpenMP
    barriers, which busy-wait: the default model took 1.2 s to build on one thread and
    2.2-9.8 s on two on a shared 2-core machine (and both workers load at once)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build(*args)
    finally:
        torch.set_num_threads(threads)


class Draining(Exception):
    """New work is refused: the worker is shutting down."""


class RpcStatus(Exception):
    """Ends an RPC with this gRPC status code and message (the servicer aborts the call)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class WorkerServer:
    """grpc.aio server + health + reflection + in-flight counting + drain."""

    def __init__(self, service_names: list[str], host: str, port: int, drain_timeout_s: float,
                 mtls: MTLS | None = None, health_port: int = 0, callers: frozenset[str] = frozenset(),
                 token: str = ""):
        """`callers`: certificate common names allowed to call more than Stats (mTLS);
        `token`: the internal credential every call must carry (services/security.py)."""
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[
            RequestGuard(tuple(service_names), callers, token=token)])
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.server)
        # with mTLS, a peer without a certificate of the operator's CA fails the handshake
        self.port = add_port(self.server, f"{host}:{port}",
                             None if mtls is None else mtls.server_credentials())
        # The same health statuses, alone and in plain text, for probes without a certificate.
        self.health_server = None
        if health_port:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            add_port(self.health_server, f"{host}:{health_port}", None)
        self.drain_timeout_s = drain_timeout_s
        self.draining = False
        self.ready = False                   # warmed up (SERVING unless draining or unhealthy)
        self.engine_healthy = True
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop = asyncio.Event()
        self._drain_hooks: list[Callable[[float], None]] = []

    def on_drain(self, hook: Callable[[float], None]) -> None:
        """`hook(deadline)` when draining starts (deadline: the loop time the drain ends at);
        it runs on the loop and must not block (it may start tasks)."""
        self._drain_hooks.append(hook)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in [""] + self.service_names:
            await self.health.set(name, status)

    def engine_health(self, healthy: bool) -> None:
        """The engine's health changed (consecutive step failures): health follows it."""
        log.warning("engine %s: health %s", "recovered" if healthy else "failing",
                    "SERVING" if healthy else "NOT_SERVING")
        self.engine_healthy = healthy
        if self.ready and not self.draining:
            asyncio.ensure_future(self.set_serving(healthy))

    @contextlib.contextmanager
    def track(self):
        """Count one in-flight call; raises Draining when the worker is draining."""
        if self.draining:
            raise Draining("worker is draining (shutting down): retry on another worker")
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self, warm_up, ready: asyncio.Event | None, stop: asyncio.Event | None) -> None:
        """Start, warm up, serve until SIGTERM/SIGINT or `stop`, then drain and stop."""
        await self.set_serving(False)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
        try:
            await warm_up()
            self.ready = True
            await self.set_serving(self.engine_healthy)
            log.info("serving %s on port %d", ", ".join(self.service_names), self.port)
            if ready is not None:
                ready.set()
            waits = [asyncio.ensure_future(self._stop.wait())]
            if stop is not None:
                waits.append(asyncio.ensure_future(stop.wait()))
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
            await self.drain()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            await self.server.stop(grace=1.0)
            if self.health_server is not None:
                await self.health_server.stop(grace=None)

    async def drain(self) -> None:
        self.draining = True
        await self.set_serving(False)
        log.info("draining: %d call(s) in flight, up to %.1fs", self.in_flight, self.drain_timeout_s)
        deadline = asyncio.get_running_loop().time() + self.drain_timeout_s
        for hook in self._drain_hooks:
            hook(deadline)
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain timeout: %d call(s) still in flight are cancelled", self.in_flight)


def new_request_params(request, in_flight) -> SamplingParams:
    """What both workers check first of a request they are handed (INVALID_ARGUMENT): it has
    an id, not one of `in_flight`'s, and sampling params the engine takes; returns those."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if not request.request_id:
        raise RpcStatus(bad, "request_id is required")
    if request.request_id in in_flight:
        raise RpcStatus(bad, f"request id {request.request_id!r} is already in flight")
    try:
        return protoconv.worker_sampling_from_proto(request.sampling)
    except (ValueError, TypeError) as e:
        raise RpcStatus(bad, str(e)) from None


def model_compat(engine) -> CompatKey:
    """This engine's compatibility key: the model is named by its directory's name."""
    return CompatKey.from_cache(engine.kv_cache, engine.config.model.name, engine.kv_scales,
                                engine.config.model.kv_layout())


# ----------------------------------------------------------------------------- skeleton
class KVEndpoint(Protocol):
    """A worker's end of the KV transfer (prefill: its KVPush; decode: a KVReceiver)."""
    compat: CompatKey

    async def close(self) -> None:
        """Stop it and close its transport."""


@dataclass
class WorkerParts:
    """What `serve` built, handed to the role's servicer."""
    cfg: Any                     # the role's config (a services.worker_config.WorkerConfig)
    engine: AsyncEngine
    kv: Any                      # the role's KVEndpoint, as role.open_kv returned it
    srv: WorkerServer
    worker_id: str
    metrics: Metrics
    meter: EnergyMeter
    token: str = ""              # the internal credential ("": none; services/security.py)
    kv_events: Any = None        # KvEventStreams of the engine's KV event log (kv_events_rpc.py)


class WorkerRole(abc.ABC):
    """What one kind of worker supplies to `serve`; everything else is shared."""
    name: str = ""               # "prefill" | "decode": worker ids, telemetry, thread names
    service_name: str = ""       # the gRPC service it serves (full name)
    prefill_only: bool = False   # its requests stop after the first token (see warm_up)

    @abc.abstractmethod
    def kv_address(self, cfg) -> tuple[str, int]:
        """(host, port) the default UCX transport binds."""

    def kv_connector(self, cfg, transport: Transport) -> KVConnector | None:
        """The engine's KV seam, made before the engine (engine/kv_connector.py); none by
        default."""
        return None

    @abc.abstractmethod
    async def open_kv(self, cfg, engine, transport: Transport,
                      connector: KVConnector | None) -> KVEndpoint:
        """This worker's KV endpoint, once the engine (an engine.llm_engine.LLMEngine, not
        stepping yet) and its cache exist."""

    async def warm_up(self, servicer, engine: AsyncEngine) -> None:
        """Before SERVING: one tiny request through the engine (warm_up below)."""
        await warm_up(engine, self.prefill_only)

    config_class: type           # its config (a services.worker_config.WorkerConfig)
    servicer_class: type         # the gRPC servicer, built from the WorkerParts
    add_to_server: Callable      # the generated add_<Service>Servicer_to_server (a staticmethod)


async def serve(cfg, role: WorkerRole, *, transport: Transport | None = None,
                ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve `role` until SIGTERM/SIGINT (or `stop` is set), then drain and return."""
    clock = StartupClock()          # its phases, logged once warm (services/startup_log.py)
    token = read_token(cfg.internal_token_file)     # a bad file fails before the model loads
    if transport is None:
        from kvtransfer.ucx import UcxTransport   # imports ucxx; only a serving process needs it
        transport = UcxTransport(*role.kv_address(cfg), device_memory=cfg.kv_staging == "device")
    tel = telemetry.start_role_telemetry(role.name, host=cfg.host, metrics_port=cfg.metrics_port or None,
                                         trace_file=cfg.trace_file, device=cfg.engine.device,
                                         restarts=cfg.restarts)
    if role.prefill_only and cfg.engine.speculative:   # it samples one token per request
        log.info("--speculative is a decode worker's option: this prefill worker ignores it")
        cfg = replace(cfg, engine=replace(cfg.engine, speculative=""))
    ae = kv = None
    worker_id = cfg.worker_id or role.name
    clock.mark("telemetry + transport")
    try:
        connector = role.kv_connector(cfg, transport)
        engine = await asyncio.to_thread(build_on_one_thread, cfg.build_engine, connector,
                                         tel.step_observers(), False if role.prefill_only else None)
        clock.add(getattr(engine, "startup_s", {}))
        tel.watch_steps(engine)
        # what exists now (torch, the model, imports: hundreds of thousands of objects) lives
        # as long as the process: keep it out of every later full GC pass, which would
        # otherwise stall an engine step for tens of milliseconds now and then
        gc.collect()
        gc.freeze()
        srv = WorkerServer([role.service_name], cfg.host, cfg.port, cfg.drain_timeout_s,
                           MTLS.from_config(cfg), cfg.health_port,
                           frozenset(n.strip() for n in cfg.mtls_callers.split(",") if n.strip()),
                           token)
        worker_id = cfg.worker_id or f"{role.name}-{cfg.host}:{srv.port}"
        kv = await role.open_kv(cfg, engine, transport, connector)
        ae = AsyncEngine(engine, name=f"{role.name}-engine", on_health=srv.engine_health)
        ae.start()
        tel.metrics.watch_engine(ae.stats)
        streams = KvEventStreams(ae.kv_events)       # the KvEvents RPC; ends on drain
        srv.on_drain(streams.close)
        parts = WorkerParts(cfg, ae, kv, srv, worker_id, tel.metrics, tel.meter, token, streams)
        servicer = role.servicer_class(parts)
        role.add_to_server(servicer, srv.server)
        clock.mark("engine other + server")

        async def warm_up():
            await role.warm_up(servicer, ae)
            clock.mark("warm-up")
            log.info("%s", clock.line(worker_id))
        await srv.run(warm_up, ready, stop)
    finally:
        if ae is not None:
            await ae.shutdown()
        await (kv.close() if kv is not None else transport.close())
        tel.close()
        gc.unfreeze()          # collectable again at exit (bindings report frozen ones as leaks)
        log.info("%s worker %s stopped", role.name, worker_id)


async def warm_up(ae: AsyncEngine, prefill_only: bool, tokens: int = 0) -> float:
    """One request of `tokens` prompt tokens (0: a tiny one, under a block) through the
    engine, so the first real one has no cold start (a prefill worker's is prefill-only, then
    released, as its real ones are); returns the seconds to its first token (the prompt's
    cost: services/prefill_cost.py)."""
    rid = f"warmup-{uuid.uuid4().hex[:8]}"
    n = tokens or max(1, min(ae.block_size - 3, 8))
    prompt = [1 + i % (ae.vocab_size - 1) for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=1 if prefill_only else 2, ignore_eos=True)
    t0 = time.perf_counter()
    seconds = 0.0
    await ae.add_request(rid, prompt, params, prefill_only)
    async for _ in ae.stream(rid):
        seconds = seconds or time.perf_counter() - t0
    if prefill_only:
        await ae.release(rid)
    return seconds


async def abort_quietly(ae: AsyncEngine, rid: str) -> None:
    """Abort `rid` in the engine (its blocks are freed), whatever its state: an engine that
    failed (EngineError) holds nothing more to free, so that is not the caller's error."""
    try:
        await ae.abort(rid)
    except EngineError:
        pass


def run(cfg, role: WorkerRole) -> None:
    import uvloop
    log.info("%s worker: %d torch thread(s)", role.name, limit_threads(cfg.num_threads))
    uvloop.run(serve(cfg, role))


def main(role: WorkerRole, argv: list[str] | None = None) -> int:
    """`python -m <role>_worker.server`: the role's config from the command line, then `run`."""
    run(config_from_argv(role.config_class, argv, f"pdserve {role.name} worker"), role)
    return 0
