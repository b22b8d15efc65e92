"""What both workers' servers share: a gRPC server with health + reflection, in-flight
tracking, a SIGTERM drain, and the KV compatibility key as a proto.

Serving lifecycle:

    start  -> health NOT_SERVING -> warm-up (one tiny request through the engine)
           -> health SERVING, `ready` set
    SIGTERM (or `stop` set) -> draining: health NOT_SERVING, new work refused with
           UNAVAILABLE, in-flight calls get up to drain_timeout_s -> server stopped -> exit
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvtransfer.wire import CompatKey

log = logging.getLogger(__name__)


def limit_threads(num_threads: int) -> None:
    """Workers share small hosts: one intra-op thread unless configured."""
    import torch
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    torch.set_num_threads(num_threads)


class Draining(Exception):
    """New work is refused: the worker is shutting down."""


class WorkerServer:
    """grpc.aio server + health + reflection + in-flight counting + drain."""

    def __init__(self, service_names: list[str], host: str, port: int, drain_timeout_s: float):
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.drain_timeout_s = drain_timeout_s
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in [""] + self.service_names:
            await self.health.set(name, status)

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
            await self.set_serving(True)
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

    async def drain(self) -> None:
        self.draining = True
        await self.set_serving(False)
        log.info("draining: %d call(s) in flight, up to %.1fs", self.in_flight, self.drain_timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain timeout: %d call(s) still in flight are cancelled", self.in_flight)


def model_compat(engine) -> CompatKey:
    """This engine's compatibility key: the model is named by its directory's name."""
    return CompatKey.from_cache(engine.kv_cache, engine.config.model.name)
