"""The KV block pool: reference counts, prefix-cache hashes, LRU eviction.

Invariants (checked by `check()` in tests):
  1. Every block is either free (ref_cnt == 0, in `free_queue`) or in use (ref_cnt > 0, not in
     it); never both.
  2. `cached[h] is b` iff `b.block_hash == h`: at most one block per hash, and a hashed block
     keeps its hash (and its KV data) while free, so a later request can revive it.
  3. Eviction order: `allocate` takes blocks from the head of `free_queue`. A freed block goes
     to the tail, so the least recently freed block is reused first (LRU). Callers free a
     request's blocks tail first, so a shared prefix outlives the suffixes that follow it.
     Reusing a hashed block evicts it: its hash is dropped from `cached`.
  4. A block is hashed only after its KV data is fully written (by compute or by a finished
     transfer), so a prefix hit never reads a half-filled block.
Initial free order is block 0, 1, ..., num_blocks - 1.

With an `events` log (engine/kv_events.py), every hash registered is reported "stored" and
every hash evicted "removed", in the device tier, in the order they happen: the log's device
set always equals `cached`'s keys. `before_reuse(blocks)` (engine/kv_offload.py's), when set,
is told the evicted blocks before `allocate` hands them out, while their KV is still intact.
"""
from __future__ import annotations

from collections import OrderedDict

from .kv_events import DEVICE, KvEventLog


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self):
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, events: KvEventLog | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.events = events
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.before_reuse = None            # fn(evicted blocks), see the module docstring

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free queue (evicting their cached hashes)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out, evicted = [], []
        for _ in range(n):
            _, b = self.free_queue.popitem(last=False)
            if b.block_hash is not None:
                del self.cached[b.block_hash]
                evicted.append(b)
            b.ref_cnt = 1
            out.append(b)
        if evicted:
            if self.events is not None:
                self.events.removed([b.block_hash for b in evicted], DEVICE)
            if self.before_reuse is not None:
                self.before_reuse(evicted)
            for b in evicted:
                b.block_hash = None
        return out

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (prefix hit), reviving free ones."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1

    def free(self, blocks) -> None:
        """Drop one reference from each block, in the given order (pass tail first)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Register a full block under its hash; a hash already held by another block wins."""
        self.cache_all([block], [block_hash])

    def cache_all(self, blocks, hashes) -> list[Block]:
        """cache() for each (block, hash) pair, reported as one event; the blocks newly
        registered."""
        new = []
        for block, block_hash in zip(blocks, hashes):
            if block.block_hash is not None or block_hash in self.cached:
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            new.append(block)
        if new and self.events is not None:
            self.events.stored([b.block_hash for b in new], DEVICE)
        return new

    def check(self) -> None:
        """Assert the invariants above (for tests)."""
        for b in self.blocks:
            assert (b.ref_cnt == 0) == (b.block_id in self.free_queue), b
            assert b.ref_cnt >= 0, b
            if b.block_hash is not None:
                assert self.cached[b.block_hash] is b, b
        assert all(b.block_hash == h for h, b in self.cached.items())
        if self.events is not None:
            assert self.events.held(DEVICE) == set(self.cached), "event log != cached hashes"
