"""Scale-down loses nothing, in ONE process: real prefill and decode workers
(services.worker_server.serve over LoopbackTransport) and a real gateway.core.Gateway on one
event loop, each worker with its own stop event (what SIGTERM sets).

- A decode worker drained while its streams run longer than its drain: each stream still
  on it near the drain's end ends UNAVAILABLE "worker draining" and the gateway migrates
  it; every stream completes with the offline engine's greedy tokens, the migrate counter
  counts exactly the drained worker's streams, and every KV block is back.
- A prefill worker drained with prompts queued: those are handed back at once (UNAVAILABLE)
  and retried on the other prefill worker; every request completes greedy-identical, the
  drained worker stops long before its drain timeout.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import ROLE as DECODE
from engine.config import EngineOptions
from engine.offline import LLM
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
from services.security import channel
from services.worker_server import serve

BS = 8
TEST_S = 120.0

pytestmark = pytest.mark.timeout(300)


class Pools:
    """`n_prefill` prefill and `n_decode` decode workers and a gateway on one loop (a thread).
    `drain`: each worker's --drain-timeout-s by role; `migrate_s`: the decode workers';
    `disaggregation`: the gateway's."""

    def __init__(self, model_dir: str, n_prefill: int, n_decode: int, drain: dict,
                 migrate_s: float = 1.0, prefill_batch: int = 16, disaggregation: str = "auto"):
        self.model_dir, self.n, self.disaggregation = model_dir, (n_prefill, n_decode), disaggregation
        self.drain, self.migrate_s, self.prefill_batch = drain, migrate_s, prefill_batch
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="drain", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = TEST_S):
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        return fut.result(timeout + 5)

    async def start(self) -> None:
        dports = [free_port() for _ in range(self.n[1])]
        decoders = ",".join(f"127.0.0.1:{p}" for p in dports)
        cfgs = [("prefill", PrefillWorkerConfig(
                    port=free_port(), decode=decoders, model_dir=self.model_dir,
                    drain_timeout_s=self.drain["prefill"], engine=EngineOptions.of(
                        block_size=BS, num_blocks=256, max_num_batched_tokens=self.prefill_batch)))
                for _ in range(self.n[0])]
        cfgs += [("decode", DecodeWorkerConfig(
                    port=p, model_dir=self.model_dir, kv_expiry_s=10,
                    drain_timeout_s=self.drain["decode"], drain_migrate_s=self.migrate_s,
                    engine=EngineOptions.of(block_size=BS, num_blocks=2048))) for p in dports]
        self.workers = []
        for role, cfg in cfgs:
            stop, ready = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(serve(cfg, PREFILL if role == "prefill" else DECODE,
                                             transport=LoopbackTransport(), ready=ready, stop=stop))
            self.workers.append({"role": role, "address": f"127.0.0.1:{cfg.port}", "stop": stop,
                                 "ready": ready, "task": task})
        for w in self.workers:
            await asyncio.wait([asyncio.ensure_future(w["ready"].wait()), w["task"]], timeout=60,
                               return_when=asyncio.FIRST_COMPLETED)
            assert w["ready"].is_set(), f"{w['role']} worker not ready"
        self.gateway = Gateway(GatewayConfig(
            model=self.model_dir, health_interval_s=0.2, disaggregation=self.disaggregation,
            prefill=",".join(w["address"] for w in self.of("prefill")),
            decode=",".join(w["address"] for w in self.of("decode"))))
        await self.gateway.start()

    def of(self, role: str) -> list[dict]:
        return [w for w in self.workers if w["role"] == role]

    async def stop(self) -> None:
        await self.gateway.stop()
        for w in self.workers:
            w["stop"].set()
        await asyncio.wait_for(asyncio.gather(*(w["task"] for w in self.workers),
                                              return_exceptions=True), 60)

    async def stats(self, w: dict):
        stub = (prefill_pb2_grpc.PrefillWorkerStub if w["role"] == "prefill"
                else decode_pb2_grpc.DecodeWorkerStub)
        ch = channel(w["address"], None)
        try:
            return await stub(ch).Stats(common_pb2.StatsRequest(), timeout=10)
        finally:
            await ch.close()

    def fallbacks(self, kind: str) -> float:
        text = generate_latest(self.gateway.metrics.registry).decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name.endswith("kv_transfer_fallbacks_total") and s.labels.get("kind") == kind)

    async def one(self, rid: str, prompt: list[int], n: int, started: asyncio.Event | None = None):
        got, fin = [], None
        async for ev in self.gateway.generate(GenerateInput(rid, prompt, SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=True))):
            got += ev.token_ids
            fin = ev.finish_reason or fin
            if started is not None and len(got) >= 2:
                started.set()
        return got, fin

    async def all_free(self, workers: list[dict], within: float = 10.0) -> None:
        """Every KV block of `workers` back in its pool, nothing running or waiting."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while True:
            held = {w["address"]: (s.total_kv_blocks - s.free_kv_blocks, s.num_running, s.num_waiting)
                    for w in workers for s in [await self.stats(w)]}
            if all(v == (0, 0, 0) for v in held.values()):
                return
            assert loop.time() < end, f"KV blocks still held (held, running, waiting): {held}"
            await asyncio.sleep(0.05)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 17) % 900 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def greedy(model_dir):
    llm = LLM(model_dir, block_size=BS, num_blocks=512)

    def ref(prompts, n):
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True))]
    return ref


def _system(model_dir, *args, **kw):
    p = Pools(model_dir, *args, **kw)
    p.run(p.start(), 120)
    return p


def _close(p: Pools) -> None:
    try:
        p.run(p.stop(), 90)
    finally:
        p.loop.call_soon_threadsafe(p.loop.stop)
        p.thread.join(10)


def test_drained_decode_worker_hands_its_streams_to_the_other(model_dir, greedy, caplog):
    """20 long streams over 2 decode workers; one drains (1.5 s, hand-off 0.75 s before its
    end): all 20 complete greedy-identical, none cut, the ones on it migrated, each on the
    worker's own "worker draining" (not on the server's stop cancelling what is left)."""
    caplog.set_level(logging.WARNING)
    n_tokens, n_streams = 600, 20
    prompts = [_prompt(10 + i % 7, i) for i in range(n_streams)]
    want = greedy(prompts, n_tokens)
    p = _system(model_dir, 1, 2, {"prefill": 5.0, "decode": 1.5}, migrate_s=0.75)
    try:
        async def body():
            started = [asyncio.Event() for _ in prompts]
            runs = [asyncio.ensure_future(p.one(f"d{i}", ids, n_tokens, started[i]))
                    for i, ids in enumerate(prompts)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            decs = p.of("decode")
            st = [await p.stats(w) for w in decs]
            victim, survivor = (decs[0], decs[1]) if st[0].num_running >= st[1].num_running \
                else (decs[1], decs[0])
            on_victim = p.gateway.decode.workers[victim["address"]].in_flight
            assert on_victim >= 1, "no stream on the decode worker to drain"
            migrated = p.fallbacks("migrate")
            t0 = asyncio.get_running_loop().time()
            victim["stop"].set()                                    # SIGTERM
            await asyncio.wait_for(victim["task"], 10)              # drained and stopped
            took = asyncio.get_running_loop().time() - t0
            results = await asyncio.gather(*runs)
            return results, on_victim, p.fallbacks("migrate") - migrated, took, survivor
        results, on_victim, migrations, took, survivor = p.run(body())
        for i, ((got, fin), ref) in enumerate(zip(results, want)):
            assert fin == "length" and got == ref, f"stream {i} was cut or diverged"
        assert migrations == on_victim, (migrations, on_victim)
        lost = [r.getMessage() for r in caplog.records if " lost after " in r.getMessage()]
        assert len(lost) == on_victim and all("worker draining" in m for m in lost), lost
        assert not [r for r in caplog.records if "drain timeout" in r.getMessage()]
        assert took < 1.5 + 3.0, f"the drained worker took {took:.1f}s to stop"
        p.run(p.all_free([survivor, *p.of("prefill")]))
    finally:
        _close(p)


def test_drained_prefill_worker_hands_its_queue_back(model_dir, greedy):
    """A burst of long prompts over 2 prefill workers (chunked 16 tokens a step, so they
    queue); one drains with a 60 s timeout: its queued prompts are handed back at once and
    retried on the other; all complete greedy-identical; it stops within seconds."""
    n_tokens = 4
    prompts = [_prompt(400, 100 + i) for i in range(12)]
    want = greedy(prompts, n_tokens)
    # always: auto would compute some of them on the decode worker (its measured cost of a
    # whole prompt can beat a prefill worker chunking it 16 tokens a step)
    p = _system(model_dir, 2, 1, {"prefill": 60.0, "decode": 5.0}, prefill_batch=16,
                disaggregation="always")
    try:
        async def body():
            runs = [asyncio.ensure_future(p.one(f"p{i}", ids, n_tokens))
                    for i, ids in enumerate(prompts)]
            pres = p.of("prefill")
            loop = asyncio.get_running_loop()
            end = loop.time() + 60
            while True:                      # a prefill worker with >= 2 waiting
                st = [await p.stats(w) for w in pres]
                best = max(range(len(pres)), key=lambda i: st[i].num_waiting)
                if st[best].num_waiting >= 2:
                    break
                assert loop.time() < end, "no prefill worker with queued prompts"
                await asyncio.sleep(0.02)
            victim = pres[best]
            retried = p.fallbacks("retry")
            t0 = loop.time()
            victim["stop"].set()                                    # SIGTERM
            await asyncio.wait_for(victim["task"], 30)
            took = loop.time() - t0
            results = await asyncio.gather(*runs)
            return results, p.fallbacks("retry") - retried, took
        results, retries, took = p.run(body())
        for i, ((got, fin), ref) in enumerate(zip(results, want)):
            assert fin == "length" and got == ref, f"request {i} failed or diverged"
        assert retries >= 1, "no prompt was handed back and retried"
        assert took < 20, f"the drained prefill worker took {took:.1f}s (its drain: 60 s)"
        p.run(p.all_free([w for w in p.workers if not w["task"].done()]))
    finally:
        _close(p)


def test_structured_stream_runs_to_the_end_of_the_drain_then_fails_clearly(model_dir, caplog):
    """A structured-output stream cannot migrate (its grammar's state): the drained worker
    lets it run past the hand-off of the others to the end of its drain, then ends it with
    UNAVAILABLE "worker draining", which the gateway reports as such (not a cut)."""
    from engine.structured import StructuredOutput
    from gateway.request import GatewayError
    caplog.set_level(logging.WARNING)
    p = _system(model_dir, 1, 2, {"prefill": 5.0, "decode": 1.5}, migrate_s=0.75)
    try:
        async def body():
            started = asyncio.Event()
            params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True,
                                    structured=StructuredOutput(regex="[a-z ]+"))

            async def one():
                n = 0
                async for ev in p.gateway.generate(GenerateInput("s0", _prompt(8, 1), params)):
                    n += len(ev.token_ids)
                    if n >= 2:
                        started.set()
                return n
            run = asyncio.ensure_future(one())
            await asyncio.wait_for(started.wait(), 60)
            victim = next(w for w in p.of("decode")
                          if p.gateway.decode.workers[w["address"]].in_flight)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            victim["stop"].set()
            with pytest.raises(GatewayError) as err:
                await asyncio.wait_for(run, 30)
            return err.value, loop.time() - t0, victim
        err, took, victim = p.run(body())
        assert err.code.name == "UNAVAILABLE" and "worker draining" in err.message, err
        assert took >= 1.5 - 0.375 - 0.05, f"ended {took:.2f}s into a 1.5 s drain: too early"
        assert any("cannot migrate" in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if "drain timeout" in r.getMessage()]
        p.run(p.all_free([w for w in p.workers if w is not victim]))
    finally:
        _close(p)
