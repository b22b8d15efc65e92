"""UcxTransport: the Transport interface over UCX through ucxx's asyncio API.

The ONLY module that imports ucxx. It stays thin: a listener, endpoints, tag send/recv.

UCX settings, applied with os.environ.setdefault before ucxx makes its UCX context (an
operator's own UCX_* values always win; they are standard UCX variables, not pdserve
configuration):

  UCX_TLS=tcp                   PyPI's libucx; loopback/cross-host TCP (host staging).
  UCX_TLS=tcp,cuda_copy,cuda_ipc  with UcxTransport(device_memory=True) (staging "device"):
                                GPU buffers go GPU to GPU through cuda_ipc between processes
                                of one node, tcp carries the handshake. The first transport
                                of a process decides (UCX reads it once). For RDMA between
                                nodes see kvtransfer/README.md.
  UCX_RNDV_SCHEME=put_zcopy     large messages by zero-copy put: tcp 1.5 -> 5.5 GB/s here.
  UCXPY_PROGRESS_MODE=blocking  progress UCX from the asyncio loop when its fd is readable;
                                the default "thread" mode is slow on few cores. (ucxx's
                                blocking mode forgets to re-arm the worker: patched below.)
  UCX_WARN_UNUSED_ENV_VARS=n    silence UCX's warning about variables it does not use.

Addresses look like "ucx://HOST:PORT"; HOST is what this process advertises (`host`,
default 127.0.0.1). Binding: UCX's TCP transport listens on every network device unless
UCX_NET_DEVICES says otherwise, so a transport whose host is an address of one device pins
UCX to that device (`UCX_NET_DEVICES=<its device>`, unless the operator set it): with
host 127.0.0.1 nothing of UCX's data path listens beyond loopback. ucxx 0.52's Python API
still binds the connection listener (the port in the address) to every address (its C++
ListenerBuilder has a host, its Python binding does not): the receiver's handshake token
(kvtransfer/receiver.py) keeps strangers out of it.
"""
from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import os
import socket
import struct
import time
from typing import Any

for _k, _v in (("UCX_RNDV_SCHEME", "put_zcopy"),
               ("UCXPY_PROGRESS_MODE", "blocking"), ("UCX_WARN_UNUSED_ENV_VARS", "n")):
    os.environ.setdefault(_k, _v)

import ucxx  # noqa: E402  (reads UCX_* when it makes its context, at the first listen/connect)
from ucxx._lib_async.continuous_ucx_progress import BlockingMode  # noqa: E402
from ucxx.exceptions import UCXError  # noqa: E402

from .transport import Connection, ConnectionClosed, Handler, Transport, TransportError, as_buffer, nbytes_of  # noqa: E402

log = logging.getLogger(__name__)
SCHEME = "ucx://"
HOST_TLS, DEVICE_TLS = "tcp", "tcp,cuda_copy,cuda_ipc"


def parse_address(address: str) -> tuple[str, int]:
    if not address.startswith(SCHEME):
        raise TransportError(f"not a UCX address: {address!r} (expected ucx://HOST:PORT)")
    host, _, port = address[len(SCHEME):].rpartition(":")
    if not host or not port.isdigit():
        raise TransportError(f"bad UCX address {address!r} (expected ucx://HOST:PORT)")
    return host.strip("[]"), int(port)


def device_of(host: str) -> str | None:
    """The network device holding IPv4 address `host` (None: not a local address of one
    device, e.g. 0.0.0.0 or a name)."""
    try:
        packed = socket.inet_aton(host)
    except OSError:
        return None
    if packed == bytes(4):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(s.fileno(), 0x8915, req)      # SIOCGIFADDR
            except OSError:
                continue
            if req.tobytes()[20:24] == packed:
                return name
    return None
# futures of receivers waiting for a message, resolved after every UCX progress
_progress_waiters: set[asyncio.Future] = set()


def _progress_and_rearm(self: BlockingMode) -> None:
    """ucxx's blocking mode progresses the worker when its epoll fd turns readable but never
    re-arms it: after the first event the fd stays readable and the event loop spins on it
    (a fifth of a core per idle worker, measured). Progress, then re-arm, as ucx-py did."""
    self.worker.progress()
    if self.arm_task is None or self.arm_task.done():
        self.arm_task = self.event_loop.create_task(self._arm_worker())
        self.arm_task.add_done_callback(_wake_receivers)   # its progress may bring messages
    _wake_receivers()


def _wake_receivers(*_) -> None:
    for fut in _progress_waiters:
        if not fut.done():
            fut.set_result(None)
    _progress_waiters.clear()


async def _progress_when_quiet(self: BlockingMode) -> None:
    """The safety net (no event seen for progress_timeout: progress anyway), re-arming too;
    ucxx's cancels the arming task and leaves the worker unarmed, so events would then be
    seen only once per timeout."""
    while self.worker is not None:
        await asyncio.sleep(self._progress_timeout)
        if time.monotonic() > self.last_progress_time + self._progress_timeout:
            self.last_progress_time = time.monotonic()
            _progress_and_rearm(self)


BlockingMode._fd_reader_callback = _progress_and_rearm
BlockingMode._progress_with_timeout = _progress_when_quiet




class UcxConnection(Connection):
    def __init__(self, ep: Any, peer: str):
        self._ep = ep
        self.peer = peer
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed or self._ep.closed

    async def send(self, buffer: Any) -> None:
        if self._closed:
            raise ConnectionClosed(f"UCX connection to {self.peer} is closed")
        try:
            await self._ep.send(as_buffer(buffer))
        except UCXError as e:
            raise ConnectionClosed(f"UCX send to {self.peer} failed: {type(e).__name__}: {e}") from e

    async def recv(self, nbytes: int | None = None, *, into: Any = None) -> Any:
        # No closed() pre-check: a message that arrived before the peer closed is still
        # delivered (ucxx probes for it), e.g. a REJECT followed by a close.
        if self._closed:
            raise ConnectionClosed(f"UCX connection to {self.peer} is closed")
        out = bytearray(nbytes) if into is None else into
        if nbytes_of(out) == 0:
            return out
        await self._message_arrived()
        try:
            await self._ep.recv(as_buffer(out))
        except UCXError as e:
            raise ConnectionClosed(f"UCX recv from {self.peer} failed: {type(e).__name__}: {e}") from e
        return out

    async def _message_arrived(self) -> None:
        """Until a message is there (or the endpoint closed). ucxx's recv, in blocking mode,
        polls its request with asyncio.sleep(0): a receiver idly waiting for the next header
        would spin the loop (10-25% of a core, measured). Instead, probe after each UCX
        progress; the 1 s wake-up is the safety net ucxx's own progress timeout also is."""
        loop = asyncio.get_running_loop()
        while not self._ep.closed and not self._ep.tag_probe().matched:
            fut = loop.create_future()
            _progress_waiters.add(fut)
            try:
                await asyncio.wait_for(fut, 1.0)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._ep.close(), 2.0)
        except (UCXError, asyncio.TimeoutError, RuntimeError) as e:
            log.debug("closing UCX endpoint to %s: %s", self.peer, e)
            self._ep.abort()


class UcxTransport(Transport):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, device_memory: bool = False):
        """`device_memory`: this process sends from / receives into GPU memory."""
        os.environ.setdefault("UCX_TLS", DEVICE_TLS if device_memory else HOST_TLS)
        device = device_of(host)
        if device is not None:      # read when ucxx makes its context (first listen/connect)
            os.environ.setdefault("UCX_NET_DEVICES", device)
        self.host = host
        self.port = port
        self._listener: Any = None
        self._conns: set[UcxConnection] = set()

    async def listen(self, handler: Handler) -> str:
        async def on_endpoint(ep: Any) -> None:
            conn = UcxConnection(ep, "ucx-client")
            self._conns.add(conn)
            try:
                await handler(conn)
            finally:
                self._conns.discard(conn)
                await conn.close()

        self._listener = ucxx.create_listener(on_endpoint, port=self.port)
        return f"{SCHEME}{self.host}:{self._listener.port}"

    async def connect(self, address: str, timeout: float = 5.0) -> Connection:
        host, port = parse_address(address)
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, port, connect_timeout=timeout), timeout)
        except (UCXError, OSError, asyncio.TimeoutError) as e:
            raise TransportError(f"UCX connect to {address} failed: {type(e).__name__}: {e}") from e
        conn = UcxConnection(ep, address)
        self._conns.add(conn)
        return conn

    async def close(self) -> None:
        for conn in list(self._conns):
            await conn.close()
        self._conns.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
