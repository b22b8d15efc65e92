"""Peer fetch, the fetching side (issue 31): a Prefill whose `peer_prefix` names another
prefill worker A holding more of the prompt's leading blocks than this worker B fetches
them over the KV transport instead of computing them. It is the decode-first protocol
turned around: B is the receiver (its own KVReceiver, on the transport its KVPush sends
with), A the sender (peer_export.py).

    B: Prefill(prompt, peer_prefix{A, n})
    1. plan (engine thread)   n = min(n, (len(prompt) - 1) // block_size) blocks (one token
                              is left to compute: its logits sample the first token); B's
                              own leading hits `first` are kept; blocks [first, n) get
                              fresh device blocks from B's pool (ref 1, unhashed), none
                              when fewer are free than asked -> compute
    2. reserve                receiver.reserve(transfer id, blocks, deadline); the id is
                              signed with the deadline as a decode worker's is
    3. ExportPrefix(A)        A pins its blocks [first, n) and pushes every layer into the
                              reservation (peer_export.py); NOT_FOUND when A evicted them
    4. wait                   the receiver's transfer reaches DONE by the deadline
    5. cache (engine thread)  the blocks are hashed (BlockPool.cache_all) only now that
                              every layer is written (the pool's invariant 4): the prompt
                              then finds them as a prefix hit, like its own
    6. release (in _end)      B's pins drop after the request ended; the blocks stay cached
    Any failure (no blocks, A unreachable or refusing, a REJECT, the deadline, abort):
    receiver.abort(transfer id) (after it returns nothing is written into the blocks), the
    blocks freed unhashed, `pdserve:peer_fetch_total{result="fallback"}` counted and a
    WARNING logged; the request computes the prompt itself. Never a failed request. A
    caller cancelled while an engine-thread step runs gets its blocks (or A's pins) given
    back once that step is done (call_undoable).

Deadline, sized from the work: PEER_FETCH_BASE_S (the RPC, connect + HELLO) + A's wait for
its engine thread (A pins between two of its steps: STEP_WAITS x the slowest engine step
this worker saw lately, `StepPace`, the same model on the same hardware; on a CPU a prefill
step of a few hundred tokens takes seconds, and a fixed 2 s timed out most fetches in
bench/prefix_tiers.py) + the bytes fetched at PEER_FETCH_MIN_BYTES_PER_S, never past the
decode reservation's own deadline less PEER_FETCH_MARGIN_S (the compute must still fit in
it): past that, a fetch saves nothing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from engine.block_hash import prefix_block_hashes
from kvtransfer.receiver import KVReceiver, TransferState
from kvtransfer.wire import block_bytes
from protos.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from services import protoconv
from services.security import MTLS, channel, new_transfer_id

log = logging.getLogger(__name__)
PEER_FETCH_BASE_S = 2.0                 # fixed allowance: the RPC, connect + HELLO, A's pin
PEER_FETCH_MIN_BYTES_PER_S = 100e6      # the slowest transfer still worth waiting for
PEER_FETCH_MARGIN_S = 1.0               # left of the decode reservation for the compute
MAX_CHANNELS = 64                       # peers remembered (their gRPC channels)
STEP_WAITS = 2.0                        # A's engine steps a fetch may wait for its pin
STEP_DECAY = 0.98                       # per step: how fast an old slow step is forgotten


class StepPace:
    """An engine step observer: the slowest recent step, a max that decays by STEP_DECAY a
    step (one float, written by the engine thread, read by the event loop)."""

    def __init__(self):
        self.slowest_s = 0.0

    def on_step(self, duration_s: float, tokens) -> None:
        self.slowest_s = max(duration_s, self.slowest_s * STEP_DECAY)


async def call_undoable(ae, fn, undo, *args):
    """`fn(*args)` on the engine thread; if the caller is cancelled meanwhile, `undo(result)`
    runs there once fn is done (what it took is given back, never leaked)."""
    fut = ae.submit(fn, *args)
    try:
        return await asyncio.shield(asyncio.wrap_future(fut))
    except asyncio.CancelledError:
        fut.add_done_callback(lambda f: f.exception() is None and ae.submit(undo, f.result()))
        raise


@dataclass
class Fetched:
    """Blocks fetched for one request: B holds one reference on each until release()."""
    blocks: list[int]
    tokens: int                         # prompt tokens they hold


class PeerFetch:
    def __init__(self, ae, receiver: KVReceiver, mtls: MTLS | None, token: str, metrics=None):
        self.ae, self.receiver, self.mtls, self.token = ae, receiver, mtls, token
        self.block_size = ae.block_size
        self.metrics = metrics
        self._channels: dict[str, grpc.aio.Channel] = {}
        cache = receiver.kv_cache
        self.bytes_per_block = block_bytes(cache, receiver.kv_scales) * cache.shape[0]
        self.ok = self.fallbacks = self.blocks_fetched = 0
        self.pace = StepPace()
        ae.engine.step_observers.append(self.pace)

    def deadline_s(self, num_blocks: int, left_s: float | None) -> float:
        """How long a fetch of `num_blocks` may take; `left_s`: the decode reservation's time."""
        budget = (PEER_FETCH_BASE_S + STEP_WAITS * self.pace.slowest_s
                  + num_blocks * self.bytes_per_block / PEER_FETCH_MIN_BYTES_PER_S)
        return budget if left_s is None else min(budget, left_s - PEER_FETCH_MARGIN_S)

    async def fetch(self, rid: str, prompt: list[int], peer: prefill_pb2.PeerPrefix,
                    left_s: float | None) -> Fetched | None:
        """Fetch the prompt's leading blocks from `peer`; None: nothing fetched (compute)."""
        bs = self.block_size
        n = min(peer.num_blocks, (len(prompt) - 1) // bs)
        if n <= 0 or not peer.worker_address:
            return None
        hashes = prefix_block_hashes(prompt, bs, n)
        first, blocks = await call_undoable(self.ae, self._plan, lambda r: self._free(r[1]), hashes)
        if first >= n:
            return None                   # B holds them already
        if not blocks:
            return self._fallback(rid, peer, f"no {n - first} free KV blocks to fetch into")
        budget = self.deadline_s(len(blocks), left_s)
        done = False
        try:
            if budget <= 0:
                return self._fallback(rid, peer, "the decode reservation has no time left for it")
            try:
                why = await self._transfer(rid, prompt[:n * bs], first, blocks, peer, budget)
            except Exception as e:        # never a failed request: it computes
                why = f"{type(e).__name__}: {e}"
            if why:
                return self._fallback(rid, peer, why)
            await self.ae.call(self._cache, blocks, hashes[first:])
            done = True
        finally:
            if not done:
                await asyncio.shield(self.ae.call(self._free, blocks))
        self.ok += 1
        self.blocks_fetched += len(blocks)
        if self.metrics is not None:
            self.metrics.peer_fetch.labels(self.metrics.role, "ok").inc()
            self.metrics.peer_fetch_blocks.inc(len(blocks))
        return Fetched(blocks, len(blocks) * bs)

    async def _transfer(self, rid: str, tokens: list[int], first: int, blocks: list[int],
                        peer: prefill_pb2.PeerPrefix, budget: float) -> str:
        """Reserve, ask the peer, wait for DONE: "" when every layer arrived, else why not."""
        rx = self.receiver
        expires_ms = int((time.time() + budget) * 1000)
        tid = new_transfer_id(self.token, expires_ms)
        rx.reserve(tid, blocks, budget, budget)
        end = time.monotonic() + budget
        try:
            req = prefill_pb2.ExportPrefixRequest(
                request_id=rid, token_ids=tokens, first_block=first, kv_endpoint=rx.address,
                transfer_id=tid, dst_block_ids=blocks, compat=protoconv.compat_to_proto(rx.compat),
                expires_at_unix_ms=expires_ms)
            stub = prefill_pb2_grpc.PrefillWorkerStub(self._channel(peer.worker_address))
            try:
                await stub.ExportPrefix(req, timeout=budget)
            except grpc.aio.AioRpcError as e:
                return f"{peer.worker_address} ExportPrefix: {e.code().name} {e.details()}"
            try:
                res = await rx.wait(tid, timeout=max(0.0, end - time.monotonic()) + 0.5)
            except asyncio.TimeoutError:
                return f"the transfer was not done within {budget:.3g}s"
            if res.state is not TransferState.DONE:
                return f"transfer {res.state.value}: {res.reason}"
            return ""
        finally:
            rx.abort(tid, "peer fetch ended")      # no-op once DONE; else nothing more is written

    def _fallback(self, rid: str, peer, why: str) -> None:
        self.fallbacks += 1
        if self.metrics is not None:
            self.metrics.peer_fetch.labels(self.metrics.role, "fallback").inc()
        log.warning("request %s: peer fetch from %s fell back to compute: %s", rid,
                    peer.worker_address, why)
        return None

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            if len(self._channels) >= MAX_CHANNELS:
                old = next(iter(self._channels))
                asyncio.ensure_future(self._channels.pop(old).close())
            ch = self._channels[address] = channel(address, self.mtls, token=self.token)
        return ch

    # ------------------------------------------------------------ engine thread
    def _plan(self, hashes: list[bytes]) -> tuple[int, list[int]]:
        """(B's own leading hits, fresh blocks for the rest; [] when not enough are free)."""
        pool = self.ae.engine.kv.pool
        first = 0
        while first < len(hashes) and pool.lookup(hashes[first]) is not None:
            first += 1
        need = len(hashes) - first
        if need <= 0 or need > pool.num_free_blocks:
            return first, []
        return first, [b.block_id for b in pool.allocate(need)]

    def _cache(self, blocks: list[int], hashes: list[bytes]) -> None:
        pool = self.ae.engine.kv.pool
        pool.cache_all([pool.blocks[b] for b in blocks], hashes)

    def _free(self, blocks: list[int]) -> None:
        pool = self.ae.engine.kv.pool
        pool.free([pool.blocks[b] for b in reversed(blocks)])

    async def release(self, fetched: Fetched | None) -> None:
        """Drop B's pins once the request is done with them (they stay cached)."""
        if fetched is not None:
            await asyncio.shield(self.ae.call(self._free, fetched.blocks))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
