"""A worker that leaves discovery while requests are on it: out of routing at once, its
channel closed only when they end (found by tests/e2e/test_manifests.py: scaling decode down
broke the streams the draining pod was still finishing)."""
import asyncio

from gateway import registry
from protos.pdserve.v1 import decode_pb2_grpc


def test_removed_worker_keeps_its_channel_until_its_requests_end():
    async def main():
        pool = registry.WorkerPool("decode", decode_pb2_grpc.DecodeWorkerStub, 0.01, 0.1)
        await pool.on_change(["127.0.0.1:1", "127.0.0.1:2"], [])
        w = pool.workers["127.0.0.1:1"]
        closed = asyncio.Event()
        close = w.close

        async def recording_close():
            closed.set()
            await close()
        w.close = recording_close
        call = object()
        w.attach(call)                                    # one request on it
        await pool.on_change([], ["127.0.0.1:1"])
        assert "127.0.0.1:1" not in pool.workers          # no new request goes there
        await asyncio.sleep(0.1)
        assert not closed.is_set()                       # the one in flight still has it
        w.detach(call)
        await asyncio.wait_for(closed.wait(), 5)
        await pool.stop()

    asyncio.run(main())


def test_stop_closes_retiring_workers():
    async def main():
        pool = registry.WorkerPool("decode", decode_pb2_grpc.DecodeWorkerStub, 0.01, 0.1)
        await pool.on_change(["127.0.0.1:1"], [])
        w = pool.workers["127.0.0.1:1"]
        call = object()
        w.attach(call)                                    # one request on it
        await pool.on_change([], ["127.0.0.1:1"])
        await asyncio.wait_for(pool.stop(), 5)
        assert w.channel.get_state() == __import__("grpc").ChannelConnectivity.SHUTDOWN

    asyncio.run(main())
