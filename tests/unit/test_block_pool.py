"""Block pool and KV-cache manager: exact block ids for allocation, sharing, freeing, eviction."""
import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager, prefix_block_hashes
from engine.request import Request
from engine.sampling_params import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_takes_blocks_in_order_and_free_appends_to_tail():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert ids(a) == [0, 1] and ids(b) == [2, 3, 4]
    assert pool.num_free_blocks == 1
    pool.free(reversed(a))                     # tail first: 1 then 0
    assert list(pool.free_queue) == [5, 1, 0]
    assert ids(pool.allocate(3)) == [5, 1, 0]
    pool.check()
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_double_free_is_an_error():
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(RuntimeError):
        pool.free(a)


def test_cached_block_survives_free_and_is_evicted_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)                       # 0, 1
    pool.cache(a[0], b"h0")
    pool.cache(a[1], b"h1")
    pool.free(reversed(a))                     # free queue: 2, 3, 1, 0
    assert pool.lookup(b"h0") is a[0] and pool.lookup(b"h1") is a[1]
    # a prefix hit revives block 0 out of the middle of the free queue
    pool.touch([pool.lookup(b"h0")])
    assert a[0].ref_cnt == 1 and list(pool.free_queue) == [2, 3, 1]
    # allocation consumes 2, 3 (unhashed) then evicts 1 (hashed): its hash disappears
    got = pool.allocate(3)
    assert ids(got) == [2, 3, 1]
    assert pool.lookup(b"h1") is None and a[1].block_hash is None
    assert pool.lookup(b"h0") is a[0]
    pool.check()


def test_sharing_counts_references():
    pool = BlockPool(3)
    a = pool.allocate(1)
    pool.cache(a[0], b"x")
    pool.touch([a[0]])                         # a second request shares it
    assert a[0].ref_cnt == 2
    pool.free(a)
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free(a)
    assert pool.num_free_blocks == 3 and list(pool.free_queue)[-1] == 0
    pool.check()


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"same")
    pool.cache(b, b"same")
    assert pool.lookup(b"same") is a and b.block_hash is None
    pool.check()


def _req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens)


def test_manager_prefix_hits_share_blocks_and_leave_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", range(10))                   # 2 full blocks + 2 tokens
    assert kv.allocate_slots(a, 10)
    assert a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_blocks(a, 10)                     # blocks 0, 1 are full -> hashed
    b = _req("b", list(range(8)) + [99, 98])   # shares the first 8 tokens
    hits, n = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and n == 8
    assert kv.allocate_slots(b, 2, hits)
    assert b.block_ids == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2
    # an identical 8-token prompt hits only 1 block: one token must be left to compute
    c = _req("c", range(8))
    assert kv.get_computed_blocks(c)[1] == 4
    kv.free(a)
    kv.free(b)
    assert kv.num_held_blocks() == 0
    # freed tail first: a frees 2 (1 and 0 are still b's), then b frees 3, 1, 0
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    kv.pool.check()


def test_manager_refuses_when_blocks_run_out_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", range(8))
    assert kv.allocate_slots(a, 8)
    b = _req("b", range(100, 108))
    assert not kv.allocate_slots(b, 8)
    assert b.block_ids == [] and kv.num_free_blocks == 1 and "b" not in kv.req_blocks
    kv.pool.check()


def test_block_hashes_are_chained():
    h = prefix_block_hashes(list(range(12)), 4)
    h2 = prefix_block_hashes([7] + list(range(1, 12)), 4)
    assert len(h) == 3 and h[0] != h2[0] and h[1] != h2[1] and h[2] != h2[2]
    assert prefix_block_hashes(list(range(8)), 4) == h[:2]
