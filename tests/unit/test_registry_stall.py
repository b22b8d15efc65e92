"""A decode worker whose probes go unanswered (stalled, e.g. SIGSTOP) has its streams cut
after stall_timeout_s so the gateway migrates them; a draining one (NOT_SERVING) keeps them."""
import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gateway import registry
from protos.pdserve.v1 import decode_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class Stream:
    def __init__(self):
        self.cut_reason = None

    def cut(self, worker, reason: str) -> None:
        self.cut_reason = reason


def test_unanswered_probes_cut_streams_after_the_stall_timeout_not_on_not_serving():
    async def main():
        health = health_aio.HealthServicer()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await health.set("pdserve.v1.DecodeWorker", health_pb2.HealthCheckResponse.NOT_SERVING)
        pool = registry.WorkerPool("decode", decode_pb2_grpc.DecodeWorkerStub, 0.05, 0.5,
                                   stall_timeout_s=0.5)
        await pool.on_change([f"127.0.0.1:{port}"], [])
        w = pool.workers[f"127.0.0.1:{port}"]
        s = Stream()
        w.attach(s)
        # Draining: unhealthy (no new requests), but answering, so its stream stays.
        for _ in range(12):
            await pool.probe(w)
            await asyncio.sleep(0.05)
        assert not w.healthy and s.cut_reason is None and w.failing_since is None
        # Gone quiet: the first unanswered probe does not cut it, stall_timeout_s of them does.
        await server.stop(None)
        await pool.probe(w)
        assert not w.healthy and s.cut_reason is None
        t0 = asyncio.get_running_loop().time()
        while s.cut_reason is None and asyncio.get_running_loop().time() - t0 < 10:
            await asyncio.sleep(0.05)
            await pool.probe(w)
        assert s.cut_reason is not None and w.address in s.cut_reason
        assert asyncio.get_running_loop().time() - t0 >= 0.5 - 0.1
        await pool.stop()

    asyncio.run(main())


def test_streams_still_on_a_removed_worker_at_the_retire_timeout_are_cut_then_closed():
    """A worker removed from discovery keeps its channel while requests are on it; past the
    retire timeout its streams are cut (migrated by the gateway, not ended as cancelled)
    before the channel closes."""
    async def main():
        pool = registry.WorkerPool("decode", decode_pb2_grpc.DecodeWorkerStub, 0.02, 0.1,
                                   retire_timeout_s=0.3)
        await pool.on_change(["127.0.0.1:1"], [])
        w = pool.workers["127.0.0.1:1"]
        s = Stream()
        w.attach(s)
        await pool.on_change([], ["127.0.0.1:1"])
        await asyncio.sleep(0.1)
        assert s.cut_reason is None and w.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN
        t0 = asyncio.get_running_loop().time()
        while w.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN:
            assert asyncio.get_running_loop().time() - t0 < 5, "the channel was never closed"
            await asyncio.sleep(0.02)
        assert s.cut_reason is not None and "removed from discovery" in s.cut_reason
        await pool.stop()

    asyncio.run(main())


class SlowHealth(health_aio.HealthServicer):
    """A health servicer that answers after `delay_s` (a worker busy enough to be slow)."""

    def __init__(self):
        super().__init__()
        self.delay_s = 0.0

    async def Check(self, request, context):
        await asyncio.sleep(self.delay_s)
        return await super().Check(request, context)


def test_one_slow_probe_keeps_a_worker_in_routing_a_refused_one_does_not():
    """A probe timeout is tolerated SLOW_PROBES_TOLERATED times in a row (load, as a
    kubelet's failureThreshold), then the worker leaves routing; an answer brings the count
    back to zero; a refused connection takes it out at the first probe."""
    async def main():
        health = SlowHealth()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await health.set("pdserve.v1.DecodeWorker", health_pb2.HealthCheckResponse.SERVING)
        pool = registry.WorkerPool("decode", decode_pb2_grpc.DecodeWorkerStub, 60, 0.2,
                                   stall_timeout_s=60)
        address = f"127.0.0.1:{port}"
        await pool.on_change([address], [])
        w = pool.workers[address]
        w.stats = None
        health.delay_s = 0.0
        # Stats is not served by this server: make the healthy path only check health.
        w.stub = type("NoStats", (), {"Stats": staticmethod(_stats)})()
        await pool.probe(w)
        assert w.healthy
        health.delay_s = 0.5                     # every probe now times out (0.2 s)
        for _ in range(registry.SLOW_PROBES_TOLERATED):
            await pool.probe(w)
            assert w.healthy and "DEADLINE_EXCEEDED" in w.last_error
        await pool.probe(w)
        assert not w.healthy
        health.delay_s = 0.0
        await pool.probe(w)
        assert w.healthy and w.slow_probes == 0
        await server.stop(None)                  # refused: out at once
        await pool.probe(w)
        assert not w.healthy and "DEADLINE_EXCEEDED" not in w.last_error
        await pool.stop()

    asyncio.run(main())


async def _stats(request, timeout=None):
    return None
