"""The prefill side's connections: one `Peer` per decode KV endpoint a KVSender (sender.py)
sends to, cached by the sender and shared by every transfer to that endpoint.

    Peer.connect(sender, endpoint, token)     connect, then the handshake, once per connection:
        -> HELLO {CompatKey, staging, token: the id of a transfer the receiver reserved}
        <- HELLO_ACK {its CompatKey, staging}: both must match (IncompatibleKV), or REJECT
    Peer.enqueue(message)                     the sender's loop, in push order (a LAYER,
                                              or a KEEPALIVE: a header alone, no body)
    writer task:   wait for the message's gather (its `ready` event, in a thread), then post
                   header + body; up to max_inflight messages in flight, so their round trips
                   overlap (UCX keeps per-endpoint order); the staging buffer goes back to
                   the pool once both sends completed, never while UCX may still read it
    watcher task:  the receiver sends nothing after the handshake: any recv result means it
                   closed
    drop(error):   every message still queued fails with `error`; the peer leaves the
                   sender's cache, so the next `open` reconnects

One writer per connection sends queued messages in push order, so messages of concurrent
transfers never interleave. Bounds: a connection's queue holds at most `max_queued_bytes` of
message bodies (a message beyond it fails, and so its transfer: the decode worker is not
keeping up); a message whose sends do not complete within `send_timeout_s` fails the
connection (a stalled or vanished peer), which is dropped. With "host" staging each LAYER
header carries a checksum of its body (wire.py), computed once the body is filled, just
before it is sent.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
from dataclasses import dataclass

import torch

from .transport import Connection, ConnectionClosed, TransportError
from .wire import HEADER_BYTES, Header, IncompatibleKV, MsgType, WireError, body_checksum, parse_hello

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Message:
    """One LAYER (or KEEPALIVE: no body) message of a transfer, queued on its peer."""
    handle: object                        # its sender.TransferHandle
    hdr: Header                           # packed when sent, with the body's checksum
    body: torch.Tensor | None             # from the sender's StagingPool (None: KEEPALIVE)
    fut: concurrent.futures.Future        # resolves when both sends completed
    ready: "torch.cuda.Event | None"      # the side stream finished filling `body`

    @property
    def nbytes(self) -> int:
        return 0 if self.body is None else self.body.numel()

    def free(self, pool, reuse: bool = True) -> None:
        """Give the body back to `pool` (`reuse` False: UCX may still read it)."""
        if self.body is not None:
            pool.release(self.body, reuse=reuse)


class Peer:
    """One connection to a decode KV endpoint: its queue, its writer and watcher tasks.
    `sender`: the KVSender it belongs to (its settings, staging pool and counters)."""

    def __init__(self, sender, endpoint: str, conn: Connection):
        self.sender, self.endpoint, self.conn = sender, endpoint, conn
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued_bytes = 0                 # bodies in `queue` (bounded by max_queued_bytes)
        self.error: Exception | None = None
        self.tasks: list[asyncio.Task] = []

    @classmethod
    async def connect(cls, sender, endpoint: str, token: str) -> "Peer":
        """A new connection to `endpoint`, handshaken with `token`, its tasks started.
        Raises TransportError (unreachable, timed out, closed) or IncompatibleKV."""
        timeout = sender.connect_timeout_s
        try:
            conn = await asyncio.wait_for(sender.transport.connect(endpoint, timeout), timeout)
        except (TransportError, OSError, asyncio.TimeoutError) as e:
            sender.failures += 1
            raise TransportError(f"cannot reach decode KV endpoint {endpoint}: {e or type(e).__name__}") from e
        peer = cls(sender, endpoint, conn)
        try:
            await asyncio.wait_for(peer._handshake(token), timeout)
        except BaseException as e:
            await conn.close()
            sender.failures += 1
            if isinstance(e, asyncio.TimeoutError):
                raise TransportError(f"KV handshake with {endpoint} timed out after {timeout}s") from None
            if isinstance(e, ConnectionClosed):
                raise TransportError(f"KV endpoint {endpoint} closed during the handshake: {e}") from e
            raise
        loop = asyncio.get_running_loop()
        peer.tasks = [loop.create_task(peer._write_loop()), loop.create_task(peer._watch())]
        return peer

    async def _handshake(self, token: str) -> None:
        s, conn, endpoint = self.sender, self.conn, self.endpoint
        hello = s.compat.hello(token, s.staging)
        await conn.send(Header(MsgType.HELLO, body_bytes=len(hello)).pack())
        await conn.send(hello)
        hdr = Header.unpack(await conn.recv(HEADER_BYTES))
        body = await conn.recv(hdr.body_bytes) if hdr.body_bytes else b""
        if hdr.msg_type is MsgType.REJECT:
            info = json.loads(bytes(body))
            raise IncompatibleKV(f"decode KV endpoint {endpoint} rejected this prefill worker: {info['error']}")
        if hdr.msg_type is not MsgType.HELLO_ACK:
            raise WireError(f"expected HELLO_ACK from {endpoint}, got {hdr.msg_type.name}")
        theirs, staging = parse_hello(body)
        s.compat.check(theirs, "prefill", "decode")
        if staging != s.staging:
            raise IncompatibleKV(f"KV staging: prefill={s.staging!r} decode={staging!r} "
                                 f"(decode KV endpoint {endpoint})")

    def enqueue(self, msg: Message) -> None:
        """Queue `msg` for the writer (on the loop), or fail it at once: the peer failed, or
        its queue is full."""
        error, pool = self.error, self.sender.pool
        if error is None and self.queued_bytes + msg.nbytes > self.sender.max_queued_bytes:
            error = TransportError(f"KV send queue to {self.endpoint} full ({self.queued_bytes} "
                                   f"bytes queued): the decode worker is not keeping up")
        if error is not None:
            msg.free(pool, reuse=False)
            msg.fut.set_exception(error)
        else:
            self.queued_bytes += msg.nbytes
            self.queue.put_nowait(msg)

    async def _write_loop(self) -> None:
        """Post each message's two sends in queue order with up to `max_inflight` messages
        in flight. A message is posted once its side-stream gather is done (waited for in a
        thread); a cancelled or failed transfer's messages are skipped."""
        s = self.sender
        slots = asyncio.Semaphore(s.max_inflight)
        loop = asyncio.get_running_loop()
        while True:
            msg = await self.queue.get()
            self.queued_bytes -= msg.nbytes
            if msg.ready is not None and not msg.ready.query():
                await loop.run_in_executor(None, msg.ready.synchronize)
            if msg.handle.cancelled or msg.fut.done():
                msg.free(s.pool)
                msg.fut.cancel()
                continue
            await slots.acquire()
            if self.error is not None:
                msg.free(s.pool, reuse=False)
                msg.fut.set_exception(self.error)
                return
            if s.staging == "host" and msg.body is not None:
                msg.hdr = dataclasses.replace(msg.hdr, checksum=body_checksum(msg.body))
            sends = [loop.create_task(self.conn.send(msg.hdr.pack()))]
            if msg.body is not None:
                sends.append(loop.create_task(self.conn.send(msg.body)))
            loop.create_task(self._complete(sends, msg, slots))

    async def _complete(self, sends, msg: Message, slots: asyncio.Semaphore) -> None:
        s = self.sender
        try:
            await asyncio.wait_for(asyncio.gather(*sends), s.send_timeout_s)
        except asyncio.TimeoutError:
            e = TransportError(f"KV send to {self.endpoint} not done after {s.send_timeout_s}s")
            if not msg.fut.done():
                msg.fut.set_exception(e)
            msg.free(s.pool, reuse=False)
            await self.drop(e)
            return
        except Exception as e:
            if not msg.fut.done():
                msg.fut.set_exception(TransportError(f"KV send to {self.endpoint} failed: {e}"))
            msg.free(s.pool, reuse=False)   # the other send may still hold it
            await self.drop(TransportError(f"KV endpoint {self.endpoint} is gone: {e}"))
            return
        finally:
            slots.release()
        msg.free(s.pool)
        if not msg.fut.done():
            msg.fut.set_result(None)
        n = msg.hdr.num_blocks
        s.blocks_sent += n
        s.bytes_sent += n * s.block_bytes

    async def _watch(self) -> None:
        """The receiver sends nothing after the handshake: any recv result means it closed."""
        try:
            await self.conn.recv(HEADER_BYTES)
            reason = "unexpected message after the handshake"
        except asyncio.CancelledError:
            return
        except Exception as e:
            reason = f"connection lost ({e})"
        await self.drop(TransportError(f"KV endpoint {self.endpoint}: {reason}"))

    async def drop(self, error: Exception) -> None:
        """Fail the peer: its queued messages fail with `error`, it leaves the sender's
        cache, its tasks stop and its connection closes."""
        if self.error is None:
            self.error = error
            if self.queue.qsize():
                log.warning("%s; failing %d queued KV messages", error, self.queue.qsize())
        self.sender.forget(self)
        while not self.queue.empty():
            msg = self.queue.get_nowait()
            self.queued_bytes -= msg.nbytes
            msg.free(self.sender.pool, reuse=False)
            if not msg.fut.done():
                msg.fut.set_exception(error)
        current = asyncio.current_task()
        for t in self.tasks:
            if t is not current:
                t.cancel()
        await self.conn.close()
