"""OpenAI-compatible REST shim served by the gateway process (see app.py for its layout).

`start_http(models, host, port, keys, ssl)` runs uvicorn inside the gateway's own event loop
(uvloop), beside the gRPC server; `await server.stop()` shuts it down. Its h11 protocol puts a
deadline on every request head (HEADER_TIMEOUT_S): half-sent headers (slowloris) do not hold
a connection open.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from .app import create_app
from .errors import OpenAIError

__all__ = ["HttpServer", "OpenAIError", "create_app", "start_http"]

log = logging.getLogger(__name__)

# Seconds a connection has to send a whole request line and headers, from its opening or
# from its previous response (uvicorn's timeout_keep_alive, 5 s, closes idle ones sooner).
HEADER_TIMEOUT_S = 10.0


class HttpServer:
    def __init__(self, server, task: asyncio.Task):
        self._server, self._task = server, task

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def start_http(models, host: str, port: int, keys=None, tls: tuple[str, str] | None = None,
                     timeout: float = 30.0, header_timeout: float = HEADER_TIMEOUT_S,
                     drain_timeout_s: float = 5.0, planner_url: str = "") -> HttpServer:
    """Serve the REST app over `models` (gateway.models.Models) on host:port (0: any free
    port) in the running loop, with API keys
    (a gateway.auth.KeyStore), TLS (cert, key PEM paths) and the /status page's planner
    URL (`planner_url`, the autoscaler's /plan) when given; returns once it is
    listening. Raises RuntimeError if it could not bind."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):        # the gateway owns SIGINT/SIGTERM
            yield

    ssl = dict(ssl_certfile=tls[0], ssl_keyfile=tls[1]) if tls else {}
    config = uvicorn.Config(create_app(models, keys, planner_url), host=host, port=port, log_level="warning",
                            lifespan="off", access_log=False,
                            timeout_graceful_shutdown=drain_timeout_s,
                            http=_head_deadline_protocol(header_timeout), **ssl)
    server = _Server(config)
    task = asyncio.create_task(server.serve(), name="openai-http")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not server.started:
        if task.done():
            raise RuntimeError(f"REST server on {host}:{port} did not start: "
                               f"{task.exception() if not task.cancelled() else 'cancelled'}")
        if loop.time() > deadline:
            await HttpServer(server, task).stop()
            raise RuntimeError(f"REST server on {host}:{port} not listening after {timeout}s")
        await asyncio.sleep(0.02)     # polling uvicorn's started flag (bounded above)
    log.info("OpenAI REST API on http://%s:%d", host, HttpServer(server, task).port)
    return HttpServer(server, task)


def _head_deadline_protocol(header_timeout: float):
    """uvicorn's h11 protocol with a deadline on each request head. uvicorn's own
    timeout_keep_alive runs only between requests and stops at the first byte, so a client
    that sends half a request line and never the rest holds the connection forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:      # the head is in
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing %s: no request head within %.0f s", self.client, header_timeout)
                self.transport.close()

    return HeadDeadline
