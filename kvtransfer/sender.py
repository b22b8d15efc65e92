"""Prefill side: pushes a request's KV blocks to a decode worker's KVReceiver, layer by layer.

    handle = await sender.open(tid, endpoint, src_block_ids, dst_block_ids)   # on the loop
    # engine step thread, right after layer i's KV was written:
    sender.push_layer_threadsafe(handle, i)          # gather copy here, send on the loop
    ...
    stats = await sender.finish(handle, timeout=5)   # every message sent (or an error)

Connections are cached per endpoint; the HELLO handshake (protocol version + CompatKey +
the token of the first transfer, see receiver.py)
happens once per connection. Each pushed layer is ONE message: all its blocks' K and V are
gathered into a single contiguous buffer (small per-block messages are slow over UCX).
One writer task per connection sends queued messages in push order, so messages of
concurrent transfers never interleave. A connection that fails fails every transfer queued
on it and is dropped from the cache; the next `open` reconnects.

The decode side acknowledges nothing per transfer: it learns completion from the data
itself, and reports problems through its own gRPC stream.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from dataclasses import dataclass, field

import torch

from .transport import Connection, ConnectionClosed, Transport, TransportError
from .wire import (HEADER_BYTES, CompatKey, Header, IncompatibleKV, MsgType, WireError,
                   block_bytes, check_cache_shape, ids_bytes)

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
    _pushed_blocks: int = 0
    _bytes: int = 0
    _started: float = field(default_factory=time.monotonic)
    cancelled: bool = False

    def set_source(self, src_block_ids: list[int]) -> None:
        """Re-point the transfer at other source blocks (same count, same order). The
        prefill worker opens a transfer before its request is scheduled, so it learns the
        request's real blocks only in the engine step; call this before the first push."""
        if len(src_block_ids) != len(self.dst_block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks for "
                             f"{len(self.dst_block_ids)} destination blocks")
        if self._futures:
            raise RuntimeError("set_source() after a layer was pushed")
        self.src_block_ids = list(src_block_ids)
        self._src_index = torch.tensor(src_block_ids, dtype=torch.long, device=self._src_index.device)


class _Peer:
    def __init__(self, endpoint: str, conn: Connection):
        self.endpoint = endpoint
        self.conn = conn
        self.queue: asyncio.Queue = asyncio.Queue()
        self.error: Exception | None = None
        self.tasks: list[asyncio.Task] = []


class KVSender:
    def __init__(self, kv_cache: torch.Tensor, compat: CompatKey, transport: Transport, *,
                 connect_timeout_s: float = 5.0, max_inflight: int = 4):
        check_cache_shape(kv_cache)
        CompatKey.from_cache(kv_cache, compat.model).check(compat, "kv_cache", "compat")
        self.kv_cache = kv_cache
        self.compat = compat
        self.transport = transport
        self.connect_timeout_s = connect_timeout_s
        self.max_inflight = max_inflight      # layer messages posted but not yet completed
        self._block_bytes = block_bytes(kv_cache)
        self._pin = kv_cache.is_cuda
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
        hdr, body = self._gather(handle, layer, start, end)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        handle._futures.append(fut)
        self._loop.call_soon_threadsafe(self._enqueue, handle, hdr, body, fut)
        return fut

    async def push_layer(self, handle: TransferHandle, layer: int, start: int = 0,
                         end: int | None = None) -> None:
        """Like push_layer_threadsafe, from the loop; returns once the message was sent."""
        hdr, body = self._gather(handle, layer, start, end)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        handle._futures.append(fut)
        self._enqueue(handle, hdr, body, fut)
        await asyncio.wrap_future(fut)

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
    def _gather(self, h: TransferHandle, layer: int, start: int, end: int | None):
        end = len(h.dst_block_ids) if end is None else end
        n = end - start
        if not 0 <= layer < self.compat.num_layers or not 0 <= start < end <= len(h.dst_block_ids):
            raise ValueError(f"bad push: layer {layer}, blocks [{start}, {end}) of {len(h.dst_block_ids)}")
        _, _, _, bs, heads, dim = self.kv_cache.shape
        off = ids_bytes(n)
        body = torch.empty(off + n * self._block_bytes, dtype=torch.uint8, pin_memory=self._pin)
        body[:off].zero_()
        body[:4 * n].view(torch.int32).copy_(torch.tensor(h.dst_block_ids[start:end], dtype=torch.int32))
        payload = body[off:].view(self.kv_cache.dtype).view(2, n, bs, heads, dim)
        src = self.kv_cache[layer]                       # [2, num_blocks, bs, heads, dim]
        if src.is_cuda:   # gather on the device, then one device -> host copy
            payload.copy_(src.index_select(1, h._src_index[start:end]))
        else:             # gather straight into the message buffer
            torch.index_select(src, 1, h._src_index[start:end], out=payload)
        hdr = Header(MsgType.LAYER, h.transfer_id, layer, start, n, body.numel()).pack()
        h._pushed_blocks += n
        h._bytes += n * self._block_bytes
        return hdr, body

    def _enqueue(self, h: TransferHandle, hdr: bytes, body: torch.Tensor, fut) -> None:
        peer = h._peer
        if peer.error is not None:
            fut.set_exception(peer.error)
        else:
            peer.queue.put_nowait((h, hdr, body, fut))

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
        hello = self.compat.hello(token)
        await conn.send(Header(MsgType.HELLO, body_bytes=len(hello)).pack())
        await conn.send(hello)
        hdr = Header.unpack(await conn.recv(HEADER_BYTES))
        body = await conn.recv(hdr.body_bytes) if hdr.body_bytes else b""
        if hdr.msg_type is MsgType.REJECT:
            info = json.loads(bytes(body))
            raise IncompatibleKV(f"decode KV endpoint {endpoint} rejected this prefill worker: {info['error']}")
        if hdr.msg_type is not MsgType.HELLO_ACK:
            raise WireError(f"expected HELLO_ACK from {endpoint}, got {hdr.msg_type.name}")
        self.compat.check(CompatKey.from_json(body), "prefill", "decode")

    async def _write_loop(self, peer: _Peer) -> None:
        """Post each message's two sends in queue order (UCX keeps per-endpoint order) with
        up to `max_inflight` messages in flight, so per-message round trips overlap."""
        slots = asyncio.Semaphore(self.max_inflight)
        while True:
            h, hdr, body, fut = await peer.queue.get()
            if h.cancelled or fut.done():
                fut.cancel()
                continue
            await slots.acquire()
            if peer.error is not None:
                fut.set_exception(peer.error)
                return
            loop = asyncio.get_running_loop()
            sends = [loop.create_task(peer.conn.send(hdr)), loop.create_task(peer.conn.send(body))]
            loop.create_task(self._complete(peer, sends, hdr, fut, slots))

    async def _complete(self, peer: _Peer, sends, hdr: bytes, fut, slots: asyncio.Semaphore) -> None:
        try:
            await asyncio.gather(*sends)
        except Exception as e:
            if not fut.done():
                fut.set_exception(TransportError(f"KV send to {peer.endpoint} failed: {e}"))
            await self._drop(peer, TransportError(f"KV endpoint {peer.endpoint} is gone: {e}"))
            return
        finally:
            slots.release()
        if not fut.done():
            fut.set_result(None)
        n = Header.unpack(hdr).num_blocks
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
            _, _, _, fut = peer.queue.get_nowait()
            if not fut.done():
                fut.set_exception(error)
        current = asyncio.current_task()
        for t in peer.tasks:
            if t is not current:
                t.cancel()
        await peer.conn.close()
