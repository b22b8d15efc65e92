"""KV events end to end in one process: a prefill and a decode worker (services.worker_server
.serve, tiny model, LoopbackTransport, small KV pools so requests evict) and a real
gateway.core.Gateway over gRPC on 127.0.0.1, sharing an internal token file.

- after requests that evict, the gateway's `Router.index` holds, per worker address, exactly
  the worker's own log (`kv_events.held(tier)`) and its block pool's cached hashes
- a lost batch (the client's drop_batches hook): the gap is seen, the worker resynced from a
  snapshot (snapshots split in parts of 8 hashes here), counted in kv_index_resyncs_total
- a restarted decode worker (same address, new epoch): the index follows its new log
- a gateway stopped leaves no subscriber task and no open stream on the workers
- KvEvents without the internal credential: UNAUTHENTICATED
Plus the wire helpers alone: batch bounds, snapshot parts, the engine-thread listener.
"""
from __future__ import annotations

import asyncio
import threading
import uuid

import grpc
import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import ROLE as DECODE
from engine.config import EngineOptions
from engine.kv_events import DEVICE, HOST, KvEvent, KvEventLog
from engine.sampling_params import SamplingParams
from engine.tiny_model import ensure_default_model
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.request import GenerateInput
from kvtransfer.transport import LoopbackTransport
from pdserve.launcher import free_port
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.server import ROLE as PREFILL
from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from services import kv_events_rpc, worker_server
from services.kv_events_rpc import KvEventStreams, SnapshotParts, batches, snapshot_messages
from services.security import channel, write_token

BS, BLOCKS = 8, 24               # 192 tokens a pool: a few 40-token prompts evict
TEST_S = 60.0


def _prompt(n, seed):
    return [(seed * 31 + i * 17) % 900 + 3 for i in range(n)]


class _Recorded:
    """Each AsyncEngine and KvEventStreams serve() makes, in order (patched into it)."""
    engines: list = []
    streams: list = []


class _RecordingEngine(worker_server.AsyncEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        _Recorded.engines.append(self)


class _RecordingStreams(KvEventStreams):
    def __init__(self, log):
        super().__init__(log, max_hashes=8, heartbeat_s=0.5)     # snapshots in several parts
        _Recorded.streams.append(self)


class Cluster:
    """The two workers (each stoppable alone) and a gateway, on a loop in its own thread."""

    def __init__(self, model_dir: str, token_file: str):
        self.model_dir, self.token_file = model_dir, token_file
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = TEST_S):
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        return fut.result(timeout + 5)

    async def serve(self, role, cfg):
        """Start one worker; (its task, its stop event, its engine, its streams) once ready."""
        ready, stop = asyncio.Event(), asyncio.Event()
        n = len(_Recorded.engines)
        task = asyncio.create_task(serve_worker(cfg, role, ready, stop))
        await asyncio.wait([task, asyncio.ensure_future(ready.wait())], timeout=45,
                           return_when=asyncio.FIRST_COMPLETED)
        assert ready.is_set(), task.done() and task.result()
        return task, stop, _Recorded.engines[n], _Recorded.streams[n]

    async def start(self) -> None:
        common = dict(model_dir=self.model_dir, drain_timeout_s=2.0, internal_token_file=self.token_file)
        self.dport = free_port()
        self.pcfg = PrefillWorkerConfig(port=free_port(), decode=f"127.0.0.1:{self.dport}", **common,
                                        engine=EngineOptions.of(block_size=BS, num_blocks=BLOCKS))
        self.dcfg = DecodeWorkerConfig(port=self.dport, kv_expiry_s=10, **common,
                                       engine=EngineOptions.of(block_size=BS, num_blocks=BLOCKS))
        self.pre = await self.serve(PREFILL, self.pcfg)
        self.dec = await self.serve(DECODE, self.dcfg)
        self.pre_addr, self.dec_addr = f"127.0.0.1:{self.pcfg.port}", f"127.0.0.1:{self.dport}"
        self.gateway = self.new_gateway()
        await self.gateway.start()

    def new_gateway(self) -> Gateway:
        return Gateway(GatewayConfig(model=self.model_dir, prefill=self.pre_addr, decode=self.dec_addr,
                                     health_interval_s=0.2, internal_token_file=self.token_file,
                                     disaggregation="always"))

    async def restart_decode(self) -> None:
        task, stop, _, _ = self.dec
        stop.set()
        await asyncio.wait_for(task, 30)
        self.dec = await self.serve(DECODE, self.dcfg)

    async def stop(self) -> None:
        await self.gateway.stop()
        for task, stop, _, _ in (self.pre, self.dec):
            stop.set()
            await asyncio.wait_for(task, 30)

    async def generate(self, prompt, n: int = 3) -> list[int]:
        inp = GenerateInput("kv-" + uuid.uuid4().hex, prompt,
                            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return [t for ev in [e async for e in self.gateway.generate(inp)] for t in ev.token_ids]


async def serve_worker(cfg, role, ready, stop):
    await worker_server.serve(cfg, role, transport=LoopbackTransport(), ready=ready, stop=stop)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    token_file = str(tmp_path_factory.mktemp("kvev") / "token")
    write_token(token_file)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_server, "AsyncEngine", _RecordingEngine)
        mp.setattr(worker_server, "KvEventStreams", _RecordingStreams)
        c = Cluster(str(ensure_default_model()), token_file)
        try:
            c.run(c.start(), 120)
            yield c
            c.run(c.stop(), 60)
        finally:
            c.loop.call_soon_threadsafe(c.loop.stop)
            c.thread.join(10)


async def _pool_cached(ae) -> set[bytes]:
    return await ae.call(lambda: set(ae.engine.kv.pool.cached))


async def _in_sync(c: Cluster, within: float = 20.0) -> None:
    """Both workers' index states at their logs' seq, then equal to the logs and pools."""
    index = c.gateway.router.index
    for addr, (_, _, ae, _) in ((c.pre_addr, c.pre), (c.dec_addr, c.dec)):
        log = ae.kv_events
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while index.position(addr) != (log.epoch, log.seq):
            assert loop.time() < deadline, (addr, index.position(addr), log.seq)
            await asyncio.sleep(0.02)
        held = await _pool_cached(ae)
        assert index.position(addr) == (log.epoch, log.seq), "the engine moved meanwhile"
        assert index.contents(addr)[DEVICE] == log.held(DEVICE) == held, addr
        assert index.contents(addr)[HOST] == log.held(HOST)


async def _all_free(c: Cluster, within: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    for _, _, ae, _ in (c.pre, c.dec):
        while (s := ae.stats()).num_free_blocks != s.num_total_blocks:
            assert loop.time() < deadline, s
            await asyncio.sleep(0.02)


def _metric(c: Cluster, name: str, **labels) -> float:
    return c.gateway.metrics.registry.get_sample_value(name, {"role": "gateway", **labels}) or 0.0


def test_the_index_equals_each_workers_cache_after_evictions(cluster):
    async def main():
        for i in range(8):
            assert len(await cluster.generate(_prompt(40, i))) == 3
        await _all_free(cluster)
        await _in_sync(cluster)
        for _, _, ae, _ in (cluster.pre, cluster.dec):     # the pools were too small: evictions
            assert any(e.kind == "removed" for e in ae.kv_events.since(0))
        assert _metric(cluster, "pdserve:kv_events_total", pool="decode") > 0
        assert _metric(cluster, "pdserve:kv_index_blocks", pool="prefill", tier="device") == \
            len(cluster.pre[2].kv_events.held(DEVICE))
    cluster.run(main())


def test_a_lost_batch_is_recovered_from_a_snapshot(cluster):
    async def main():
        before = _metric(cluster, "pdserve:kv_index_resyncs_total", pool="prefill") + \
            _metric(cluster, "pdserve:kv_index_resyncs_total", pool="decode")
        cluster.gateway.kv_events.drop_batches = 1
        for i in range(3):                   # the first batch is lost, a later one shows the gap
            await cluster.generate(_prompt(40, 100 + i))
        assert cluster.gateway.kv_events.drop_batches == 0
        await _all_free(cluster)
        await _in_sync(cluster)
        after = _metric(cluster, "pdserve:kv_index_resyncs_total", pool="prefill") + \
            _metric(cluster, "pdserve:kv_index_resyncs_total", pool="decode")
        assert after == before + 1
    cluster.run(main())


def test_a_restarted_worker_is_followed_on_its_new_epoch(cluster):
    async def main():
        old = cluster.dec[2].kv_events.epoch
        await cluster.restart_decode()
        assert cluster.dec[2].kv_events.epoch != old
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not cluster.gateway.decode.workers[cluster.dec_addr].healthy:
            assert loop.time() < deadline, "the restarted decode worker never probed healthy"
            await asyncio.sleep(0.05)
        await cluster.generate(_prompt(40, 200))
        await _all_free(cluster)
        await _in_sync(cluster)
    cluster.run(main())


def test_a_stopped_gateway_leaves_no_task_and_no_stream(cluster):
    async def main():
        streams = [s for _, _, _, s in (cluster.pre, cluster.dec)]
        base = [s.open_streams for s in streams]
        gw = cluster.new_gateway()
        await gw.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while [s.open_streams for s in streams] != [b + 1 for b in base]:
            assert loop.time() < deadline, [s.open_streams for s in streams]
            await asyncio.sleep(0.02)
        assert sorted(gw.kv_events.following) == sorted([cluster.pre_addr, cluster.dec_addr])
        await gw.stop()
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events-")
                    and t not in set(cluster.gateway.kv_events._tasks.values())]
        while [s.open_streams for s in streams] != base:
            assert loop.time() < deadline, [s.open_streams for s in streams]
            await asyncio.sleep(0.02)
    cluster.run(main())


@pytest.mark.parametrize("token", ["", "not-the-deployments-token"], ids=["none", "wrong"])
def test_kv_events_needs_the_internal_credential(cluster, token):
    async def main():
        for addr, stub in ((cluster.pre_addr, prefill_pb2_grpc.PrefillWorkerStub),
                           (cluster.dec_addr, decode_pb2_grpc.DecodeWorkerStub)):
            ch = channel(addr, None, token=token)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub(ch).KvEvents(common_pb2.KvEventsRequest(), timeout=10).read()
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED, e.value.details()
            finally:
                await ch.close()
    cluster.run(main())


# ----------------------------------------------------------------------------- wire helpers
def test_batches_keep_their_bounds_and_never_split_an_event():
    evs = [KvEvent(i + 1, "stored", DEVICE, tuple(bytes([i, j]) for j in range(i % 5))) for i in range(40)]
    out = batches(b"e", evs, max_events=7, max_hashes=6)
    assert [e.seq for b in out for e in b.events] == list(range(1, 41))
    for b in out:
        assert len(b.events) <= 7 and b.seq == b.events[-1].seq and b.epoch == b"e"
        assert sum(len(e.hashes) for e in b.events) <= 6
    assert kv_events_rpc.events_from_proto([m for b in out for m in b.events]) == evs
    big = [KvEvent(1, "stored", DEVICE, tuple(bytes([j]) for j in range(10)))]
    assert len(batches(b"e", big, max_hashes=4)) == 1          # one event over the bound: alone


def test_snapshot_parts_reassemble():
    state = {DEVICE: [bytes([i]) for i in range(11)], HOST: [b"h1", b"h2"], "disk": []}
    msgs = snapshot_messages(b"e", 9, state, max_hashes=4)
    assert len(msgs) == 4 and [m.snapshot_continues for m in msgs] == [True] * 3 + [False]
    parts = SnapshotParts()
    got = [parts.add(m) for m in msgs]
    assert got[:3] == [None] * 3
    assert {t: sorted(h) for t, h in got[3].items()} == {DEVICE: state[DEVICE], HOST: state[HOST]}
    empty = snapshot_messages(b"e", 0, {DEVICE: []})
    assert len(empty) == 1 and SnapshotParts().add(empty[0]) == {}


def test_the_listener_wakes_the_loop_once_per_burst_from_another_thread():
    async def main():
        log = KvEventLog()
        streams = KvEventStreams(log, heartbeat_s=5.0, coalesce_s=0.01)

        class Ctx:
            async def abort(self, code, details):
                raise AssertionError(details)
        gen = streams.serve(common_pb2.KvEventsRequest(), Ctx())
        first = await gen.__anext__()
        assert first.snapshot and first.seq == 0 and first.epoch == log.epoch

        def burst():
            for i in range(50):
                log.stored([bytes([i])])
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        await asyncio.to_thread(burst)
        batch = await asyncio.wait_for(nxt, 5)
        assert [e.seq for e in batch.events] == list(range(1, 51))     # one batch
        streams.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(gen.__anext__(), 5)
        assert streams.open_streams == 0 and not log._listeners
        assert await _first_seqs(log, log.epoch, 30) == list(range(31, 51))    # resumed
        assert await _first_seqs(log, b"another", 30) == "snapshot"             # a restart
    asyncio.run(main())


async def _first_seqs(log: KvEventLog, epoch: bytes, seq: int):
    """What a stream asked to resume after (epoch, seq) sends first: its events' seqs, or
    "snapshot"."""
    gen = KvEventStreams(log).serve(common_pb2.KvEventsRequest(epoch=epoch, since_seq=seq), None)
    msg = await gen.__anext__()
    await gen.aclose()
    return "snapshot" if msg.snapshot else [e.seq for e in msg.events]
