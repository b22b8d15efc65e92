"""WorkerPool.pick with prefix affinity: the worker that served the prompt's first blocks
wins until load overrides it, which needs both bounds broken: more than `slack` requests
in flight over the least-loaded worker, and (when slack_ratio > 0) more than slack_ratio
times its count (SGLang's cache-aware router: abs and rel balance thresholds)."""
import asyncio

import pytest

from gateway import registry
from gateway.config import GatewayConfig
from protos.pdserve.v1 import prefill_pb2_grpc


def picks(loads: dict[str, int], slack: int, slack_ratio: float = 0.0, affine: str = "a") -> str:
    """Which worker the pool picks, with these requests in flight, for a prompt `affine`
    served last."""
    async def main():
        pool = registry.WorkerPool("prefill", prefill_pb2_grpc.PrefillWorkerStub, 3600, 1)
        for name, n in loads.items():
            w = registry.Worker("prefill", name, prefill_pb2_grpc.PrefillWorkerStub)
            w.healthy = True
            for _ in range(n):                 # n calls open on it
                w.attach(object())
            pool.workers[name] = w
        affinity = registry.PrefixAffinity()
        hashes = affinity.block_hashes(list(range(64)), 16)
        affinity.record(hashes, affine)
        try:
            return pool.pick((), affinity, hashes, slack, slack_ratio).address
        finally:
            for w in pool.workers.values():
                await w.channel.close()

    return asyncio.run(main())


def test_affine_worker_wins_within_the_absolute_slack_and_loses_beyond_it():
    assert picks({"a": 2, "b": 0}, slack=2) == "a"
    assert picks({"a": 3, "b": 0}, slack=2) == "b"
    assert picks({"a": 12, "b": 10}, slack=2) == "a"
    assert picks({"a": 13, "b": 10}, slack=2) == "b"


def test_ratio_keeps_affinity_on_a_busy_pool_but_not_over_an_idle_worker():
    # 15 vs 10 breaks slack 2 but not 1.5x; 16 breaks both
    assert picks({"a": 15, "b": 10}, slack=2, slack_ratio=1.5) == "a"
    assert picks({"a": 16, "b": 10}, slack=2, slack_ratio=1.5) == "b"
    # an idle worker: any count is more than 1.5 x 0, so the absolute slack decides
    assert picks({"a": 2, "b": 0}, slack=2, slack_ratio=1.5) == "a"
    assert picks({"a": 3, "b": 0}, slack=2, slack_ratio=1.5) == "b"


def test_negative_slack_without_ratio_ignores_affinity():
    """bench/routing.py's blind baseline: the least-loaded worker, even on a tie (where the
    first one listed wins)."""
    assert picks({"a": 0, "b": 0}, slack=0, affine="b") == "b"
    assert picks({"a": 0, "b": 0}, slack=-1_000_000, affine="b") == "a"
    assert picks({"a": 1, "b": 0}, slack=-1_000_000) == "b"


def test_negative_ratio_is_refused():
    with pytest.raises(ValueError, match="affinity_slack_ratio"):
        GatewayConfig(model="m", affinity_slack_ratio=-1)


def _spread(router_args: tuple, n: int) -> dict[str, int]:
    """Requests in flight per decode worker after `n` requests sharing one prefix (a chat
    template's system prompt) arrived one after another and stayed open (moderate load),
    routed by a Router built with `router_args` (slack, slack_ratio[, decode_slack])."""
    from gateway.routing import Router

    async def main():
        pools = {k: registry.WorkerPool(k, prefill_pb2_grpc.PrefillWorkerStub, 3600, 1)
                 for k in ("prefill", "decode")}
        for name in ("a", "b"):
            w = registry.Worker("decode", name, prefill_pb2_grpc.PrefillWorkerStub)
            w.healthy = True
            pools["decode"].workers[name] = w
        router = Router(pools["prefill"], pools["decode"], *router_args)
        prefix = list(range(100, 164))                          # 4 blocks of 16
        for i in range(n):
            hashes = router.hashes(pools["decode"], prefix + [i] * 20)
            w = router.pick_decode(set(), hashes)
            w.attach(object())                                  # its stream stays open
            router.served(w, hashes)
        try:
            return {a: w.in_flight for a, w in pools["decode"].workers.items()}
        finally:
            for w in pools["decode"].workers.values():
                await w.channel.close()

    return asyncio.run(main())


def test_decode_affinity_is_a_preference_moderate_load_spreads():
    """The gateway's defaults (slack 16, ratio 1.5, decode slack 2): ten open streams with
    one shared prefix split evenly over two decode workers (within the decode slack), not
    all ten on the affine one, which is what the prefill rule alone would do."""
    cfg = GatewayConfig(model="m")
    default = (cfg.affinity_slack, cfg.affinity_slack_ratio, cfg.decode_affinity_slack)
    loads = _spread(default, 10)
    assert sum(loads.values()) == 10 and abs(loads["a"] - loads["b"]) <= cfg.decode_affinity_slack + 1
    assert _spread(default[:2] + (16,), 10) == {"a": 10, "b": 0}     # a pin, as before
    assert _spread(default, 2) == {"a": 2, "b": 0}     # light load: the affine one still wins
