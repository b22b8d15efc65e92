"""Prefill side: pushes a request's KV blocks to a decode worker's KVReceiver, layer by layer.

    handle = await sender.open(tid, endpoint, src_block_ids, dst_block_ids)   # on the loop
    # engine step thread, right after layer i's KV was written:
    sender.push_layer_threadsafe(handle, i)          # gather copy here, send on the loop
    ...
    stats = await sender.finish(handle, timeout=5)   # every message sent (or an error)
    sender.keepalive(handle)   # on the loop, while the request waits in the queue: the
                               # receiver's idle window restarts (no data, nothing to finish)

Lifecycle of one transfer, its TransferHandle's `state` (SGLang's poll states; the decode
side's, in receiver.py, end in the same DONE | FAILED | ABORTED):

    open(tid, endpoint, src_block_ids, dst_block_ids)
          |
          v
     BOOTSTRAPPING --connected, HELLO_ACK (a cached connection: at once)--> WAITING
          |                                         open returns the handle    |
          |  unreachable, REJECT, timeout:                     first push_layer |
          |  -> FAILED (open raises)                                            v
          |                                                               TRANSFERRING
          |                                                                     |
          |        finish(): every (layer, block) pushed and every message sent -> DONE
          |        finish(), in WAITING or TRANSFERRING: a (layer, block) not
          |        pushed, a message failed (peer gone, queue full, send timeout),
          |        or out of time                                               -> FAILED
          +------- cancel() (abort), from any state not final -------------------> ABORTED

DONE, FAILED and ABORTED are final (`handle.error`: what failed it). A FAILED or ABORTED
transfer's messages still queued are skipped, never sent. Every transition is made by
`TransferHandle._move`, under the handle's lock (the engine thread pushes, the loop opens
and finishes, any thread may cancel).

Connections are cached per endpoint, with the HELLO handshake (protocol version + CompatKey
+ staging + the token of the first transfer, see receiver.py) once per connection, one
writer task each, and their bounds: outbound.py. Each pushed layer is ONE message: all its
blocks' K and V are gathered into a single contiguous buffer (small per-block messages are
slow over UCX).

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

The decode side acknowledges nothing per transfer: it learns completion from the data
itself, and reports problems through its own gRPC stream.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
import time
from dataclasses import dataclass, field

import torch

from .layer_copy import gather
from .outbound import Message, Peer
from .staging import StagingPool
from .transport import ConnectionClosed, Transport, TransportError
from .wire import CompatKey, Header, MsgType, block_bytes, ids_bytes


class KVTransferTimeout(TransportError):
    """finish() ran out of time before every message was sent."""


class SendState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def final(self) -> bool:
        return self in (SendState.DONE, SendState.FAILED, SendState.ABORTED)


# The drawn transitions; anything else from a state that is not final is a bug.
_NEXT = {
    SendState.BOOTSTRAPPING: {SendState.WAITING, SendState.FAILED, SendState.ABORTED},
    SendState.WAITING: {SendState.TRANSFERRING, SendState.FAILED, SendState.ABORTED},
    SendState.TRANSFERRING: {SendState.DONE, SendState.FAILED, SendState.ABORTED},
}


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
    _peer: Peer | None                    # the connection (None while BOOTSTRAPPING)
    _src_index: torch.Tensor
    _futures: list[concurrent.futures.Future] = field(default_factory=list)
    _bound_fixed: int = 0                 # blocks [0, this) were pushed: set_source may not move them
    _pushed_blocks: int = 0
    _bytes: int = 0
    _started: float = field(default_factory=time.monotonic)
    state: SendState = SendState.BOOTSTRAPPING
    error: BaseException | None = None    # what made it FAILED
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def cancelled(self) -> bool:
        """FAILED or ABORTED: its queued messages are skipped."""
        return self.state in (SendState.FAILED, SendState.ABORTED)

    def _move(self, to: SendState, error: BaseException | None = None) -> bool:
        """The one place a transfer changes state. False when it stays as it is (a final
        state, or already `to`); a transition not drawn raises RuntimeError."""
        with self._lock:
            if self.state.final or self.state is to:
                return False
            if to not in _NEXT[self.state]:
                raise RuntimeError(f"transfer {self.transfer_id}: {self.state.name} -> {to.name}")
            self.state, self.error = to, error
            return True

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


class KVSender:
    def __init__(self, kv_cache: torch.Tensor, compat: CompatKey, transport: Transport, *,
                 connect_timeout_s: float = 5.0, max_inflight: int = 4, staging: str = "host",
                 kv_scales: torch.Tensor | None = None, send_timeout_s: float = 10.0,
                 max_queued_bytes: int = 1 << 30):
        """`kv_scales`: the scales of an 8-bit cache; they travel with their blocks."""
        CompatKey.from_cache(kv_cache, compat.model, kv_scales, compat.layout).check(compat, "kv_cache", "compat")
        self.kv_cache, self.kv_scales = kv_cache, kv_scales
        self.compat = compat
        self.transport = transport
        self.connect_timeout_s = connect_timeout_s
        self.max_inflight = max_inflight      # layer messages posted but not yet completed
        self.send_timeout_s = send_timeout_s  # one message's sends; then the peer is dropped
        self.max_queued_bytes = max_queued_bytes   # per connection
        self.block_bytes = block_bytes(kv_cache, kv_scales)   # one block of one layer
        self.staging = staging
        self.pool = StagingPool(kv_cache, staging)
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # counters (monotonic)
        self.transfers_done = 0
        self.blocks_sent = 0
        self.bytes_sent = 0
        self.failures = 0
        self.keepalives_sent = 0

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
        idx = torch.tensor(src_block_ids, dtype=torch.long, device=self.kv_cache.device)
        handle = TransferHandle(transfer_id, endpoint, list(src_block_ids), list(dst_block_ids), None, idx)
        try:
            handle._peer = await self._peer(endpoint, transfer_id)
        except BaseException as e:
            handle._move(SendState.FAILED, e)
            raise
        handle._move(SendState.WAITING)
        return handle

    def push_layer_threadsafe(self, handle: TransferHandle, layer: int, start: int = 0,
                              end: int | None = None) -> concurrent.futures.Future:
        """Gather layer `layer` of blocks [start, end) of the handle (default: all) into one
        message in the calling thread, and queue its send on the sender's loop. Callable
        from any thread. The returned future resolves when the message was sent."""
        msg = self._gather(handle, layer, start, end)
        handle._futures.append(msg.fut)
        self._loop.call_soon_threadsafe(handle._peer.enqueue, msg)
        return msg.fut

    async def push_layer(self, handle: TransferHandle, layer: int, start: int = 0,
                         end: int | None = None) -> None:
        """Like push_layer_threadsafe, from the loop; returns once the message was sent."""
        msg = self._gather(handle, layer, start, end)
        handle._futures.append(msg.fut)
        handle._peer.enqueue(msg)
        await asyncio.wrap_future(msg.fut)

    async def finish(self, handle: TransferHandle, timeout: float) -> TransferStats:
        """Wait until every pushed message was sent. Raises ValueError if not every layer
        of every block was pushed, KVTransferTimeout, or TransportError (peer gone)."""
        total = self.compat.num_layers * len(handle.dst_block_ids)
        if handle._pushed_blocks != total:
            e = ValueError(f"transfer {handle.transfer_id}: {handle._pushed_blocks} of {total} "
                           f"(layer, block) pairs pushed before finish()")
            handle._move(SendState.FAILED, e)
            raise e
        futs = [asyncio.wrap_future(f) for f in handle._futures]
        try:
            await asyncio.wait_for(asyncio.gather(*futs), timeout)
        except asyncio.TimeoutError:
            self.failures += 1
            sent = sum(f.done() and not f.cancelled() and f.exception() is None for f in handle._futures)
            e = KVTransferTimeout(f"KV transfer {handle.transfer_id} to {handle.endpoint} not finished "
                                  f"after {timeout}s ({sent}/{len(futs)} layer messages sent)")
            handle._move(SendState.FAILED, e)
            raise e from None
        except Exception as e:
            handle._move(SendState.FAILED, e)
            self.failures += 1
            raise
        handle._move(SendState.DONE)
        self.transfers_done += 1
        return TransferStats(handle.transfer_id, len(futs), handle._pushed_blocks, handle._bytes,
                             time.monotonic() - handle._started)

    def keepalive(self, handle: TransferHandle) -> bool:
        """Queue a KEEPALIVE for the handle's transfer (on the loop): its request is queued
        here, alive; the receiver restarts the reservation's idle window when it arrives.
        False (nothing sent) once the transfer is final or its connection failed."""
        peer = handle._peer
        if handle.state.final or peer is None or peer.error is not None:
            return False
        hdr = Header(MsgType.KEEPALIVE, handle.transfer_id)
        peer.enqueue(Message(handle, hdr, None, concurrent.futures.Future(), None))
        self.keepalives_sent += 1
        return True

    def cancel(self, handle: TransferHandle) -> None:
        """Abort: ABORTED unless final already; its queued messages are skipped. Thread-safe."""
        handle._move(SendState.ABORTED)

    async def close(self) -> None:
        for peer in list(self._peers.values()):
            await peer.drop(ConnectionClosed("sender closed"))
        await self.transport.close()

    def counters(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("transfers_done", "blocks_sent", "bytes_sent", "failures")}

    # ------------------------------------------------------------------ internals
    def _gather(self, h: TransferHandle, layer: int, start: int, end: int | None) -> Message:
        """Fill a staging buffer with [block ids | K and V of blocks [start, end) of `layer`].
        On CUDA the gather is queued on the side stream after everything the compute stream
        queued so far (this layer's kernels) and this returns at once."""
        end = len(h.dst_block_ids) if end is None else end
        n = end - start
        if not 0 <= layer < self.compat.num_layers or not 0 <= start < end <= len(h.dst_block_ids):
            raise ValueError(f"bad push: layer {layer}, blocks [{start}, {end}) of {len(h.dst_block_ids)}")
        body = self.pool.acquire(ids_bytes(n) + n * self.block_bytes)
        ready = gather(self.kv_cache, self.kv_scales, layer, h._src_index[start:end],
                       h.dst_block_ids[start:end], body, self._stream)
        hdr = Header(MsgType.LAYER, h.transfer_id, layer, start, n, body.numel())
        h._pushed_blocks += n
        h._bytes += n * self.block_bytes
        h._bound_fixed = max(h._bound_fixed, end)
        h._move(SendState.TRANSFERRING)
        return Message(h, hdr, body, concurrent.futures.Future(), ready)

    async def _peer(self, endpoint: str, token: str) -> Peer:
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
            peer = self._peers[endpoint] = await Peer.connect(self, endpoint, token)
            return peer

    def forget(self, peer: Peer) -> None:
        """`peer` failed (Peer.drop): the next transfer to its endpoint connects again."""
        if self._peers.get(peer.endpoint) is peer:
            del self._peers[peer.endpoint]
