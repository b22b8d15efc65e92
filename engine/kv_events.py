"""KV events: the ordered record of which prefix-cache blocks a worker holds, in which tier.

A worker's engine appends to one `KvEventLog`; the worker streams it to the gateway (the
`KvEvents` RPC), whose global index (gateway/prefix_index.py) replays it. Torch-free.

    tiers     DEVICE (the engine's KV pool), HOST (host-memory offload), DISK (local disk)
    event     KvEvent(seq, kind, tier, hashes): kind "stored" (these block hashes are now held
              in `tier`), "removed" (no longer held there) or "cleared" (nothing is held in
              `tier`, hashes empty); a block may be held in several tiers at once
    seq       1, 2, 3, ... per log with no gaps: a reader that sees seq jump knows it missed
              events and asks for a snapshot
    epoch     random bytes fixed for the log's life: a restarted worker has a new one, so a
              reader never replays a new log's seq numbers onto an old log's state
    since(s)  the events after seq s, or None when they are no longer all kept (the log keeps
              the last `capacity` events): the reader then takes snapshot()
    snapshot  (seq, {tier: [hashes]}): the state after event seq, kept current incrementally
    listeners fn() called after each append, on the appending thread (the engine's, or for
              HOST/DISK the offload tiers' copier and disk threads, engine/kv_offload.py): a
              worker uses it to wake its event loop (loop.call_soon_threadsafe); it must not
              block or raise

Thread-safe: the engine thread appends while the worker's event loop reads.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)
KINDS = ("stored", "removed", "cleared")


@dataclass(frozen=True)
class KvEvent:
    seq: int
    kind: str
    tier: str
    hashes: tuple[bytes, ...] = ()


class KvEventLog:
    def __init__(self, capacity: int = 4096, epoch: bytes | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.epoch = epoch if epoch is not None else os.urandom(8)
        self._lock = threading.Lock()
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._state: dict[str, set[bytes]] = {t: set() for t in TIERS}
        self._seq = 0
        self._listeners: list[Callable[[], None]] = []

    @property
    def seq(self) -> int:
        return self._seq

    def stored(self, hashes: Iterable[bytes], tier: str = DEVICE) -> None:
        self._append("stored", tier, tuple(hashes))

    def removed(self, hashes: Iterable[bytes], tier: str = DEVICE) -> None:
        self._append("removed", tier, tuple(hashes))

    def cleared(self, tier: str = DEVICE) -> None:
        self._append("cleared", tier, ())

    def _append(self, kind: str, tier: str, hashes: tuple[bytes, ...]) -> None:
        if tier not in self._state:
            raise ValueError(f"unknown tier {tier!r} (one of {TIERS})")
        if not hashes and kind != "cleared":
            return
        with self._lock:
            held = self._state[tier]
            if kind == "stored":
                held.update(hashes)
            elif kind == "removed":
                held.difference_update(hashes)
            else:
                held.clear()
            self._seq += 1
            self._events.append(KvEvent(self._seq, kind, tier, hashes))
            listeners = list(self._listeners)
        for fn in listeners:
            fn()

    def since(self, seq: int) -> list[KvEvent] | None:
        """Events with seq > `seq`, in order; None if some of them are gone (or seq is ahead)."""
        with self._lock:
            if seq > self._seq:
                return None
            if seq == self._seq:
                return []
            first = self._events[0].seq if self._events else self._seq + 1
            if seq + 1 < first:
                return None
            return list(self._events)[seq + 1 - first:]

    def snapshot(self) -> tuple[int, dict[str, list[bytes]]]:
        with self._lock:
            return self._seq, {t: list(h) for t, h in self._state.items()}

    def held(self, tier: str = DEVICE) -> set[bytes]:
        with self._lock:
            return set(self._state[tier])

    def add_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)
