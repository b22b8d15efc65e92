"""Prefill side: pushes a request's KV blocks to a decode worker's KVReceiver, layer by layer.

    handle = await sender.open(tid, endpoint, src_block_ids, dst_block_ids)   # on the loop
    # engine step thread, right after layer i's KV was written:
    sender.push_layer_threadsafe(handle, i)          # gather copy here, send on the loop
    ...
    stats = await sender.finish(handle, timeout=5)   # every message sent (or an error)

Connections are cached per endpoint; the HELLO handshake (protocol version + CompatKey +
staging + the token of the first transfer, see receiver.py) happens once per connection. Each
pushed layer is ONE message: all its blocks' K and V are gathered into a single contiguous
buffer (small per-block messages are slow over UCX).

A CUDA cache is never read on the compute stream and the engine thread never waits:

    engine thread (compute stream)    side stream                      event loop
    layer i's kernels ... record ---> wait event; gather blocks into
    push_layer_threadsafe returns     a staging buffer (pinned host, or
                                      GPU memory with staging "device");
                                      record `ready`            ---->  wait `ready` in a
                                                                       thread, send, release
                                                                       the buffer to the pool
Staging buffers come from a StagingPool (staging.py) and go back to it only once their send
completed, so a buffer is never reused while UCX may still read it.
One writer task per connection sends queued messages in push order, so messages of
concurrent transfers never interleave. A connection that fails fails every transfer queued
on it and is dropped from the cache; the next `open` reconnects. Bounds: a connection's
queue holds at most `max_queued_bytes` of message bodies (a message beyond it fails, and so
its transfer: the decode worker is not keeping up); a message whose sends do not complete
within `send_timeout_s` fails the connection (a stalled or vanished peer), which is dropped.
With "host" staging each LAYER header carries a checksum of its body (wire.py), computed
once the body is filled, just before it is sent.

The decode side acknowledges nothing per transfer: it learns completion from the data
itself, and reports problems through its own gRPC stream.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field

import torch

from .staging import StagingPool
from .transport import Connection, ConnectionClosed, Transport, TransportError
from .wire import (HEADER_BYTES, CompatKey, Header, IncompatibleKV, MsgType, WireError,
                   block_bytes, body_checksum, ids_bytes, parse_hello, payload_views)

log = logging.getLogger(__name__)


class KVTransferTimeout(TransportError):
    """finish() ran out of time before every message was sent."""


@dataclass
class TransferStats:
    transfer_id: str
    messages: int
    blocks_sent: int        # (layer, block) pairs
    bytes_sent: int         # payload bytes (block ids and headers excluded)
    elapsed_s: float        # open -> finish


@dataclass(eq=False)
class TransferHandle:
    transfer_id: str
    endpoint: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    _peer: "_Peer"
    _src_index: torch.Tensor
    _futures: list[concurrent.futures.Future] = field(default_factory=list)
    _bound_fixed: int = 0                 # blocks [0, this) were pushed: set_source may not move them
    _pushed_blocks: int = 0
    _bytes: int = 0
    _started: float = field(default_factory=time.monotonic)
    cancelled: bool = False

    def set_source(self, src_block_ids: list[int], start: int = 0) -> None:
        """Point destination blocks [start, start + len) at these source blocks (same
        order). The prefill worker opens a transfer before its request is scheduled and
        learns the request's blocks chunk by chunk in the engine steps: it binds each chunk's
        blocks before pushing them. Blocks already pushed cannot be re-pointed."""
        end = start + len(src_block_ids)
        if not 0 <= start <= end <= len(self.dst_block_ids):
            raise ValueError(f"source blocks [{start}, {end}) for "
                             f"{len(self.dst_block_ids)} destination blocks")
        if start < self._bound_fixed:
            raise RuntimeError(f"set_source() at block {start}: blocks [0, {self._bound_fixed}) "
                               "were pushed already")
        self.src_block_ids[start:end] = src_block_ids
        self._src_index = torch.tensor(self.src_block_ids, dtype=torch.long, device=self._src_index.device)


@dataclass(eq=False)
class _Message:
    handle: TransferHandle
    hdr: Header                           # packed when sent, with the body's checksum
    body: torch.Tensor                    # from the sender's StagingPool
    fut: concurrent.futures.Future
    ready: "torch.cuda.Event | None"      # the side stream finished filling `body`


class _Peer:
    def __init__(self, endpoint: str, conn: Connection):
        self.endpoint = endpoint
        self.conn = conn
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued_bytes = 0                 # bodies in `queue` (bounded by max_queued_bytes)
        self.error: Exception | None = None
        self.tasks: list[asyncio.Task] = []


class KVSender:
    def __init__(self, kv_cache: torch.Tensor, compat: CompatKey, transport: Transport, *,
                 connect_timeout_s: float = 5.0, max_inflight: int = 4, staging: str = "host",
                 kv_scales: torch.Tensor | None = None, send_timeout_s: float = 10.0,
                 max_queued_bytes: int = 1 << 30):
        """`kv_scales`: the scales of an 8-bit cache; they travel with their blocks."""
        CompatKey.from_cache(kv_cache, compat.model, kv_scales).check(compat, "kv_cache", "compat")
        self.kv_cache, self.kv_scales = kv_cache, kv_scales
        self.compat = compat
        self.transport = transport
        self.connect_timeout_s = connect_timeout_s
        self.max_inflight = max_inflight      # layer messages posted but not yet completed
        self.send_timeout_s = send_timeout_s  # one message's sends; then the peer is dropped
        self.max_queued_bytes = max_queued_bytes   # per connection
        self._block_bytes = block_bytes(kv_cache, kv_scales)
        self.staging = staging
        self.pool = StagingPool(kv_cache, staging)
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # counters (monotonic)
        self.transfers_done = 0
        self.blocks_sent = 0
        self.bytes_sent = 0
        self.failures = 0

    # ------------------------------------------------------------------ API
    async def open(self, transfer_id: str, endpoint: str, src_block_ids: list[int],
                   dst_block_ids: list[int]) -> TransferHandle:
        """Start a transfer of `src_block_ids` (this cache) into `dst_block_ids` (the
        receiver's reservation, same order). Connects and handshakes on first use of
        `endpoint`; raises IncompatibleKV or TransportError."""
        if len(src_block_ids) != len(dst_block_ids) or not src_block_ids:
            raise ValueError(f"need as many source as destination blocks (>0): "
                             f"{len(src_block_ids)} vs {len(dst_block_ids)}")
        Header(MsgType.LAYER, transfer_id).pack()  # validates the id's length
        self._loop = asyncio.get_running_loop()
        peer = await self._peer(endpoint, transfer_id)
        idx = torch.tensor(src_block_ids, dtype=torch.long, device=self.kv_cache.device)
        return TransferHandle(transfer_id, endpoint, list(src_block_ids), list(dst_block_ids), peer, idx)

    def push_layer_threadsafe(self, handle: TransferHandle, layer: int, start: int = 0,
                              end: int | None = None) -> concurrent.futures.Future:
        """Gather layer `layer` of blocks [start, end) of the handle (default: all) into one
        message in the calling thread, and queue its send on the sender's loop. Callable
        from any thread. The returned future resolves when the message was sent."""
        msg = self._gather(handle, layer, start, end)
        handle._futures.append(msg.fut)
        self._loop.call_soon_threadsafe(self._enqueue, msg)
        return msg.fut

    async def push_layer(self, handle: TransferHandle, layer: int, start: int = 0,
                         end: int | None = None) -> None:
        """Like push_layer_threadsafe, from the loop; returns once the message was sent."""
        msg = self._gather(handle, layer, start, end)
        handle._futures.append(msg.fut)
        self._enqueue(msg)
        await asyncio.wrap_future(msg.fut)

    async def finish(self, handle: TransferHandle, timeout: float) -> TransferStats:
        """Wait until every pushed message was sent. Raises ValueError if not every layer
        of every block was pushed, KVTransferTimeout, or TransportError (peer gone)."""
        total = self.compat.num_layers * len(handle.dst_block_ids)
        if handle._pushed_blocks != total:
            self.cancel(handle)
            raise ValueError(f"transfer {handle.transfer_id}: {handle._pushed_blocks} of {total} "
                             f"(layer, block) pairs pushed before finish()")
        futs = [asyncio.wrap_future(f) for f in handle._futures]
        try:
            await asyncio.wait_for(asyncio.gather(*futs), timeout)
        except asyncio.TimeoutError:
            self.cancel(handle)
            self.failures += 1
            sent = sum(f.done() and not f.cancelled() and f.exception() is None for f in handle._futures)
            raise KVTransferTimeout(f"KV transfer {handle.transfer_id} to {handle.endpoint} not finished "
                                    f"after {timeout}s ({sent}/{len(futs)} layer messages sent)") from None
        except Exception:
            self.cancel(handle)
            self.failures += 1
            raise
        self.transfers_done += 1
        return TransferStats(handle.transfer_id, len(futs), handle._pushed_blocks, handle._bytes,
                             time.monotonic() - handle._started)

    def cancel(self, handle: TransferHandle) -> None:
        """Skip this transfer's queued messages (abort). Thread-safe."""
        handle.cancelled = True

    async def close(self) -> None:
        for peer in list(self._peers.values()):
            await self._drop(peer, ConnectionClosed("sender closed"))
        await self.transport.close()

    def counters(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("transfers_done", "blocks_sent", "bytes_sent", "failures")}

    # ------------------------------------------------------------------ internals
    def _gather(self, h: TransferHandle, layer: int, start: int, end: int | None) -> _Message:
        """Fill a staging buffer with [block ids | K and V of blocks [start, end) of `layer`].
        On CUDA the gather is queued on the side stream after everything the compute stream
        queued so far (this layer's kernels) and this returns at once."""
        end = len(h.dst_block_ids) if end is None else end
        n = end - start
        if not 0 <= layer < self.compat.num_layers or not 0 <= start < end <= len(h.dst_block_ids):
            raise ValueError(f"bad push: layer {layer}, blocks [{start}, {end}) of {len(h.dst_block_ids)}")
        off = ids_bytes(n)
        body = self.pool.acquire(off + n * self._block_bytes)
        ids = torch.zeros(off // 4, dtype=torch.int32)
        ids[:n] = torch.tensor(h.dst_block_ids[start:end], dtype=torch.int32)
        payload, scales = payload_views(body, self.kv_cache, self.kv_scales, n)
        idx = h._src_index[start:end]
        pairs = [(self.kv_cache[layer], payload)]        # src: [2, num_blocks, bs, heads, dim]
        if scales is not None:
            pairs.append((self.kv_scales[layer], scales))
        ready = None
        if self._stream is None:     # CPU cache: gather straight into the message buffer
            body[:off].view(torch.int32).copy_(ids)
            for src, dst in pairs:
                torch.index_select(src, 1, idx, out=dst)
        else:
            after_layer = torch.cuda.current_stream(self.kv_cache.device).record_event()
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(after_layer)
                idx.record_stream(self._stream)       # set_source may drop the handle's index
                body[:off].view(torch.int32).copy_(ids, non_blocking=True)
                for src, dst in pairs:
                    if dst.is_cuda:                   # staging "device": one gather, no host copy
                        torch.index_select(src, 1, idx, out=dst)
                    else:                             # gather on the GPU, one copy to pinned host
                        dst.copy_(src.index_select(1, idx), non_blocking=True)
                ready = self._stream.record_event()
        hdr = Header(MsgType.LAYER, h.transfer_id, layer, start, n, body.numel())
        h._pushed_blocks += n
        h._bytes += n * self._block_bytes
        h._bound_fixed = max(h._bound_fixed, end)
        return _Message(h, hdr, body, concurrent.futures.Future(), ready)

    def _enqueue(self, msg: _Message) -> None:
        peer = msg.handle._peer
        error = peer.error
        if error is None and peer.queued_bytes + msg.body.numel() > self.max_queued_bytes:
            error = TransportError(f"KV send queue to {peer.endpoint} full ({peer.queued_bytes} "
                                   f"bytes queued): the decode worker is not keeping up")
        if error is not None:
            self.pool.release(msg.body, reuse=False)
            msg.fut.set_exception(error)
        else:
            peer.queued_bytes += msg.body.numel()
            peer.queue.put_nowait(msg)

    async def _peer(self, endpoint: str, token: str) -> _Peer:
        """The cached connection to `endpoint`, or a new one whose HELLO carries `token` (the
        id of a transfer the receiver reserved: it refuses HELLOs without one)."""
        peer = self._peers.get(endpoint)
        if peer is not None and peer.error is None:
            return peer
        lock = self._connecting.setdefault(endpoint, asyncio.Lock())
        async with lock:
            peer = self._peers.get(endpoint)
            if peer is not None and peer.error is None:
                return peer
            try:
                conn = await asyncio.wait_for(self.transport.connect(endpoint, self.connect_timeout_s),
                                              self.connect_timeout_s)
            except (TransportError, OSError, asyncio.TimeoutError) as e:
                self.failures += 1
                raise TransportError(f"cannot reach decode KV endpoint {endpoint}: {e or type(e).__name__}") from e
            try:
                await asyncio.wait_for(self._handshake(conn, endpoint, token), self.connect_timeout_s)
            except BaseException as e:
                await conn.close()
                self.failures += 1
                if isinstance(e, asyncio.TimeoutError):
                    raise TransportError(f"KV handshake with {endpoint} timed out "
                                         f"after {self.connect_timeout_s}s") from None
                if isinstance(e, ConnectionClosed):
                    raise TransportError(f"KV endpoint {endpoint} closed during the handshake: {e}") from e
                raise
            peer = _Peer(endpoint, conn)
            loop = asyncio.get_running_loop()
            peer.tasks = [loop.create_task(self._write_loop(peer)), loop.create_task(self._watch(peer))]
            self._peers[endpoint] = peer
            return peer

    async def _handshake(self, conn: Connection, endpoint: str, token: str) -> None:
        hello = self.compat.hello(token, self.staging)
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
        self.compat.check(theirs, "prefill", "decode")
        if staging != self.staging:
            raise IncompatibleKV(f"KV staging: prefill={self.staging!r} decode={staging!r} "
                                 f"(decode KV endpoint {endpoint})")

    async def _write_loop(self, peer: _Peer) -> None:
        """Post each message's two sends in queue order (UCX keeps per-endpoint order) with
        up to `max_inflight` messages in flight, so per-message round trips overlap. A
        message is posted once its side-stream gather is done (waited for in a thread)."""
        slots = asyncio.Semaphore(self.max_inflight)
        loop = asyncio.get_running_loop()
        while True:
            msg = await peer.queue.get()
            peer.queued_bytes -= msg.body.numel()
            if msg.ready is not None and not msg.ready.query():
                await loop.run_in_executor(None, msg.ready.synchronize)
            if msg.handle.cancelled or msg.fut.done():
                self.pool.release(msg.body)
                msg.fut.cancel()
                continue
            await slots.acquire()
            if peer.error is not None:
                self.pool.release(msg.body, reuse=False)
                msg.fut.set_exception(peer.error)
                return
            if self.staging == "host":
                msg.hdr = dataclasses.replace(msg.hdr, checksum=body_checksum(msg.body))
            sends = [loop.create_task(peer.conn.send(msg.hdr.pack())),
                     loop.create_task(peer.conn.send(msg.body))]
            loop.create_task(self._complete(peer, sends, msg, slots))

    async def _complete(self, peer: _Peer, sends, msg: _Message, slots: asyncio.Semaphore) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*sends), self.send_timeout_s)
        except asyncio.TimeoutError:
            e = TransportError(f"KV send to {peer.endpoint} not done after {self.send_timeout_s}s")
            if not msg.fut.done():
                msg.fut.set_exception(e)
            self.pool.release(msg.body, reuse=False)
            await self._drop(peer, e)
            return
        except Exception as e:
            if not msg.fut.done():
                msg.fut.set_exception(TransportError(f"KV send to {peer.endpoint} failed: {e}"))
            self.pool.release(msg.body, reuse=False)   # the other send may still hold it
            await self._drop(peer, TransportError(f"KV endpoint {peer.endpoint} is gone: {e}"))
            return
        finally:
            slots.release()
        self.pool.release(msg.body)
        if not msg.fut.done():
            msg.fut.set_result(None)
        n = msg.hdr.num_blocks
        self.blocks_sent += n
        self.bytes_sent += n * self._block_bytes

    async def _watch(self, peer: _Peer) -> None:
        """The receiver sends nothing after the handshake: any recv result means it closed."""
        try:
            await peer.conn.recv(HEADER_BYTES)
            reason = "unexpected message after the handshake"
        except asyncio.CancelledError:
            return
        except Exception as e:
            reason = f"connection lost ({e})"
        await self._drop(peer, TransportError(f"KV endpoint {peer.endpoint}: {reason}"))

    async def _drop(self, peer: _Peer, error: Exception) -> None:
        if peer.error is None:
            peer.error = error
            if peer.queue.qsize():
                log.warning("%s; failing %d queued KV messages", error, peer.queue.qsize())
        if self._peers.get(peer.endpoint) is peer:
            del self._peers[peer.endpoint]
        while not peer.queue.empty():
            msg = peer.queue.get_nowait()
            peer.queued_bytes -= msg.body.numel()
            self.pool.release(msg.body, reuse=False)
            if not msg.fut.done():
                msg.fut.set_exception(error)
        current = asyncio.current_task()
        for t in peer.tasks:
            if t is not current:
                t.cancel()
        await peer.conn.close()
