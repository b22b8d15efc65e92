"""Per-request view of the block pool: prefix lookup, slot allocation, caching, freeing.

Block hashes are chained: hash_i = H(hash_{i-1} || tokens of block i), so equal hashes mean
equal whole prefixes (engine/block_hash.py, shared with the gateway). Only full blocks are
hashed, and only once their KV is written. The pool reports what it holds to `events`
(engine/kv_events.py), the log the worker streams to the gateway.

With offload tiers attached (`attach_offload`, engine/kv_offload.py): every newly cached
block is copied down to them, and a prefix lookup continues the device hit with the blocks
they hold, revived into device blocks (free, cached) before the hit is returned, so to the
scheduler a revived block is a device hit like any other.
"""
from __future__ import annotations

from .block_hash import hash_block_tokens, prefix_block_hashes  # noqa: F401 (re-exported)
from .block_pool import Block, BlockPool
from .kv_events import KvEventLog
from .request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KvEventLog | None = None):
        self.block_size = block_size
        self.events = events if events is not None else KvEventLog()
        self.pool = BlockPool(num_blocks, self.events)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_hashed: dict[str, int] = {}     # blocks of the request registered in the cache
        self.prefix_queries = 0                  # tokens looked up
        self.prefix_hits = 0                     # tokens found
        self.offload = None                      # engine/kv_offload.OffloadManager

    def attach_offload(self, offload) -> None:
        self.offload = offload
        self.pool.before_reuse = offload.before_reuse

    def close(self) -> None:
        """Stop the offload tiers' threads (their queued copies finish first, bounded)."""
        if self.offload is not None:
            self.offload.close()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_hashes(self, req: Request, n_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first `n_blocks` full blocks (kept on it)."""
        bs, hashes = self.block_size, req.block_hashes
        if len(hashes) < n_blocks:
            tokens = req.all_token_ids
            parent = hashes[-1] if hashes else b""
            for i in range(len(hashes), n_blocks):
                parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs])
                hashes.append(parent)
        return hashes[:n_blocks]

    def get_computed_blocks(self, req: Request, leave_one: bool = True) -> tuple[list[Block], int]:
        """Longest cached prefix of the request, in whole blocks. With `leave_one`, at least one
        token is left to compute, since its logits are needed to sample."""
        if not self.uses_prefix_cache(req):
            return [], 0
        n = req.num_tokens - 1 if leave_one else req.num_tokens
        hits = self.cached_prefix(self.block_hashes(req, n // self.block_size))
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def uses_prefix_cache(self, req: Request) -> bool:
        """False when prefix caching is off, or for a request wanting prompt logprobs (every
        prompt position must then be computed)."""
        return self.enable_prefix_caching and req.sampling_params.prompt_logprobs is None

    def cached_prefix(self, hashes: list[bytes]) -> list[Block]:
        """The blocks of the longest leading run of `hashes` this worker holds: the device
        pool's, continued by those revived from the offload tiers (cached, ref 0: free, as a
        device hit is, until the caller touches them)."""
        hits = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        if self.offload is not None and len(hits) < len(hashes):
            hits += self._revive(hits, hashes[len(hits):])
        return hits

    def _revive(self, hits: list[Block], hashes: list[bytes]) -> list[Block]:
        """The offload tiers' continuation of a device hit; the hit's blocks are held meanwhile
        so the revival's allocation cannot evict them, and one free block is left for the
        tokens to compute (a revival that filled the pool would only be evicted again)."""
        self.pool.touch(hits)
        try:
            return self.offload.revive(self.pool, hashes, max(self.pool.num_free_blocks - 1, 0))
        finally:
            self.pool.free(reversed(hits))

    def tier_stats(self):
        """engine/kv_offload.TierStats, or None without tiers."""
        if self.offload is None:
            return None
        return self.offload.stats(len(self.pool.cached))

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[Block] = ()) -> bool:
        """Make room for `num_new_tokens` beyond the computed ones (plus `computed_blocks`, a
        prefix hit taken on first admission). False, with nothing changed, if blocks run out."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        have = len(blocks) + len(computed_blocks)
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - have
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - revived:
            if not blocks:
                del self.req_blocks[req.request_id]
            return False
        self.pool.touch(list(computed_blocks))
        blocks.extend(computed_blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        self.num_hashed.setdefault(req.request_id, len(computed_blocks))
        req.block_ids = [b.block_id for b in blocks]
        return True

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens,
        whose KV has been written."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        n_full = min(num_tokens // self.block_size, len(blocks))
        start = self.num_hashed.get(req.request_id, 0)
        if n_full <= start:
            return
        hashes = self.block_hashes(req, n_full)
        new = self.pool.cache_all(blocks[start:n_full], hashes[start:n_full])
        if new and self.offload is not None:
            self.offload.stored(new)
        self.num_hashed[req.request_id] = n_full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` tokens (rejected speculative
        tokens' slots). Those blocks were never cached: only computed tokens are hashed."""
        blocks = self.req_blocks.get(req.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(extra))
            req.block_ids = [b.block_id for b in blocks]

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_hashed.pop(req.request_id, None)
        self.pool.free(reversed(blocks))
        req.block_ids = []

    def num_held_blocks(self) -> int:
        """Blocks referenced by any request (cached-but-free blocks are not held)."""
        return self.pool.num_blocks - self.pool.num_free_blocks
