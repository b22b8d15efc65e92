"""The gateway's pure routing choice: prefix affinity against load, with no gRPC in sight,
so the simulator (sim/) runs the very rule the gateway runs (gateway/registry.py's
WorkerPool.pick and gateway/routing.py's Router call these).

    choose(cands, affinity, hashes, slack, slack_ratio)
        cands: workers with .address, .in_flight, .load_key(), .requests_total
        best = min by (load_key(), requests_total)
        the prefix-affine worker (PrefixAffinity.lookup) wins while its in_flight is at
        most best's + slack, or (slack_ratio > 0) at most slack_ratio x best's
    decode_bounds(slack, decode_slack) -> the (slack, slack_ratio) decode picks use
    PrefixAffinity.held(hashes, address) -> blocks of the prompt last sent to that worker
        (gateway/placement.py's estimate of what a decode worker holds of a prompt)
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence


def choose(cands: Sequence, affinity: "PrefixAffinity | None" = None,
           hashes: Sequence[bytes] = (), slack: int = 16, slack_ratio: float = 1.5):
    """The least-loaded of `cands` (None if empty), or the prefix-affine one within the
    slack (load overrides affinity only when both bounds are broken)."""
    if not cands:
        return None
    best = min(cands, key=lambda w: (w.load_key(), w.requests_total))
    if affinity is not None and hashes:
        preferred = affinity.lookup(hashes, {w.address: w for w in cands})
        if preferred is not None and (preferred.in_flight <= best.in_flight + slack or (
                slack_ratio > 0 and preferred.in_flight <= slack_ratio * best.in_flight)):
            return preferred
    return best


def decode_bounds(slack: int, decode_slack: int) -> tuple[int, float]:
    """A decode pick's (slack, slack_ratio): the smaller absolute slack and no ratio (a
    decode worker's load sets every stream's token rate; a prefix there saves only KV
    transfer)."""
    return min(slack, decode_slack), 0.0


class PrefixAffinity:
    """Bounded LRU: hash of a prompt's first k full blocks -> the worker the gateway last sent
    it to (a guess at whose prefix cache holds it; the workers' caches are never queried)."""

    def __init__(self, capacity: int = 100_000, max_blocks: int = 64):
        self.capacity = capacity
        self.max_blocks = max_blocks
        self._map: OrderedDict[bytes, str] = OrderedDict()

    def block_hashes(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        """Chained hashes of the first (at most max_blocks) full blocks. The gateway's own
        keys for this map: not the engine's prefix-cache hashes (engine/kv_cache_manager.py
        hashes the ids' bytes, this their text), and nothing compares the two."""
        out, h = [], b""
        n = min(len(token_ids) // block_size, self.max_blocks)
        for i in range(n):
            block = token_ids[i * block_size:(i + 1) * block_size]
            h = hashlib.blake2b(h + b"|" + ",".join(map(str, block)).encode(),
                                digest_size=16).digest()
            out.append(h)
        return out

    def lookup(self, hashes: Sequence[bytes], workers: dict):
        """The worker holding the longest matching prefix among `workers`."""
        for h in reversed(hashes):
            addr = self._map.get(h)
            if addr is not None and addr in workers:
                self._map.move_to_end(h)
                return workers[addr]
        return None

    def held(self, hashes: Sequence[bytes], address: str) -> int:
        """How many of the prompt's leading blocks were last sent to `address` (the longest
        such prefix; its estimate of that worker's prefix-cache hit, in blocks)."""
        for i in range(len(hashes), 0, -1):
            if self._map.get(hashes[i - 1]) == address:
                return i
        return 0

    def record(self, hashes: Sequence[bytes], address: str) -> None:
        for h in hashes:
            self._map[h] = address
            self._map.move_to_end(h)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)
