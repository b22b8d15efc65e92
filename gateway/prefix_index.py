"""The gateway's global prefix index: block hash -> which workers hold it, in which tiers.

Fed only by the workers' own KV events (engine/kv_events.py, streamed by the KvEvents RPC), so
it says what the workers really hold, not where the gateway sent prompts. Keys are the
engine's chained block hashes (engine/block_hash.py): the gateway hashes a prompt with
`prefix_block_hashes(prompt, block_size)` and asks

    match(hashes, worker) -> TierHits(device, host, disk)
        the worker's hit for the prompt: the leading blocks it holds in some tier, block i
        counted only if blocks 0..i-1 are held too (a chained hash needs its whole prefix),
        each counted once, in its fastest tier (device < host < disk)
    holders(hashes) -> {worker: TierHits}  every worker with a non-empty match

Per worker the state is (epoch, seq, {tier: set of hashes}):
    reset(worker, epoch, seq, snapshot)  replace it with a snapshot ({tier: hashes})
    apply(worker, epoch, events) -> bool  replay events in order; False, with the worker's
        state dropped, when the epoch differs (the worker restarted) or a seq is missing (an
        event was lost): the caller then asks the worker for a snapshot
    drop(worker)                          the worker is gone: forget everything it held
A worker never reset is unknown and holds nothing. Not thread-safe: the gateway's event loop
owns it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from engine.kv_events import DEVICE, DISK, HOST, TIERS, KvEvent


@dataclass(frozen=True)
class TierHits:
    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk


class _WorkerState:
    __slots__ = ("epoch", "seq", "held")

    def __init__(self, epoch: bytes, seq: int):
        self.epoch, self.seq = epoch, seq
        self.held: dict[str, set[bytes]] = {t: set() for t in TIERS}


class PrefixIndex:
    def __init__(self):
        self._workers: dict[str, _WorkerState] = {}
        self._where: dict[bytes, dict[str, set[str]]] = {}     # hash -> worker -> tiers
        self.resyncs = 0           # apply() calls that found a gap or a new epoch

    def workers(self) -> list[str]:
        return list(self._workers)

    def position(self, worker: str) -> tuple[bytes, int] | None:
        """(epoch, seq) the worker's state is at, or None if unknown."""
        st = self._workers.get(worker)
        return None if st is None else (st.epoch, st.seq)

    def reset(self, worker: str, epoch: bytes, seq: int,
              snapshot: dict[str, Iterable[bytes]]) -> None:
        self.drop(worker)
        st = self._workers[worker] = _WorkerState(epoch, seq)
        for tier, hashes in snapshot.items():
            for h in hashes:
                self._add(worker, st, tier, h)

    def apply(self, worker: str, epoch: bytes, events: Sequence[KvEvent]) -> bool:
        st = self._workers.get(worker)
        if st is None or st.epoch != epoch:
            self._resync(worker)
            return False
        for ev in events:
            if ev.seq <= st.seq:
                continue                      # a duplicate after a resubscribe
            if ev.seq != st.seq + 1:
                self._resync(worker)
                return False
            self._apply_one(worker, st, ev)
            st.seq = ev.seq
        return True

    def drop(self, worker: str) -> None:
        st = self._workers.pop(worker, None)
        if st is None:
            return
        for tier, hashes in st.held.items():
            for h in hashes:
                self._unlink(worker, tier, h)

    def match(self, hashes: Sequence[bytes], worker: str) -> TierHits:
        counts = {DEVICE: 0, HOST: 0, DISK: 0}
        for h in hashes:
            tiers = self._where.get(h, {}).get(worker)
            if not tiers:
                break
            counts[next(t for t in TIERS if t in tiers)] += 1
        return TierHits(counts[DEVICE], counts[HOST], counts[DISK])

    def holders(self, hashes: Sequence[bytes]) -> dict[str, TierHits]:
        first = self._where.get(hashes[0], {}) if hashes else {}
        out = {w: self.match(hashes, w) for w in first}
        return {w: m for w, m in out.items() if m.total}

    def contents(self, worker: str) -> dict[str, set[bytes]]:
        """What the index believes `worker` holds, per tier (a copy; for tests and /status)."""
        st = self._workers.get(worker)
        return {t: set(st.held[t]) if st else set() for t in TIERS}

    def _resync(self, worker: str) -> None:
        self.resyncs += 1
        self.drop(worker)

    def _apply_one(self, worker: str, st: _WorkerState, ev: KvEvent) -> None:
        if ev.kind == "stored":
            for h in ev.hashes:
                self._add(worker, st, ev.tier, h)
        elif ev.kind == "removed":
            for h in ev.hashes:
                if h in st.held[ev.tier]:
                    st.held[ev.tier].discard(h)
                    self._unlink(worker, ev.tier, h)
        elif ev.kind == "cleared":
            for h in st.held[ev.tier]:
                self._unlink(worker, ev.tier, h)
            st.held[ev.tier] = set()
        else:
            raise ValueError(f"unknown KV event kind {ev.kind!r}")

    def _add(self, worker: str, st: _WorkerState, tier: str, h: bytes) -> None:
        if tier not in st.held:
            raise ValueError(f"unknown tier {tier!r}")
        st.held[tier].add(h)
        self._where.setdefault(h, {}).setdefault(worker, set()).add(tier)

    def _unlink(self, worker: str, tier: str, h: bytes) -> None:
        per = self._where.get(h)
        if per is None or worker not in per:
            return
        per[worker].discard(tier)
        if not per[worker]:
            del per[worker]
        if not per:
            del self._where[h]
