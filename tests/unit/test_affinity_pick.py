"""The routing rule (gateway/affinity.py): saved(w) = block_size x (device + 0.75 host + 0.5
disk) against load(w) in tokens, pick = min load - (1 + R) saved within the slack bounds. Table-driven
on the pure rule (a cached worker wins until its load costs more than the tokens it saves, and
the decision flips exactly there), then the Router on real registry Workers with the index
filled by hand (reset(), as the KvEvents subscriber fills it): its hashes are the engine's,
cached_on, the metrics, --prefix-routing none, KvCompat matching."""
import asyncio
from dataclasses import dataclass

import grpc
import pytest

from engine.block_hash import prefix_block_hashes
from engine.kv_events import DEVICE, DISK, HOST
from gateway import registry
from gateway.affinity import Weights, choose, decode_bounds, leading_hashes
from gateway.config import GatewayConfig
from gateway.prefix_index import PrefixIndex, TierHits
from gateway.request import GatewayError
from gateway.routing import Router
from protos.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc
from services.metrics import Metrics


@dataclass(eq=False)
class W:
    address: str
    tokens: int = 0            # load_tokens()
    in_flight: int = 0
    requests_total: int = 0

    def load_key(self):
        return self.in_flight, 0, 0

    def load_tokens(self):
        return self.tokens


def _pick(a_tokens, a_hits, b_tokens=0, b_hits=TierHits(), a_flight=0, b_flight=0,
          slack=16, ratio=1.5, weights=Weights()):
    a, b = W("a", a_tokens, a_flight), W("b", b_tokens, b_flight)
    got = choose([a, b], {"a": a_hits, "b": b_hits}, 16, weights, slack, ratio)
    return got.worker.address, got.reason


DEV8, HOST8, DISK8 = TierHits(device=8), TierHits(host=8), TierHits(disk=8)


@pytest.mark.parametrize("a_tokens,a_hits,b_tokens,b_hits,want", [
    (0, DEV8, 0, TierHits(), ("a", "prefix")),
    (127, DEV8, 0, TierHits(), ("a", "prefix")),       # 8 x 16 = 128 saved > 127 queued
    (129, DEV8, 0, TierHits(), ("b", "load")),         # the queue costs more than it saves
    (95, HOST8, 0, TierHits(), ("a", "prefix")),       # host: 0.75 x 128 = 96
    (97, HOST8, 0, TierHits(), ("b", "load")),
    (63, DISK8, 0, TierHits(), ("a", "prefix")),       # disk: 0.5 x 128 = 64
    (65, DISK8, 0, TierHits(), ("b", "load")),
    (111, TierHits(4, 4), 0, TierHits(), ("a", "prefix")),   # 64 + 48 = 112
    (113, TierHits(4, 4), 0, TierHits(), ("b", "load")),
    (100, DEV8, 0, TierHits(device=2), ("b", "prefix")),  # 100 more load, only 96 more saved
    (90, DEV8, 0, TierHits(device=2), ("a", "prefix")),
    (500, TierHits(), 400, TierHits(), ("b", "cold")),    # nobody holds it: the least load
])
def test_a_cached_worker_wins_until_its_load_costs_more_than_it_saves(
        a_tokens, a_hits, b_tokens, b_hits, want):
    """R = 0: this request's wait alone."""
    assert _pick(a_tokens, a_hits, b_tokens, b_hits, weights=Weights(recompute=0.0)) == want


@pytest.mark.parametrize("a_tokens,a_hits,b_tokens,b_hits,want", [
    (129, DEV8, 0, TierHits(), ("a", "prefix")),       # past its saving, under twice it
    (255, DEV8, 0, TierHits(), ("a", "prefix")),       # 2 x 128 = 256
    (257, DEV8, 0, TierHits(), ("b", "load")),
    (191, HOST8, 0, TierHits(), ("a", "prefix")),      # 2 x 96
    (193, HOST8, 0, TierHits(), ("b", "load")),
    (191, DEV8, 0, TierHits(device=2), ("a", "prefix")),  # 2 x 96 more saved = 192
    (193, DEV8, 0, TierHits(device=2), ("b", "prefix")),
    (500, TierHits(), 400, TierHits(), ("b", "cold")),
])
def test_by_default_a_saved_token_counts_twice_a_queued_one(a_tokens, a_hits, b_tokens, b_hits,
                                                            want):
    """R = 1 (--prefix-weight-recompute): the holder keeps the prompt while its extra queue
    is under twice its saving (the prompt is not computed again for anyone)."""
    assert _pick(a_tokens, a_hits, b_tokens, b_hits) == want
    with pytest.raises(ValueError, match="recompute weight"):
        Weights(recompute=-1.0)
    with pytest.raises(ValueError, match="prefix_weight_recompute"):
        GatewayConfig(model="m", prefix_weight_recompute=-0.5)


def test_tier_weights_are_the_flags():
    assert _pick(127, HOST8, weights=Weights(recompute=0.0)) == ("b", "load")
    assert _pick(127, HOST8, weights=Weights(host=1.0, recompute=0.0)) == ("a", "prefix")
    assert _pick(1, DISK8, weights=Weights(disk=0.0)) == ("b", "load")
    with pytest.raises(ValueError, match="prefix weights"):
        Weights(host=1.5)
    with pytest.raises(ValueError, match="prefix_weight_disk"):
        GatewayConfig(model="m", prefix_weight_disk=-0.1)
    with pytest.raises(ValueError, match="prefix-routing"):
        GatewayConfig(model="m", prefix_routing="guess")


def test_slack_bounds_keep_a_prefix_a_preference_not_a_pin():
    # the cheapest in tokens, but 17 requests in flight over an idle worker: both bounds broken
    assert _pick(0, DEV8, a_flight=16) == ("a", "prefix")
    assert _pick(0, DEV8, a_flight=17) == ("b", "slack")
    # 30 vs 20 breaks slack 2 but not 1.5x; 31 breaks both
    assert _pick(0, DEV8, a_flight=30, b_flight=20, slack=2) == ("a", "prefix")
    assert _pick(0, DEV8, a_flight=31, b_flight=20, slack=2) == ("b", "slack")
    # decode picks: the smaller slack, no ratio
    assert decode_bounds(16, 2) == (2, 0.0)
    assert _pick(0, DEV8, a_flight=3, slack=2, ratio=0.0) == ("b", "slack")
    # bench/routing.py's blind baseline: a negative slack leaves only the least loaded
    assert _pick(0, DEV8, a_flight=1, slack=-1_000_000, ratio=0.0) == ("b", "slack")


def test_no_hits_map_means_least_loaded_and_ties_go_to_fewer_requests():
    a, b = W("a", 0, 1), W("b", 900, 0)
    assert choose([a, b], None).worker is b and choose([a, b], None).reason == "off"
    a, b = W("a", 0, 0, requests_total=3), W("b", 0, 0, requests_total=2)
    assert choose([a, b], {}).worker is b
    assert choose([], {}) is None


def test_leading_hashes_are_the_engines_and_stop_at_the_first_block_nobody_holds():
    prompt = list(range(16 * 64))
    full = prefix_block_hashes(prompt, 16)
    index = PrefixIndex()
    assert leading_hashes(index, prompt, 16, 1024) == []
    index.reset("w", b"e", 0, {DEVICE: full[:3]})
    assert leading_hashes(index, prompt, 16, 1024) == full[:3]
    index.reset("v", b"e", 0, {DISK: full[:10]})
    assert leading_hashes(index, prompt, 16, 1024) == full[:10]
    assert leading_hashes(index, prompt, 16, 4) == full[:4]


class _Pools:
    """Real registry pools of healthy Workers (no server: nothing is called)."""

    def __init__(self, prefill=(), decode=()):
        self.metrics = Metrics("gateway")
        self.pools = {k: registry.WorkerPool(k, prefill_pb2_grpc.PrefillWorkerStub, 3600, 1)
                      for k in ("prefill", "decode")}
        for kind, names in (("prefill", prefill), ("decode", decode)):
            for name in names:
                w = registry.Worker(kind, name, prefill_pb2_grpc.PrefillWorkerStub)
                w.healthy = True
                self.pools[kind].workers[name] = w

    def router(self, *args, **kw) -> Router:
        return Router(self.pools["prefill"], self.pools["decode"], *(args or (16, 1.5, 2)),
                      metrics=self.metrics, **kw)

    def count(self, name, **labels):
        return self.metrics.registry.get_sample_value(
            f"pdserve:{name}_total", {"role": "gateway", **labels}) or 0

    async def close(self):
        for pool in self.pools.values():
            for w in pool.workers.values():
                await w.channel.close()


def _kv(block_size=16, layout="gqa"):
    return decode_pb2.KvReady(compat=common_pb2.KvCompat(block_size=block_size, layout=layout))


def test_router_picks_the_worker_whose_events_hold_the_prompt():
    async def main():
        p = _Pools(prefill=("a", "b"))
        r = p.router()
        prompt = list(range(16 * 8 + 5))
        assert r.pick_prefill(_kv(), [], r.hashes(r.prefill, prompt)).address == "a"  # cold: first
        r.index.reset("b", b"e", 1, {DEVICE: prefix_block_hashes(prompt, 16)[:6],
                                     HOST: prefix_block_hashes(prompt, 16)[6:]})
        h = r.hashes(r.prefill, prompt, 16)
        assert len(h) == 8
        assert r.pick_prefill(_kv(), [], h).address == "b"
        assert r.cached_on(p.pools["prefill"].workers["b"], h) == 8 * 16
        assert r.cached_on(p.pools["prefill"].workers["a"], h) == 0
        assert p.count("route_decisions", pool="prefill", reason="prefix") == 1
        assert p.count("route_decisions", pool="prefill", reason="cold") == 1
        assert p.count("route_prefix_hit_blocks", pool="prefill") == 8
        # b's queue (its Stats) past twice what 6 device + 2 host blocks save (2 x 120)
        p.pools["prefill"].workers["b"].stats = prefill_pb2.PrefillStats(queued_prefill_tokens=239)
        assert r.pick_prefill(_kv(), [], h).address == "b"
        p.pools["prefill"].workers["b"].stats = prefill_pb2.PrefillStats(queued_prefill_tokens=241)
        assert r.pick_prefill(_kv(), [], h).address == "a"
        assert p.count("route_decisions", pool="prefill", reason="load") == 1
        off = Router(p.pools["prefill"], p.pools["decode"], 16, 1.5, prefix_routing="none")
        off.index = r.index
        p.pools["prefill"].workers["b"].stats = None
        assert off.pick_prefill(_kv(), [], h).address == "a"        # least loaded only
        assert off.cached_on(p.pools["prefill"].workers["b"], h) == 128   # still known
        await p.close()
    asyncio.run(main())


def test_router_keeps_kv_compat_matching():
    async def main():
        p = _Pools(prefill=("a", "b"))
        r = p.router()
        prompt = list(range(64))
        r.index.reset("b", b"e", 1, {DEVICE: prefix_block_hashes(prompt, 16)})
        p.pools["prefill"].workers["b"].stats = prefill_pb2.PrefillStats(
            compat=common_pb2.KvCompat(block_size=16, layout="mla"))
        h = r.hashes(r.prefill, prompt, 16)
        assert r.pick_prefill(_kv(), [], h).address == "a"          # b holds it, wrong layout
        with pytest.raises(GatewayError) as e:
            r.pick_prefill(_kv(), ["a"], h)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        await p.close()
    asyncio.run(main())


def test_load_tokens_are_the_open_calls_and_what_stats_add_beyond_them():
    async def main():
        p = _Pools(prefill=("a",), decode=("d",))
        a, d = p.pools["prefill"].workers["a"], p.pools["decode"].workers["d"]
        holder = object()
        a.attach(holder, 300, 400)             # 300 to compute of a 400-token prompt
        assert a.load_tokens() == 300
        # Stats taken while the call was open count its whole prompt; 200 are someone else's
        a.stats, a.stats_open_tokens = prefill_pb2.PrefillStats(queued_prefill_tokens=600), 400
        assert a.load_tokens() == 500
        a.detach(holder)               # ended: not counted again from Stats that show it
        assert a.load_tokens() == 200 and a.open_tokens == a.open_stats_tokens == 0
        a.stats = None
        assert a.load_tokens() == 0
        d.stats = decode_pb2.DecodeStats(total_kv_blocks=100, free_kv_blocks=60,
                                         compat=common_pb2.KvCompat(block_size=16))
        assert d.load_tokens() == 40 * 16
        await p.close()
    asyncio.run(main())


def _spread(n: int, decode_slack: int = 2) -> dict[str, int]:
    """Streams per decode worker after `n` requests sharing one 4-block prefix (a chat
    template's system prompt) that worker a holds arrived one after another and stayed open."""
    async def main():
        p = _Pools(decode=("a", "b"))
        r = p.router(16, 1.5, decode_slack)
        prefix = list(range(100, 164))                          # 4 blocks of 16
        r.index.reset("a", b"e", 1, {DEVICE: prefix_block_hashes(prefix, 16)})
        for i in range(n):
            prompt = prefix + [i] * 20
            w = r.pick_decode(set(), r.hashes(r.decode, prompt))
            w.attach(object(), len(prompt))                     # its stream stays open
        try:
            return {a: w.in_flight for a, w in p.pools["decode"].workers.items()}
        finally:
            await p.close()
    return asyncio.run(main())


def test_decode_prefix_is_a_preference_load_spreads():
    """One shared prefix saves 64 tokens; each open stream holds 84 tokens of KV: the first
    goes to the holder, then the load in tokens spreads them (a within one), whatever the
    slack."""
    assert _spread(1) == {"a": 1, "b": 0}
    loads = _spread(10)
    assert sum(loads.values()) == 10 and 0 <= loads["a"] - loads["b"] <= 1
    assert _spread(10, decode_slack=16) == loads


def test_pdserve_up_passes_the_routing_flags_to_the_gateway():
    from pdserve.up import UpConfig, gateway_argv
    argv = gateway_argv(UpConfig(prefix_routing="none", prefix_weight_host=0.5))
    assert argv[argv.index("--prefix-routing") + 1] == "none"
    assert argv[argv.index("--prefix-weight-host") + 1] == "0.5"
    assert "--prefix-weight-disk" not in argv and "--prefix-routing" not in gateway_argv(UpConfig())
    with pytest.raises(ValueError, match="prefix-routing"):
        UpConfig(prefix_routing="hash")


def test_a_prompt_follows_an_open_prefill_call_computing_its_prefix():
    async def main():
        p = _Pools(prefill=("a", "b"))
        r = p.router()
        shared = list(range(16 * 6))
        first, second = shared + list(range(500, 540)), shared + list(range(900, 933))
        b = p.pools["prefill"].workers["b"]
        b.requests_total = -1                  # b is the cold pick: ties go to fewer requests
        h1 = r.prefill_hashes(first, 16)
        assert r.pick_prefill(_kv(), [], h1) is b
        ticket = r.open_prefill(b, h1)
        # nothing in the index yet (no KV events while b computes), but b is computing it
        h2 = r.prefill_hashes(second, 16)
        assert r.prefill_hit_tokens(b, h2, 16) == 6 * 16
        assert r.prefill_hit_tokens(p.pools["prefill"].workers["a"], h2, 16) == 0
        b.requests_total = 5                    # no tie-break for b left: only its prefix
        assert r.pick_prefill(_kv(), [], h2) is b
        assert p.count("route_decisions", pool="prefill", reason="prefix") == 1
        # in-flight blocks continue the index's match: 2 in b's host tier, then 4 in flight
        r.index.reset("b", b"e", 1, {HOST: h1[:2]})
        assert r.prefill_hit_tokens(b, h2, 16) == 6 * 16
        b.stats = prefill_pb2.PrefillStats(queued_prefill_tokens=1000)
        assert r.pick_prefill(_kv(), [], h2).address == "a"        # its queue costs more
        r.close_prefill(ticket)
        assert r.prefill_hit_tokens(b, h2, 16) == 2 * 16          # the index's alone
        assert len(r.inflight) == 0
        await p.close()
    asyncio.run(main())


def test_in_flight_blocks_are_counted_per_call():
    from gateway.inflight import InFlight
    f = InFlight()
    t1, t2 = f.add("a", [b"x", b"y"]), f.add("a", [b"x"])
    t3 = f.add("b", [b"z"])
    empty = [f.add("c", []), f.add("c", [])]     # prompts under one block: nothing held
    for t in empty:
        f.remove(t)
    assert f.holds("a", b"x") and f.holds("a", b"y") and not f.holds("b", b"x")
    f.remove(t1)
    assert f.holds("a", b"x") and not f.holds("a", b"y") and f.any_holds(b"x")
    f.remove(t2)
    assert not f.any_holds(b"x") and f.any_holds(b"z") and len(f) == 1
    f.remove(t3)
    assert len(f) == 0 and not f._held
