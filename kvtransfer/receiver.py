"""Decode side: accepts KV pushed by prefill workers and writes it into reserved blocks.

Lifecycle of one transfer (one request), keyed by a transfer id the decode worker makes:

    reserve(tid, block_ids, idle_s, max_s)
          |
          v
     RESERVED --first LAYER msg--> RECEIVING --every (layer, block) arrived--> DONE
          |                            |
          |  deadline passed (reaper)  |   -> EXPIRED
          |  abort(tid)                |   -> ABORTED
          |  bad block ids / sizes /   |   -> FAILED
          |  checksum; the connection  |
          |  feeding it dropped        |
          +----------------------------+

`wait(tid)` returns at the final state; whoever reserved frees the blocks (the receiver
never owns them). DONE, FAILED, EXPIRED and ABORTED are final.

The deadline follows the work: a reservation lives `idle_s` past its last progress (the
reservation itself, then every LAYER message written into it), never past `max_s` after
the reservation (the hard bound):

    deadline = min(last progress + idle_s, reserved at + max_s)

so a long prompt whose chunks keep arriving stays reserved however long it computes (up to
the bound), and one whose sender stopped (died, stalled, queued too long) expires idle_s
after its last message. A KEEPALIVE message (no data) is progress too: a live prefill worker
sends one while the prompt waits in its queue, so a queued prompt keeps its reservation
(still never past the bound) and a dead or stalled worker's stops. Without `max_s` the bound is `idle_s` (one fixed deadline). After a transfer leaves RESERVED/RECEIVING nothing is ever written into
its blocks again: LAYER data naming an unknown or finished transfer id is read off the
wire and dropped (those blocks may belong to another request by now).

A LAYER message names its destination block ids and their offset in the reservation; they
must equal reserved[offset:offset + n] (the whole list, a suffix, or a chunk of a chunked
prefill); each (layer, block) may arrive once. Its payload is written with one indexed copy
per message: kv_cache[layer].index_copy_(1, ids, payload.view(2, n, bs, h, d)).

A LAYER body whose checksum (header, "host" staging) does not match fails its transfer
unwritten. A connection dropped for a malformed message (bad header, a body of the wrong
length: truncated or cut) or a transport error fails every live transfer it had fed, so
the decode worker learns it at once instead of at the deadline.

Who may send: a connection's HELLO carries a token, the id of a transfer live on this
receiver (the decode worker makes ids unguessable and hands them out only with a
reservation, over its mTLS-protected gRPC), or it is REJECTed. Sizes are checked before any
buffer is sized. How a connection is read (the handshake, LAYER messages into staging
buffers, handed to `on_layer`): inbound.py; the copies into the cache: layer_copy.py.

Threading: the connection readers, the reaper and `wait` run on the event loop `start()`
was awaited on. `reserve`, `abort` and `poll` may be called from any thread; a lock makes
"check state, write blocks" atomic, so once `abort` returns no write to its blocks is in
flight or will start.

A CUDA cache is written on a side stream, never on the loop's thread synchronously:

    loop: recv body into a staging buffer (pinned host, or GPU memory with staging "device")
          -> check it -> queue   side stream: [host -> GPU copy,] index_copy_ into the cache
          -> a task waits for the copy's event in a thread, then gives the buffer back;
             after the transfer's last message it moves the transfer to DONE
so DONE (what the decode worker waits for before admitting the request) means every block
is in the cache; abort() and the reaper synchronize the side stream before they return.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict

import torch

from .inbound import Inbound
from .layer_copy import body_block_ids, scatter
from .reservation import TransferResult, TransferState, _Transfer
from .staging import StagingPool
from .transport import Connection, Transport
from .wire import CompatKey, Header, MsgType, block_bytes, body_checksum, ids_bytes, layer_body_bytes

log = logging.getLogger(__name__)


class KVReceiver:
    """Receives KV blocks into `kv_cache` [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, kv_cache: torch.Tensor, compat: CompatKey, transport: Transport,
                 expiry_s: float = 30.0, *, reap_interval_s: float = 0.05, keep_finished: int = 10_000,
                 staging: str = "host", kv_scales: torch.Tensor | None = None,
                 max_s: float | None = None, clock=time.monotonic):
        """`expiry_s`: the default idle window, `max_s` the default hard bound (None: expiry_s);
        `kv_scales`: the scales of an 8-bit cache, written with their blocks; `clock`: where
        deadlines are read (tests pass a fake one)."""
        CompatKey.from_cache(kv_cache, compat.model, kv_scales, compat.layout).check(compat, "kv_cache", "compat")
        self.kv_cache, self.kv_scales = kv_cache, kv_scales
        self.compat = compat
        self.transport = transport
        self.expiry_s = expiry_s
        self.max_s = max_s
        self.clock = clock
        self.reap_interval_s = reap_interval_s
        self.keep_finished = keep_finished
        self.address: str | None = None
        self._block_bytes = block_bytes(kv_cache, kv_scales)
        self.staging = staging
        self.pool = StagingPool(kv_cache, staging)
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._settling: set[asyncio.Task] = set()
        self.max_body_bytes = layer_body_bytes(kv_cache, kv_cache.shape[2], kv_scales)
        self._lock = threading.Lock()
        self._live: dict[str, _Transfer] = {}
        self._finished: OrderedDict[str, _Transfer] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reaper: asyncio.Task | None = None
        self._readers: set[asyncio.Task] = set()
        # counters (monotonic)
        self.blocks_received = 0
        self.bytes_received = 0
        self.transfers_done = 0
        self.failed = 0
        self.expired = 0
        self.aborted = 0
        self.dropped_messages = 0
        self.rejected_connections = 0
        self.keepalives = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Listen for senders and start the reaper; returns the endpoint address."""
        self._loop = asyncio.get_running_loop()
        self.address = await self.transport.listen(self._serve)
        self._reaper = self._loop.create_task(self._reap_loop())
        return self.address

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        readers = list(self._readers)
        for t in readers:
            t.cancel()
        if readers:
            await asyncio.wait(readers, timeout=2.0)
        if self._settling:            # side-stream writes finishing: bounded by the GPU
            await asyncio.wait(list(self._settling), timeout=2.0)
        await self.transport.close()

    def counters(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("blocks_received", "bytes_received", "transfers_done",
                                              "failed", "expired", "aborted", "dropped_messages",
                                              "rejected_connections", "keepalives")}

    # ------------------------------------------------------------------ worker API
    def reserve(self, transfer_id: str, block_ids: list[int], idle_s: float | None = None,
                max_s: float | None = None) -> None:
        """Expect a transfer into `block_ids` (token order): its first message within `idle_s`
        seconds (default: expiry_s), each next one within `idle_s` of the last, all of it
        within `max_s` (default: the receiver's max_s, else idle_s). Thread-safe."""
        nb = self.kv_cache.shape[2]
        if not block_ids:
            raise ValueError("reserve needs at least one block")
        if any(not 0 <= b < nb for b in block_ids) or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids must be distinct and in [0, {nb}): {block_ids}")
        Header(MsgType.LAYER, transfer_id).pack()  # validates the id's length
        idle = self.expiry_s if idle_s is None else idle_s
        bound = max_s if max_s is not None else self.max_s if self.max_s is not None else idle
        now = self.clock()
        t = _Transfer(transfer_id, list(block_ids), 0.0, now, self.compat.num_layers,
                      idle_s=idle, hard_deadline=now + max(bound, idle))
        t.progressed(now)
        t.remaining = len(block_ids) * t.num_layers
        t.got = [bytearray(len(block_ids)) for _ in range(t.num_layers)]
        with self._lock:
            if transfer_id in self._live or transfer_id in self._finished:
                raise ValueError(f"transfer id {transfer_id!r} was already used")
            self._live[transfer_id] = t

    def abort(self, transfer_id: str, reason: str = "aborted") -> bool:
        """Stop a transfer; returns False if it is unknown or already final. Thread-safe;
        after it returns nothing is (or will be) written into the transfer's blocks."""
        with self._lock:
            t = self._live.get(transfer_id)
            if t is None:
                return False
            self._finish_locked(t, TransferState.ABORTED, reason)
            self.aborted += 1
        self._sync_copies()
        self._signal(t)
        return True

    def poll(self, transfer_id: str) -> TransferResult | None:
        """Current state without waiting (None: unknown id). Thread-safe."""
        with self._lock:
            t = self._live.get(transfer_id) or self._finished.get(transfer_id)
            return None if t is None else t.result(self.clock())

    async def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        """Wait until the transfer is final. Bounded even without `timeout`: the reaper
        expires it at its deadline. Raises KeyError (unknown id), TimeoutError (timeout)."""
        with self._lock:
            t = self._live.get(transfer_id) or self._finished.get(transfer_id)
            if t is None:
                raise KeyError(f"unknown transfer id {transfer_id!r}")
            if t.state.final:
                return t.result(self.clock())
            if t.event is None:
                t.event = asyncio.Event()
            event = t.event
        await asyncio.wait_for(event.wait(), timeout)
        return t.result(self.clock())

    # ------------------------------------------------------------------ internals
    def _finish_locked(self, t: _Transfer, state: TransferState, reason: str = "") -> None:
        t.state, t.reason, t.finished_at = state, reason, self.clock()
        self._live.pop(t.tid, None)
        self._finished[t.tid] = t
        while len(self._finished) > self.keep_finished:
            self._finished.popitem(last=False)

    def _sync_copies(self) -> None:
        """Wait for the side stream's queued cache writes (a transfer just became final)."""
        if self._stream is not None:
            self._stream.synchronize()

    def _signal(self, t: _Transfer) -> None:
        ev, loop = t.event, self._loop
        if ev is None or loop is None:
            return
        try:
            loop.call_soon_threadsafe(ev.set)
        except RuntimeError:  # loop closed
            pass

    def _fail(self, t: _Transfer, reason: str) -> None:
        with self._lock:
            if t.state.final:
                return
            self._finish_locked(t, TransferState.FAILED, reason)
            self.failed += 1
        log.warning("KV transfer %s failed: %s", t.tid, reason)
        self._signal(t)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            self.reap()

    def reap(self, now: float | None = None) -> list[str]:
        """Expire overdue transfers (called periodically); returns their ids."""
        now = self.clock() if now is None else now
        with self._lock:
            overdue = [t for t in self._live.values() if t.deadline <= now]
            for t in overdue:
                self._finish_locked(t, TransferState.EXPIRED, t.expiry_reason())
                self.expired += 1
        if overdue:
            self._sync_copies()
        for t in overdue:
            log.warning("KV transfer %s expired: %s", t.tid, t.reason)
            self._signal(t)
        return [t.tid for t in overdue]

    async def _serve(self, conn: Connection) -> None:
        """One sender's connection (inbound.py), tracked so that close() stops it."""
        task = asyncio.current_task()
        self._readers.add(task)
        try:
            await Inbound(self, conn).run()
        finally:
            self._readers.discard(task)

    def is_reserved(self, token) -> bool:
        """Whether a HELLO's token names a transfer live here (who may connect)."""
        with self._lock:
            return token in self._live

    def settle_later(self, copied, body: torch.Tensor, t: _Transfer | None) -> None:
        """After on_layer queued a side-stream write: settle it in a task (_settle)."""
        task = self._loop.create_task(self._settle(copied, body, t))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def fail_fed(self, fed: set[str], reason: str) -> None:
        """A connection that fed these transfers dropped: each still live fails."""
        for tid in fed:
            with self._lock:
                t = self._live.get(tid)
            if t is not None:
                self._fail(t, reason)

    def keepalive(self, transfer_id: str) -> bool:
        """A KEEPALIVE for `transfer_id`: its sender is alive, its prompt queued. Restarts
        the idle window (never past the hard bound); False when the transfer is not live."""
        with self._lock:
            t = self._live.get(transfer_id)
            if t is None:
                return False
            t.progressed(self.clock())
            self.keepalives += 1
            return True

    def on_layer(self, hdr: Header, body: torch.Tensor):
        """Validate one LAYER message and write it, or drop it. -> (the side stream's event
        after the write, or None when the write is done or nothing was written; the
        transfer if this was its last message and its writes are still in flight)."""
        n, layer, off = hdr.num_blocks, hdr.layer, hdr.block_offset
        copied = done = None
        intact = self.staging != "host" or body_checksum(body) == hdr.checksum
        with self._lock:
            t = self._live.get(hdr.transfer_id)
            if t is None:  # unknown, expired, aborted, failed or done: never write
                self.dropped_messages += 1
                log.info("dropped KV layer %d for %s transfer %s", layer,
                         "finished" if hdr.transfer_id in self._finished else "unknown", hdr.transfer_id)
                return None, None
            problem = self._check_layer(t, hdr)
            if problem is None and not intact:
                problem = f"layer {layer}: the body does not match its checksum (corrupted)"
            if problem is None:
                ids = body_block_ids(body, n, self._stream)
                if ids != t.block_ids[off:off + n]:
                    problem = (f"layer {layer}: block ids {ids} are not the reserved "
                               f"block ids[{off}:{off + n}] = {t.block_ids[off:off + n]}")
            if problem is None:
                copied = self._write_locked(t, layer, off, n, body)
                if t.remaining == 0 and copied is not None:
                    done = t                  # DONE once the side stream wrote it (_settle)
                elif t.remaining == 0:
                    self._finish_locked(t, TransferState.DONE)
                    self.transfers_done += 1
        if problem is not None:
            self.dropped_messages += 1
            self._fail(t, problem)
        elif t.state is TransferState.DONE:
            self._signal(t)
        return copied, done

    async def _settle(self, copied, body: torch.Tensor, t: _Transfer | None) -> None:
        """After a side-stream write: give the staging buffer back; finish `t` if given."""
        if not copied.query():
            await self._loop.run_in_executor(None, copied.synchronize)
        self.pool.release(body)
        if t is None:
            return
        with self._lock:
            if t.state.final:       # aborted or expired meanwhile
                return
            self._finish_locked(t, TransferState.DONE)
            self.transfers_done += 1
        self._signal(t)

    def _check_layer(self, t: _Transfer, hdr: Header) -> str | None:
        n, layer, off = hdr.num_blocks, hdr.layer, hdr.block_offset
        if not 0 <= layer < t.num_layers:
            return f"layer index {layer} out of range [0, {t.num_layers})"
        if n == 0 or off + n > len(t.block_ids):
            return f"layer {layer}: blocks [{off}, {off + n}) outside the {len(t.block_ids)} reserved"
        want = ids_bytes(n) + n * self._block_bytes
        if hdr.body_bytes != want:
            return f"layer {layer}: body of {hdr.body_bytes} bytes, expected {want} for {n} blocks"
        if any(t.got[layer][off:off + n]):
            return f"layer {layer}: blocks [{off}, {off + n}) arrived twice"
        return None

    def _write_locked(self, t: _Transfer, layer: int, off: int, n: int, body: torch.Tensor):
        """Write the body's blocks (layer_copy.scatter) and count them."""
        copied = scatter(self.kv_cache, self.kv_scales, layer, t.block_ids[off:off + n], body,
                         self._stream)
        t.got[layer][off:off + n] = b"\x01" * n
        t.remaining -= n
        t.blocks += n
        t.nbytes += n * self._block_bytes
        t.state = TransferState.RECEIVING
        t.progressed(self.clock())
        self.blocks_received += n
        self.bytes_received += n * self._block_bytes
        return copied

