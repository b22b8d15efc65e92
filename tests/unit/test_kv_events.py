"""KV events: the engine pool's log says exactly what it caches, and the gateway's index,
replaying the log (with a lost event and a restart thrown in), says exactly what the log says."""
import random

import pytest

from engine.block_hash import prefix_block_hashes
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager, hash_block_tokens
from engine.kv_events import DEVICE, DISK, HOST, KvEvent, KvEventLog
from engine.request import Request
from engine.sampling_params import SamplingParams
from gateway.prefix_index import PrefixIndex, TierHits


def test_log_numbers_events_and_keeps_a_snapshot():
    log = KvEventLog(capacity=3)
    log.stored([b"a", b"b"])
    log.removed([b"a"])
    log.stored([b"c"], HOST)
    assert [e.seq for e in log.since(0)] == [1, 2, 3]
    assert log.since(3) == [] and log.since(4) is None
    log.cleared(HOST)
    assert log.since(0) is None                        # event 1 has fallen out of the log
    assert [e.kind for e in log.since(1)] == ["removed", "stored", "cleared"]
    seq, snap = log.snapshot()
    assert seq == 4 and snap == {DEVICE: [b"b"], HOST: [], DISK: []}
    with pytest.raises(ValueError):
        log.stored([b"x"], "tape")


def test_listeners_run_after_each_append():
    log, calls = KvEventLog(), []
    fn = lambda: calls.append(log.seq)                 # noqa: E731
    log.add_listener(fn)
    log.stored([b"a"])
    log.stored([])                                     # nothing stored: no event
    log.removed([b"a"])
    log.remove_listener(fn)
    log.stored([b"b"])
    assert calls == [1, 2]


def test_block_pool_events_equal_its_cache_under_random_operations():
    rng = random.Random(7)
    log = KvEventLog(capacity=100_000)
    pool, held = BlockPool(12, log), []
    for step in range(3000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            held.append(pool.allocate(rng.randint(1, min(3, pool.num_free_blocks))))
        elif op < 0.7 and held:
            pool.free(reversed(held.pop(rng.randrange(len(held)))))
        elif held:
            blocks = held[rng.randrange(len(held))]
            pool.cache_all(blocks, [bytes([rng.randrange(40)]) for _ in blocks])
        pool.check()                                   # includes: log's device set == cached
    assert log.seq > 100


def test_manager_hashes_are_the_shared_block_hashes():
    kv = KVCacheManager(8, 4)
    req = Request("r", list(range(10)), SamplingParams(max_tokens=1), 1)
    assert kv.allocate_slots(req, 10)
    kv.cache_blocks(req, 10)
    want = prefix_block_hashes(list(range(10)), 4)
    assert kv.events.held(DEVICE) == set(want) and len(want) == 2
    assert want[1] == hash_block_tokens(want[0], [4, 5, 6, 7])


def test_index_replays_a_random_run_with_a_lost_event_and_a_restart():
    rng = random.Random(3)
    index, logs, pos = PrefixIndex(), {w: KvEventLog(capacity=64) for w in "AB"}, {}

    def sync(w, lose=False):
        log = logs[w]
        p = pos.get(w)
        events = log.since(p[1]) if p and p[0] == log.epoch else None
        if events is not None and lose and len(events) > 1:
            events = events[:1] + events[2:]           # one event lost on the way
        if events is None or not index.apply(w, log.epoch, events):
            seq, snap = log.snapshot()
            index.reset(w, log.epoch, seq, snap)
        pos[w] = index.position(w)

    for step in range(2000):
        w = rng.choice("AB")
        tier = rng.choice([DEVICE, DEVICE, HOST, DISK])
        hs = [bytes([rng.randrange(30)]) for _ in range(rng.randint(1, 4))]
        r = rng.random()
        if r < 0.55:
            logs[w].stored(hs, tier)
        elif r < 0.95:
            logs[w].removed(hs, tier)
        elif r < 0.98:
            logs[w].cleared(tier)
        else:
            logs[w] = KvEventLog(capacity=64)          # the worker restarted, empty
        if rng.random() < 0.3:
            sync(w, lose=rng.random() < 0.1)
    for w in "AB":
        sync(w)
        assert index.contents(w) == {t: set(h) for t, h in logs[w].snapshot()[1].items()}
    assert index.resyncs > 0


def test_match_counts_the_leading_chain_in_its_fastest_tier():
    index = PrefixIndex()
    h = [bytes([i]) for i in range(5)]
    index.reset("A", b"e", 0, {DEVICE: h[:2], HOST: [h[1], h[2]], DISK: [h[4]]})
    index.reset("B", b"f", 0, {DEVICE: h[1:]})
    assert index.match(h, "A") == TierHits(device=2, host=1, disk=0)   # h[3] missing: stops
    assert index.match(h, "B") == TierHits()                          # no h[0]: no prefix
    assert index.holders(h) == {"A": TierHits(2, 1, 0)}
    assert not index.apply("A", b"other", [])                         # a new epoch
    assert index.match(h, "A") == TierHits() and index.position("A") is None
    index.reset("A", b"e", 5, {DEVICE: h})
    assert not index.apply("A", b"e", [KvEvent(7, "removed", DEVICE, (h[0],))])   # seq gap
    index.reset("A", b"e", 5, {DEVICE: h})
    assert index.apply("A", b"e", [KvEvent(5, "removed", DEVICE, (h[0],)),       # old: skipped
                                   KvEvent(6, "removed", DEVICE, (h[3],))])
    assert index.match(h, "A") == TierHits(device=3)
    index.drop("A")
    assert index.holders(h) == {} and index.workers() == ["B"]
