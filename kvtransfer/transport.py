"""The transport seam: a narrow async interface for moving byte messages between processes.

`KVSender`/`KVReceiver` only talk to `Transport`/`Connection`, so tests swap the real UCX
transport (kvtransfer/ucx.py) for `LoopbackTransport` (this file, in-process).

Semantics every transport provides (UCX tag send/recv on one endpoint gives them):
  * message-oriented: one `send(buf)` is matched by one `recv` of exactly `len(buf)` bytes;
  * ordered per connection: messages arrive in the order they were sent;
  * a peer that closes or dies makes pending and later `send`/`recv` raise `ConnectionClosed`.
Buffers are bytes-like objects, numpy arrays or contiguous torch tensors (see `as_buffer`).
"""
from __future__ import annotations

import abc
import asyncio
import itertools
from typing import Any, Awaitable, Callable

import numpy as np
import torch


class TransportError(RuntimeError):
    """A transport-level failure (connect refused, peer gone, timeout)."""


class ConnectionClosed(TransportError):
    """The peer closed the connection or went away."""


def as_buffer(buf: Any) -> Any:
    """Return something the transports can send from / receive into without a copy.

    CPU torch tensors become a flat uint8 numpy view (numpy has no bfloat16); CUDA tensors
    are returned as is (they expose __cuda_array_interface__ for UCX's cuda_copy)."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("transport buffers must be contiguous tensors")
        if buf.is_cuda:
            return buf
        return buf.view(-1).view(torch.uint8).numpy()
    return buf


def nbytes_of(buf: Any) -> int:
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    if isinstance(buf, np.ndarray):
        return buf.nbytes
    return memoryview(buf).nbytes


class Connection(abc.ABC):
    """One ordered, message-oriented, bidirectional connection."""

    peer: str = ""

    @abc.abstractmethod
    async def send(self, buffer: Any) -> None:
        """Send one message; returns when the buffer may be reused."""

    @abc.abstractmethod
    async def recv(self, nbytes: int | None = None, *, into: Any = None) -> Any:
        """Receive one message of exactly `nbytes` bytes (a new bytearray) or exactly the
        size of `into` (written in place, returned)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close; idempotent. The peer's pending and later calls raise ConnectionClosed."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...


Handler = Callable[[Connection], Awaitable[None]]


class Transport(abc.ABC):
    """Creates connections. One instance per process side; all methods run on one event loop."""

    @abc.abstractmethod
    async def listen(self, handler: Handler) -> str:
        """Start accepting connections; `handler(conn)` runs as a task per connection.
        Returns the address peers pass to `connect`."""

    @abc.abstractmethod
    async def connect(self, address: str, timeout: float = 5.0) -> Connection:
        """Connect to an address returned by `listen` (raises TransportError on failure)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop listening and close every connection this transport made or accepted."""


# ----------------------------------------------------------------------------- loopback

_CLOSED = object()


class LoopbackConnection(Connection):
    """One end of an in-process pair. Both ends must live on the same event loop."""

    def __init__(self, peer: str):
        self.peer = peer
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._other: LoopbackConnection | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, buffer: Any) -> None:
        if self._closed or self._other is None or self._other._closed:
            raise ConnectionClosed(f"loopback connection to {self.peer} is closed")
        data = bytes(memoryview(as_buffer(buffer)).cast("B"))  # a copy, like the wire
        self._other._inbox.put_nowait(data)

    async def recv(self, nbytes: int | None = None, *, into: Any = None) -> Any:
        if self._closed:
            raise ConnectionClosed(f"loopback connection to {self.peer} is closed")
        data = await self._inbox.get()
        if data is _CLOSED:
            self._inbox.put_nowait(_CLOSED)  # later recvs fail too
            raise ConnectionClosed(f"loopback peer {self.peer} closed the connection")
        want = nbytes if into is None else nbytes_of(into)
        if len(data) != want:
            raise TransportError(f"message of {len(data)} bytes, expected {want}")
        if into is None:
            return bytearray(data)
        memoryview(as_buffer(into)).cast("B")[:] = data
        return into

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put_nowait(_CLOSED)
        if self._other is not None and not self._other._closed:
            self._other._inbox.put_nowait(_CLOSED)


class LoopbackTransport(Transport):
    """In-process transport for unit tests: `connect` pairs two LoopbackConnections.

    Instances in one process share a registry keyed by address ("loopback://N")."""

    _listeners: dict[str, "LoopbackTransport"] = {}
    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.address: str | None = None
        self._handler: Handler | None = None
        self._conns: list[LoopbackConnection] = []
        self._tasks: set[asyncio.Task] = set()

    async def listen(self, handler: Handler) -> str:
        self.address = f"loopback://{next(self._ids)}"
        self._handler = handler
        self._listeners[self.address] = self
        return self.address

    async def connect(self, address: str, timeout: float = 5.0) -> Connection:
        server = self._listeners.get(address)
        if server is None or server._handler is None:
            raise TransportError(f"nothing listens on {address}")
        client, accepted = LoopbackConnection(address), LoopbackConnection("loopback-client")
        client._other, accepted._other = accepted, client
        self._conns.append(client)
        server._conns.append(accepted)
        task = asyncio.get_running_loop().create_task(server._handler(accepted))
        server._tasks.add(task)
        task.add_done_callback(server._tasks.discard)
        return client

    async def close(self) -> None:
        if self.address is not None:
            self._listeners.pop(self.address, None)
        for c in self._conns:
            await c.close()
        for t in list(self._tasks):
            t.cancel()
        self._conns.clear()
