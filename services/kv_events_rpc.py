"""The KvEvents RPC: a worker's KV event log (engine/kv_events.py) streamed to the gateway.

Both workers serve it the same way (`KvEventsRpc`, a mixin of their servicers; one
`KvEventStreams` per worker, made by services/worker_server.serve); the gateway's subscriber
(gateway/kv_events_client.py) reads it with `events_from_proto` / `SnapshotParts`. Torch-free:
the gateway imports this module.

One stream (protos/pdserve/v1/common.proto, KvEventBatch):

    KvEvents(epoch, since_seq)
      epoch is this log's and since(since_seq) has them  -> start after since_seq
      else (no epoch, a restarted worker's, or too old)  -> snapshot first: the state after
           seq S, split into parts of at most `max_hashes` hashes (snapshot_continues), then
           events from S + 1
    loop:  events after the last seq sent -> batches of at most `max_events` events and
           `max_hashes` hashes (an event is never split); the reader fell behind the log's
           capacity -> a snapshot again; nothing new -> wait for the log's listener, up to
           `heartbeat_s`, then send an empty batch (seq = the last sent): the reader's reads
           have a deadline, so a silent stream is a dead one
    drain (SIGTERM) or shutdown: every stream ends (OK); a new one is UNAVAILABLE

Threading: the log is appended on the engine thread; its listener (`_Wake`) must not block:
it only schedules one wake-up on the loop (loop.call_soon_threadsafe), and schedules no more
until that one ran, however many events the step appends. After a wake-up the stream sleeps
`coalesce_s` so one step's events go as one batch.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Iterable, Sequence

import grpc

from engine.kv_events import DEVICE, DISK, HOST, KvEvent, KvEventLog
from protos.pdserve.v1 import common_pb2

log = logging.getLogger(__name__)

TIER_TO_PROTO = {DEVICE: common_pb2.KV_TIER_DEVICE, HOST: common_pb2.KV_TIER_HOST,
                 DISK: common_pb2.KV_TIER_DISK}
TIER_FROM_PROTO = {v: k for k, v in TIER_TO_PROTO.items()}
KIND_TO_PROTO = {"stored": common_pb2.KV_EVENT_STORED, "removed": common_pb2.KV_EVENT_REMOVED,
                 "cleared": common_pb2.KV_EVENT_CLEARED}
KIND_FROM_PROTO = {v: k for k, v in KIND_TO_PROTO.items()}

MAX_EVENTS = 256               # events in one batch
MAX_HASHES = 16384             # hashes in one message (16 bytes each: 256 KiB)
HEARTBEAT_S = 2.0              # an idle stream sends an empty batch this often
COALESCE_S = 0.005             # after a wake-up, wait this long for the rest of the step's events


# ----------------------------------------------------------------------------- conversions
def events_to_proto(events: Sequence[KvEvent]) -> list[common_pb2.KvEventMsg]:
    return [common_pb2.KvEventMsg(seq=e.seq, kind=KIND_TO_PROTO[e.kind], tier=TIER_TO_PROTO[e.tier],
                                  hashes=e.hashes) for e in events]


def _tier(value: int) -> str:
    tier = TIER_FROM_PROTO.get(value)
    if tier is None:
        raise ValueError(f"unknown KV tier {value}")
    return tier


def events_from_proto(msgs: Iterable[common_pb2.KvEventMsg]) -> list[KvEvent]:
    """ValueError for an unknown kind or tier (a newer worker's): the reader resubscribes."""
    out = []
    for m in msgs:
        kind = KIND_FROM_PROTO.get(m.kind)
        if kind is None:
            raise ValueError(f"unknown KV event kind {m.kind}")
        out.append(KvEvent(m.seq, kind, _tier(m.tier), tuple(m.hashes)))
    return out


def batches(epoch: bytes, events: Sequence[KvEvent], max_events: int = MAX_EVENTS,
            max_hashes: int = MAX_HASHES) -> list[common_pb2.KvEventBatch]:
    """`events` as KvEventBatch messages within the bounds (at least one event each)."""
    out, cur, hashes = [], [], 0
    for e in events:
        if cur and (len(cur) >= max_events or hashes + len(e.hashes) > max_hashes):
            out.append(cur)
            cur, hashes = [], 0
        cur.append(e)
        hashes += len(e.hashes)
    if cur:
        out.append(cur)
    return [common_pb2.KvEventBatch(epoch=epoch, seq=b[-1].seq, events=events_to_proto(b)) for b in out]


def snapshot_messages(epoch: bytes, seq: int, state: dict[str, list[bytes]],
                      max_hashes: int = MAX_HASHES) -> list[common_pb2.KvEventBatch]:
    """The state after `seq` as snapshot parts of at most `max_hashes` hashes (one, possibly
    empty, at least); every part but the last has snapshot_continues."""
    parts: list[list[common_pb2.TierHashes]] = [[]]
    room = max_hashes
    for tier, hashes in state.items():
        hashes = list(hashes)
        while hashes:
            if room == 0:
                parts.append([])
                room = max_hashes
            take, hashes = hashes[:room], hashes[room:]
            parts[-1].append(common_pb2.TierHashes(tier=TIER_TO_PROTO[tier], hashes=take))
            room -= len(take)
    return [common_pb2.KvEventBatch(epoch=epoch, snapshot=True, seq=seq, snapshot_tiers=p,
                                    snapshot_continues=i < len(parts) - 1)
            for i, p in enumerate(parts)]


class SnapshotParts:
    """A reader's assembly of one snapshot: add(part) until it returns the whole state
    {tier: [hashes]}; ValueError when a part belongs to another snapshot."""

    def __init__(self):
        self.key: tuple[bytes, int] | None = None
        self.state: dict[str, list[bytes]] = {}

    def add(self, msg: common_pb2.KvEventBatch) -> dict[str, list[bytes]] | None:
        if self.key is not None and self.key != (msg.epoch, msg.seq):
            raise ValueError("a snapshot part of another snapshot arrived")
        self.key = (msg.epoch, msg.seq)
        for t in msg.snapshot_tiers:
            self.state.setdefault(_tier(t.tier), []).extend(t.hashes)
        if msg.snapshot_continues:
            return None
        state, self.key, self.state = self.state, None, {}
        return state


# ----------------------------------------------------------------------------- worker side
class _Wake:
    """The log's listener for one stream: called on the appending (engine) thread, it
    schedules at most one `event.set()` on the loop at a time, and never blocks or raises."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.event, self.pending = loop, asyncio.Event(), False

    def __call__(self) -> None:
        if self.pending:
            return
        self.pending = True
        try:
            self.loop.call_soon_threadsafe(self._set)
        except RuntimeError:          # the loop is closed: nobody listens any more
            pass

    def _set(self) -> None:
        self.pending = False          # before set: an append after this schedules a new one
        self.event.set()


class KvEventStreams:
    """Serves KvEvents from one worker's log; `close()` (drain, shutdown) ends every stream."""

    def __init__(self, events: KvEventLog, max_events: int = MAX_EVENTS,
                 max_hashes: int = MAX_HASHES, heartbeat_s: float = HEARTBEAT_S,
                 coalesce_s: float = COALESCE_S):
        self.log = events
        self.max_events, self.max_hashes = max_events, max_hashes
        self.heartbeat_s, self.coalesce_s = heartbeat_s, coalesce_s
        self.closed = False
        self._wakes: set[_Wake] = set()
        self.snapshots_sent = 0       # snapshots started (tests, logs)

    @property
    def open_streams(self) -> int:
        return len(self._wakes)

    def close(self, _deadline: float | None = None) -> None:
        """End every stream (an on_drain hook: the argument is the drain's deadline)."""
        self.closed = True
        for w in self._wakes:
            w.event.set()

    async def serve(self, request, context) -> AsyncIterator[common_pb2.KvEventBatch]:
        if self.closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker draining: KvEvents closed")
        wake = _Wake(asyncio.get_running_loop())
        self._wakes.add(wake)
        self.log.add_listener(wake)
        try:
            seq = None
            if request.epoch == self.log.epoch and self.log.since(request.since_seq) is not None:
                seq = request.since_seq
            while not self.closed:
                events = None if seq is None else self.log.since(seq)
                if events is None:                     # first, or fell behind the log
                    seq, state = self.log.snapshot()
                    self.snapshots_sent += 1
                    for msg in snapshot_messages(self.log.epoch, seq, state, self.max_hashes):
                        yield msg
                elif events:
                    for msg in batches(self.log.epoch, events, self.max_events, self.max_hashes):
                        yield msg
                    seq = events[-1].seq
                elif await self._idle(wake):
                    yield common_pb2.KvEventBatch(epoch=self.log.epoch, seq=seq)
        finally:
            self.log.remove_listener(wake)
            self._wakes.discard(wake)

    async def _idle(self, wake: _Wake) -> bool:
        """Wait for the log to move (then True after coalesce_s: False) or heartbeat_s (True:
        send a heartbeat)."""
        try:
            await asyncio.wait_for(wake.event.wait(), self.heartbeat_s)
        except asyncio.TimeoutError:
            return True
        wake.event.clear()
        if not self.closed and self.coalesce_s > 0:
            await asyncio.sleep(self.coalesce_s)
        return False


class KvEventsRpc:
    """The KvEvents method of both workers' servicers: they set `self.kv_events` (their
    WorkerParts.kv_events)."""
    kv_events: KvEventStreams

    async def KvEvents(self, request, context):
        async for batch in self.kv_events.serve(request, context):
            yield batch
