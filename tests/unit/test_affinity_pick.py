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
