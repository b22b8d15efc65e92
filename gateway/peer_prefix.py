"""Which peer prefill worker the chosen one fetches the prompt's prefix from (issue 31,
peer fetch; the worker side is prefill_worker/peer_fetch.py).

    hashes = prefix_block_hashes(prompt, block size)   the engine's own keys, at most the
                                                       blocks a prefix hit may cover (one
                                                       token is always computed)
    mine   = Router.index.match(hashes, chosen).total  what the chosen worker B holds
    peer A = the healthy prefill worker (not B, same KvCompat as the reservation) whose
             leading blocks of the prompt, in any tier (Router.index.holders), exceed B's
             by at least --peer-fetch-min-blocks; the most blocks wins, then the most of
             them on A's device, then the least loaded
    -> PrefillRequest.peer_prefix {A's address, A's blocks}, else None

A exports from its device pool, reviving first what it offloaded to its host or disk tier
(prefill_worker/peer_export.py): a prefix A computed long ago and B never saw is moved, not
recomputed. Blocks A no longer holds anywhere make it refuse, and B computes.
`Router.peer_fetch_min_blocks` 0 (--peer-fetch off) turns it off.
"""
from __future__ import annotations

from engine.block_hash import prefix_block_hashes
from protos.pdserve.v1 import common_pb2, prefill_pb2

from .registry import Worker


def peer_prefix(router, chosen: Worker, prompt: list[int],
                compat: common_pb2.KvCompat) -> prefill_pb2.PeerPrefix | None:
    """The peer `chosen` should fetch the prompt's leading blocks from, or None."""
    least, bs = router.peer_fetch_min_blocks, compat.block_size
    if least <= 0 or not bs or (len(prompt) - 1) // bs < least:
        return None
    hashes = prefix_block_hashes(prompt, bs, (len(prompt) - 1) // bs)
    holders = router.index.holders(hashes)
    if not holders:
        return None
    mine = router.index.match(hashes, chosen.address).total
    best: tuple[int, int, int, str] | None = None     # (blocks, on device, -in flight, address)
    for address, hits in holders.items():
        w = router.prefill.workers.get(address)
        if address == chosen.address or w is None or not w.healthy:
            continue
        if w.stats is not None and w.stats.HasField("compat") and w.stats.compat != compat:
            continue
        if hits.total - mine >= least:
            key = (hits.total, hits.device, -w.in_flight, address)
            best = key if best is None or key > best else best
    if best is None:
        return None
    return prefill_pb2.PeerPrefix(worker_address=best[3], num_blocks=best[0])
