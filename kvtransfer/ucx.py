"""UcxTransport: the Transport interface over UCX through ucxx's asyncio API.

The ONLY module that imports ucxx. It stays thin: a bootstrap listener, endpoints, tag
send/recv. No UCX connection listener: ucxx 0.52's binds every address (its Python API takes
no host), so nothing of it is used. One connection instead:

    connecting side (prefill)                    accepting side (decode, `listen`)
    TCP connect HOST:PORT  ------------------->  asyncio server bound to HOST only
                           <-------------------  PDUX | version | tag | UCX worker address
    UCX endpoint from that worker address
    send(msg): UCX tag send (the tag)  ------->  recv: UCX tag recv of that tag, on the worker
    recv: a TCP frame      <-------------------  send(msg): a TCP frame (8-byte length + bytes)
    close(): a BYE frame   ------------------->  how many UCX messages it sent, then TCP closes

The connecting side's messages (HELLO, every LAYER: the KV) go over UCX; the accepting
side's (HELLO_ACK / REJECT: small, host memory) over the TCP connection, which is also the
connection's life: its end (close, or a dead peer) makes both sides' calls raise
ConnectionClosed. The tag is random per connection; the accepting side never parses
anything a peer sends but the UCX messages of its tag (the receiver's HELLO token check,
kvtransfer/receiver.py, still decides who may send KV); any byte arriving on its TCP
connection but one BYE frame is a protocol violation that closes it.

A connection's end, on the accepting side: UCX messages travel on other sockets than the
TCP connection, so the peer's last ones may arrive after its TCP end. A peer that closed
(BYE: n messages sent) is done once n arrived: the next receive fails at once, and one
still short waits only for messages that are on their way. A peer that left without a BYE
(it died) gets LAST_MESSAGES_S after its end for what it sent before, the deadline either
way.

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

Addresses look like "ucx://HOST:PORT" (the bootstrap listener); HOST is what this process
binds and advertises (`host`, default 127.0.0.1). UCX's TCP transport listens on every
network device unless UCX_NET_DEVICES says otherwise, so a transport whose host is an
address of one device pins UCX to that device (`UCX_NET_DEVICES=<its device>`, unless the
operator set it): with host 127.0.0.1 nothing of pdserve's KV path listens beyond loopback.
"""
from __future__ import annotations

import array
import asyncio
import collections
import fcntl
import logging
import os
import secrets
import socket
import struct
import time
from typing import Any

for _k, _v in (("UCX_RNDV_SCHEME", "put_zcopy"),
               ("UCXPY_PROGRESS_MODE", "blocking"), ("UCX_WARN_UNUSED_ENV_VARS", "n")):
    os.environ.setdefault(_k, _v)

import ucxx  # noqa: E402  (reads UCX_* when it makes its context, at the first listen/connect)
from ucxx._lib_async.continuous_ucx_progress import BlockingMode  # noqa: E402
from ucxx.core import _get_ctx  # noqa: E402
from ucxx.exceptions import UCXError  # noqa: E402
from ucxx.types import Tag  # noqa: E402

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

MAGIC, VERSION = b"PDUX", 2             # 2: the BYE frame
_BOOT = struct.Struct("<4sBQH")          # magic, version, tag, worker address length
_FRAME = struct.Struct("<Q")             # a TCP frame's length
_BYE, BYE = struct.Struct("<4sQ"), b"BYE!"   # the connecting side's last frame: UCX messages sent
MAX_FRAME_BYTES = 1 << 20                # the accepting side's messages are small replies
MAX_FRAMES = 16                          # unread ones
MAX_ADDRESS_BYTES = 1 << 14
# After the peer's TCP connection ended, its last UCX messages (sent before it closed, on
# other sockets) still get this long to arrive; a dead peer's receive fails after it. A peer
# that said BYE is waited for only while messages it counted are missing.
LAST_MESSAGES_S = 2.0


class UcxConnection(Connection):
    """One connection: UCX tag messages one way, TCP frames the other (see the top). `ep`:
    the connecting side's UCX endpoint to the accepting side's worker; None on the accepting
    side, which receives on its worker by tag and never parses a peer's worker address (UCX
    aborts the process on a malformed one)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tag: int,
                 ep: Any, peer: str):
        self._reader, self._writer, self._ep = reader, writer, ep
        self._tag = Tag(tag)
        self.peer, self._accepting = peer, ep is None
        self._closed = False                  # close() was called
        self._gone = asyncio.Event()          # the TCP connection ended
        self._frames: collections.deque[bytes] = collections.deque()   # connecting side
        self._arrived = asyncio.Event()       # a frame arrived, or the connection ended
        self._sent = self._received = 0       # UCX messages (connecting / accepting side)
        self._promised: int | None = None     # accepting: the peer's BYE count (None: none yet)
        self._reading = asyncio.ensure_future(self._read_tcp())

    @property
    def closed(self) -> bool:
        return self._closed or self._gone.is_set() or (self._ep is not None and self._ep.closed)

    async def send(self, buffer: Any) -> None:
        if self.closed:
            raise ConnectionClosed(f"UCX connection to {self.peer} is closed")
        try:
            if not self._accepting:
                self._sent += 1
                await self._ep.send(as_buffer(buffer), tag=self._tag, force_tag=True)
            else:
                data = memoryview(as_buffer(buffer)).cast("B")
                self._writer.write(_FRAME.pack(data.nbytes))
                self._writer.write(data)
                await self._writer.drain()
        except (UCXError, OSError, ConnectionError) as e:
            raise ConnectionClosed(f"UCX send to {self.peer} failed: {type(e).__name__}: {e}") from e

    async def recv(self, nbytes: int | None = None, *, into: Any = None) -> Any:
        # No check of the peer's end first: a message that arrived before the peer closed
        # is still delivered, e.g. a REJECT followed by a close.
        if self._closed:
            raise ConnectionClosed(f"UCX connection to {self.peer} is closed")
        out = bytearray(nbytes) if into is None else into
        if nbytes_of(out) == 0:
            return out
        if not self._accepting:
            return await self._recv_frame(out)
        await self._message_arrived()
        return await self._recv_ucx(out)

    async def _recv_ucx(self, out: Any) -> Any:
        """The accepting side: the matched UCX message into `out`. UCX does not fail a
        receive whose (rendezvous) sender died, so the TCP connection's end decides: what
        the peer sent before it left gets LAST_MESSAGES_S more to arrive, then the receive
        fails and its UCX request is left to the dead or departed peer (one that passed the
        HELLO check: only then are pooled buffers received into)."""
        recv = asyncio.ensure_future(ucxx.recv(as_buffer(out), self._tag))
        gone = asyncio.ensure_future(self._gone.wait())
        await asyncio.wait({recv, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not recv.done():
            await asyncio.wait({recv}, timeout=LAST_MESSAGES_S)
        if not recv.done():
            recv.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise ConnectionClosed(f"UCX connection to {self.peer} ended during a receive")
        try:
            recv.result()
        except UCXError as e:
            raise ConnectionClosed(f"UCX recv from {self.peer} failed: {type(e).__name__}: {e}") from e
        self._received += 1
        return out

    def _all_arrived(self) -> bool:
        """The peer closed after a BYE and every message it counted was received."""
        return self._gone.is_set() and self._promised is not None and self._received >= self._promised

    async def _recv_frame(self, out: Any) -> Any:
        """The connecting side: the next TCP frame, exactly the size of `out`."""
        while not self._frames:
            if self._gone.is_set() or self._closed:
                raise ConnectionClosed(f"UCX connection to {self.peer} closed")
            self._arrived.clear()
            await self._arrived.wait()
        data = self._frames.popleft()
        if len(data) != nbytes_of(out):
            raise TransportError(f"message of {len(data)} bytes from {self.peer}, expected {nbytes_of(out)}")
        memoryview(as_buffer(out)).cast("B")[:] = data
        return out

    async def _message_arrived(self) -> None:
        """Until a message of this connection's tag is there (recv then takes it), or the
        connection ended. ucxx's recv, in blocking mode, polls its request with
        asyncio.sleep(0): a receiver idly waiting for the next header would spin the loop
        (10-25% of a core, measured). Instead, probe after each UCX progress; the 1 s wake-up
        is the safety net ucxx's own progress timeout also is."""
        loop = asyncio.get_running_loop()
        worker = _get_ctx().worker           # the UCXWorker (ucxx's public getters give pointers)
        last = None                          # after the TCP connection's end: LAST_MESSAGES_S
        while not worker.tag_probe(self._tag).matched:
            if self._gone.is_set():
                last = last or loop.time() + LAST_MESSAGES_S
            if self._closed or self._all_arrived() or (last and loop.time() >= last):
                raise ConnectionClosed(f"UCX connection to {self.peer} closed")
            fut = loop.create_future()
            _progress_waiters.add(fut)
            try:
                await asyncio.wait_for(fut, 1.0 if last is None else max(last - loop.time(), 0.01))
            except asyncio.TimeoutError:
                pass

    async def _read_tcp(self) -> None:
        """Frames into `_frames` until the TCP connection ends. The accepting side's peer
        sends none after the bootstrap but its BYE: another frame there, an oversized one or
        too many unread end the connection."""
        try:
            while True:
                (n,) = _FRAME.unpack(await self._reader.readexactly(_FRAME.size))
                if self._accepting and n == _BYE.size and self._promised is None:
                    magic, count = _BYE.unpack(await self._reader.readexactly(n))
                    if magic == BYE:
                        self._promised = count
                        continue
                if self._accepting or n > MAX_FRAME_BYTES or len(self._frames) >= MAX_FRAMES:
                    log.warning("KV connection %s: unexpected TCP frame of %d bytes, closing", self.peer, n)
                    break
                self._frames.append(await self._reader.readexactly(n))
                self._arrived.set()
        except (asyncio.IncompleteReadError, OSError, ConnectionError):
            pass
        finally:
            self._gone.set()
            self._arrived.set()
            self._writer.close()
            _wake_receivers()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._accepting and not self._gone.is_set():    # flushed by the close below
            self._writer.write(_FRAME.pack(_BYE.size) + _BYE.pack(BYE, self._sent))
        self._reading.cancel()
        self._writer.close()
        self._arrived.set()
        _wake_receivers()
        if self._ep is not None:
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
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[UcxConnection] = set()

    async def listen(self, handler: Handler) -> str:
        ucxx.continuous_ucx_progress()
        address = ucxx.get_worker_address().tobytes()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            tag = secrets.randbits(64)
            writer.write(_BOOT.pack(MAGIC, VERSION, tag, len(address)) + address)
            conn = UcxConnection(reader, writer, tag, None, "ucx-client")
            self._conns.add(conn)
            try:
                await writer.drain()
                await handler(conn)
            except (OSError, ConnectionError) as e:
                log.debug("KV bootstrap connection dropped: %s", e)
            finally:
                self._conns.discard(conn)
                await conn.close()

        self._server = await asyncio.start_server(on_client, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}{host}:{port}"

    async def connect(self, address: str, timeout: float = 5.0) -> Connection:
        host, port = parse_address(address)
        writer = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port)
                magic, version, tag, n = _BOOT.unpack(await reader.readexactly(_BOOT.size))
                if magic != MAGIC or version != VERSION or n > MAX_ADDRESS_BYTES:
                    raise TransportError(f"{address} is not a pdserve UCX KV endpoint (version {VERSION})")
                worker = ucxx.get_ucx_address_from_buffer(await reader.readexactly(n))
                ep = await ucxx.create_endpoint_from_worker_address(worker)
        except (UCXError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, TransportError) as e:
            if writer is not None:
                writer.close()
            raise TransportError(f"UCX connect to {address} failed: {type(e).__name__}: {e}") from e
        conn = UcxConnection(reader, writer, tag, ep, address)
        self._conns.add(conn)
        return conn

    async def close(self) -> None:
        for conn in list(self._conns):
            await conn.close()
        self._conns.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
