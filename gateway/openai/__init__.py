"""OpenAI-compatible REST shim served by the gateway process (see app.py for its layout).

`start_http(gw, host, port, keys, ssl)` runs uvicorn inside the gateway's own event loop
(uvloop), beside the gRPC server; `await server.stop()` shuts it down.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from .app import create_app
from .errors import OpenAIError

__all__ = ["HttpServer", "OpenAIError", "create_app", "start_http"]

log = logging.getLogger(__name__)


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


async def start_http(gw, host: str, port: int, keys=None, tls: tuple[str, str] | None = None,
                     timeout: float = 30.0, drain_timeout_s: float = 5.0) -> HttpServer:
    """Serve the REST app on host:port (0: any free port) in the running loop, with API keys
    (a gateway.auth.KeyStore) and TLS (cert, key PEM paths) when given; returns once it is
    listening. Raises RuntimeError if it could not bind."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):        # the gateway owns SIGINT/SIGTERM
            yield

    ssl = dict(ssl_certfile=tls[0], ssl_keyfile=tls[1]) if tls else {}
    config = uvicorn.Config(create_app(gw, keys), host=host, port=port, log_level="warning",
                            lifespan="off", access_log=False,
                            timeout_graceful_shutdown=drain_timeout_s, **ssl)
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
