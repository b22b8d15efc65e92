"""The gateway's KV event subscribers: one task per discovered worker of each pool, each
following that worker's KvEvents stream (services/kv_events_rpc.py) into the model's one
`PrefixIndex` (`Router.index`, gateway/prefix_index.py), keyed by the worker's address.

    discovery adds a worker    -> start its subscriber (on_change, after the pool's own)
    subscriber:  KvEvents(the index's (epoch, seq) for it, or none: a snapshot first)
        snapshot parts  -> index.reset(worker, epoch, seq, state)  (a new epoch: a restart)
        event batch     -> index.apply(worker, epoch, events); False (a gap, another epoch):
                           the index dropped the worker -> resubscribe with no epoch
        heartbeat       -> nothing (each read has a deadline: read_timeout_s)
        stream error, EOF or a read past its deadline -> reconnect after a backoff (doubling
                           from backoff_s up to max_backoff_s, reset by any message); the
                           index keeps the worker's state meanwhile and resumes from its seq
    discovery removes a worker -> cancel its subscriber, index.drop(worker)
    stop()                     -> cancel and await every subscriber (none outlives the gateway)

The workers' channels are their registry `Worker`s' (mTLS, the internal credential).
Metrics (the gateway's registry): pdserve:kv_events_total{pool} (events applied),
pdserve:kv_index_resyncs_total{pool} (a worker's state rebuilt from a snapshot after a gap
or a restart), pdserve:kv_index_blocks{pool,tier} (blocks the index holds, at each scrape).

Test hook: `drop_batches = n` discards the next n event batches received, as if lost.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import grpc
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from engine.kv_events import TIERS
from protos.pdserve.v1 import common_pb2
from services.kv_events_rpc import HEARTBEAT_S, SnapshotParts, events_from_proto
from services.metrics import PREFIX, Metrics

from .prefix_index import PrefixIndex
from .registry import WorkerPool

log = logging.getLogger(__name__)

BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
READ_TIMEOUT_S = 5 * HEARTBEAT_S     # a stream silent this long (no heartbeat) is dead


class _Resubscribe(Exception):
    """The index dropped the worker's state (gap or new epoch): ask for a snapshot."""


class KvEventsClient:
    def __init__(self, index: PrefixIndex, pools: Sequence[WorkerPool], metrics: Metrics,
                 backoff_s: float = BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S,
                 read_timeout_s: float = READ_TIMEOUT_S):
        self.index, self.pools = index, list(pools)
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.read_timeout_s = read_timeout_s
        self._tasks: dict[str, asyncio.Task] = {}
        self._stopped = False
        self.drop_batches = 0                      # test hook (module docstring)
        reg = metrics.registry
        self._events = Counter(PREFIX + "kv_events", "KV events the gateway's prefix index "
                               "applied", ("role", "pool"), registry=reg)
        self._resyncs = Counter(PREFIX + "kv_index_resyncs", "Workers' prefix-index states "
                                "rebuilt from a snapshot after a lost event or a restart",
                                ("role", "pool"), registry=reg)
        reg.register(_IndexBlocks(self))

    # ----------------------------------------------------------------- lifecycle
    def watch(self, pool: WorkerPool):
        """The on_change callback of `pool`'s WorkerSet (register it after the pool's own)."""
        def on_change(added: list[str], removed: list[str]) -> None:
            for a in removed:
                self._unfollow(a)
            for a in added:
                self._follow(pool, a)
        return on_change

    async def stop(self) -> None:
        self._stopped = True
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    @property
    def following(self) -> list[str]:
        return [a for a, t in self._tasks.items() if not t.done()]

    def _follow(self, pool: WorkerPool, address: str) -> None:
        task = self._tasks.get(address)
        if self._stopped or (task is not None and not task.done()):
            return
        self._tasks[address] = asyncio.create_task(self._run(pool, address),
                                                   name=f"kv-events-{pool.kind}-{address}")

    def _unfollow(self, address: str) -> None:
        task = self._tasks.pop(address, None)
        if task is not None:
            task.cancel()
        self.index.drop(address)

    # ----------------------------------------------------------------- one worker
    async def _run(self, pool: WorkerPool, address: str) -> None:
        """Follow `address` until cancelled (removed, or the gateway stops)."""
        delay = self.backoff_s
        while True:
            w = pool.workers.get(address)
            if w is None:                   # removed meanwhile: _unfollow cancels us
                return
            try:
                if await self._stream(pool, address, w.stub):
                    delay = self.backoff_s  # it answered: the next failure starts afresh
            except _Resubscribe:
                delay = self.backoff_s
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, ValueError) as e:
                why = (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError)
                       else f"{type(e).__name__}: {e}")
                log.info("KV events of %s worker %s: %s; retrying in %.1fs", pool.kind, address,
                         why, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    async def _stream(self, pool: WorkerPool, address: str, stub) -> bool:
        """One KvEvents call, until it ends (False: it ended before any message)."""
        pos = self.index.position(address)
        req = common_pb2.KvEventsRequest(epoch=pos[0], since_seq=pos[1]) if pos else \
            common_pb2.KvEventsRequest()
        call = stub.KvEvents(req)
        parts, got = SnapshotParts(), False
        try:
            while True:
                msg = await asyncio.wait_for(call.read(), self.read_timeout_s)
                if msg is grpc.aio.EOF:
                    return got
                got = True
                self._take(pool.kind, address, msg, parts)
        finally:
            call.cancel()

    def _take(self, kind: str, address: str, msg, parts: SnapshotParts) -> None:
        if msg.snapshot:
            state = parts.add(msg)
            if state is not None:
                if self.index.position(address) is not None:   # the worker could not go on
                    self._resyncs.labels("gateway", kind).inc()   # from it: a restart or a gap
                self.index.reset(address, msg.epoch, msg.seq, state)
            return
        if not msg.events:
            return                           # a heartbeat
        if self.drop_batches > 0:
            self.drop_batches -= 1
            return
        events = events_from_proto(msg.events)
        pos = self.index.position(address)
        if not self.index.apply(address, msg.epoch, events):
            self._resyncs.labels("gateway", kind).inc()
            log.warning("KV events of %s worker %s: %s; resubscribing for a snapshot", kind,
                        address, "an event was lost" if pos and pos[0] == msg.epoch
                        else "another epoch")
            raise _Resubscribe
        self._events.labels("gateway", kind).inc(len(events))


class _IndexBlocks:
    """A collector: pdserve:kv_index_blocks{pool, tier}, the blocks the index holds for each
    pool's workers."""

    def __init__(self, client: KvEventsClient):
        self.client = client

    def collect(self):
        fam = GaugeMetricFamily(PREFIX + "kv_index_blocks", "Blocks the gateway's prefix index "
                                "holds, by pool and tier", labels=("role", "pool", "tier"))
        for pool in self.client.pools:
            counts = dict.fromkeys(TIERS, 0)
            for address in list(pool.workers):
                for tier, hashes in self.client.index.contents(address).items():
                    counts[tier] += len(hashes)
            for tier, n in counts.items():
                fam.add_metric(("gateway", pool.kind, tier), n)
        yield fam
