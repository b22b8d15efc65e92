"""Prompt blocks this gateway's open Prefill calls are having computed, per prefill worker.

A worker's KV events announce a block once its KV is written, so for the length of a Prefill
the index (gateway/prefix_index.py) does not know the worker is about to hold the prompt's
blocks: a second prompt with the same new prefix, sent meanwhile, would look cold everywhere
and be computed twice, once per worker. Router.pick_prefill counts a worker's in-flight
blocks as device hits continuing its index match (the worker's scheduler makes the second
request wait for the first one's blocks: engine/scheduler.py's in-batch sharing).

    add(worker, hashes) -> ticket   a Prefill call to `worker` for a prompt with these full
                                    block hashes (engine/block_hash.py) opened
    remove(ticket)                  it answered, failed or was cancelled (exactly once)
    holds(worker, h) / any_holds(h)
Counts, not sets: two calls may share blocks, and the first to end must not erase the other's.
Not thread-safe: the gateway's event loop owns it.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence


class InFlight:
    def __init__(self):
        self._held: dict[str, Counter[bytes]] = {}

    def add(self, worker: str, hashes: Sequence[bytes]) -> tuple[str, tuple[bytes, ...]]:
        hashes = tuple(hashes)
        if hashes:                     # a prompt under one block holds nothing
            self._held.setdefault(worker, Counter()).update(hashes)
        return worker, hashes

    def remove(self, ticket: tuple[str, tuple[bytes, ...]]) -> None:
        worker, hashes = ticket
        if not hashes:
            return
        held = self._held[worker]
        held.subtract(hashes)
        for h in hashes:
            if held[h] <= 0:
                del held[h]
        if not held:
            del self._held[worker]

    def holds(self, worker: str, h: bytes) -> bool:
        return h in self._held.get(worker, ())

    def any_holds(self, h: bytes) -> bool:
        return any(h in held for held in self._held.values())

    def __len__(self) -> int:
        """Distinct blocks in flight (all workers)."""
        return len(set().union(*self._held.values()))
