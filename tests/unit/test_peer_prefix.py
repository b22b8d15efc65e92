"""gateway/peer_prefix.py: the peer a chosen prefill worker fetches the prompt's prefix from,
read off a real PrefixIndex filled by hand (as the KV events subscriber fills it) and the
real Router, with the engine's own block hashes."""
from __future__ import annotations

from types import SimpleNamespace

from engine.block_hash import prefix_block_hashes
from engine.kv_events import DEVICE, HOST
from gateway.peer_prefix import peer_prefix
from gateway.routing import Router
from protos.pdserve.v1 import common_pb2, prefill_pb2

BS = 8
COMPAT = common_pb2.KvCompat(model="m", dtype="float32", block_size=BS, num_layers=4)
PROMPT = list(range(3, 3 + 10 * BS + 3))       # 10 full blocks + 3 tokens


class FakeWorker:
    def __init__(self, address, healthy=True, compat=COMPAT, load=0):
        self.address, self.healthy, self.in_flight = address, healthy, load
        self.stats = prefill_pb2.PrefillStats(compat=compat)


def _router(*workers, min_blocks=4):
    pool = SimpleNamespace(workers={w.address: w for w in workers}, kind="prefill")
    r = Router(pool, SimpleNamespace(kind="decode"), 16, 1.5)
    r.peer_fetch_min_blocks = min_blocks
    return r


def _holds(r, address, n, tier=DEVICE, epoch=b"e"):
    r.index.reset(address, epoch, 0, {tier: prefix_block_hashes(PROMPT, BS, n)})


def test_names_the_peer_holding_enough_more_blocks():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    r = _router(a, b)
    _holds(r, "a:1", 10)
    _holds(r, "b:1", 2)
    assert peer_prefix(r, b, PROMPT, COMPAT) == prefill_pb2.PeerPrefix(worker_address="a:1", num_blocks=10)
    assert peer_prefix(r, a, PROMPT, COMPAT) is None          # the holder itself: nothing to fetch
    _holds(r, "b:1", 7)                                        # 3 more is under --peer-fetch-min-blocks
    assert peer_prefix(r, b, PROMPT, COMPAT) is None


def test_at_most_the_blocks_a_prefix_hit_covers():
    a, b = FakeWorker("a:1"), FakeWorker("b:1")
    r = _router(a, b)
    prompt = PROMPT[:10 * BS]                                  # exactly 10 blocks: the last token computes
    r.index.reset("a:1", b"e", 0, {DEVICE: prefix_block_hashes(prompt, BS)})
    assert peer_prefix(r, b, prompt, COMPAT).num_blocks == 9


def test_skips_unhealthy_other_layout_and_off():
    b = FakeWorker("b:1")
    sick = FakeWorker("a:1", healthy=False)
    other = FakeWorker("c:1", compat=common_pb2.KvCompat(model="m", dtype="bfloat16", block_size=BS))
    r = _router(sick, other, b)
    _holds(r, "a:1", 10)
    _holds(r, "c:1", 10)
    _holds(r, "gone:1", 10)                                    # in the index, not in the pool
    assert peer_prefix(r, b, PROMPT, COMPAT) is None
    ok = FakeWorker("e:1")
    r = _router(ok, b, min_blocks=0)                           # --peer-fetch off
    _holds(r, "e:1", 10)
    assert peer_prefix(r, b, PROMPT, COMPAT) is None


def test_most_blocks_then_least_loaded():
    b, busy, idle, short = FakeWorker("b:1"), FakeWorker("a:1", load=5), FakeWorker("c:1"), FakeWorker("d:1")
    r = _router(busy, idle, short, b)
    _holds(r, "a:1", 10)
    _holds(r, "c:1", 10)
    _holds(r, "d:1", 6)
    assert peer_prefix(r, b, PROMPT, COMPAT).worker_address == "c:1"


def test_a_peer_holding_it_in_a_slower_tier_counts_its_device_first_on_a_tie():
    # the peer revives offloaded blocks before it exports them (peer_export.py)
    b, host, dev = FakeWorker("b:1"), FakeWorker("a:1"), FakeWorker("c:1", load=3)
    r = _router(host, b)
    _holds(r, "a:1", 10, tier=HOST)
    assert peer_prefix(r, b, PROMPT, COMPAT) == prefill_pb2.PeerPrefix(worker_address="a:1", num_blocks=10)
    r = _router(host, dev, b)
    _holds(r, "a:1", 10, tier=HOST)
    _holds(r, "c:1", 10)
    assert peer_prefix(r, b, PROMPT, COMPAT).worker_address == "c:1"   # busier, but on device
