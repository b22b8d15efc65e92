"""The whole P/D protocol in ONE process and ONE event loop: a prefill and a decode worker
(services.worker_server.serve with kvtransfer's LoopbackTransport instead of UCX) and a
gateway.core.Gateway, talking gRPC on free 127.0.0.1 ports. No UCX, no subprocesses.

The loop runs in a background thread for the module; each test submits one coroutine to it,
bounded by a deadline. Every wait inside has its own deadline too.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid

import grpc
import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import ROLE as DECODE
from engine.config import EngineOptions
from engine.kv_cache_manager import cdiv
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
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.security import channel, read_token
from services.worker_server import serve

BS = 8
LAYERS = 4                      # the tiny model's
RPC_S = 20.0                    # deadline of one RPC
TEST_S = 60.0                   # deadline of one test's coroutine


def _prompt(n, seed=0):
    return [(seed * 7 + i * 13) % 900 + 3 for i in range(n)]


def _greedy(max_tokens):
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _dest(kv: decode_pb2.KvReady) -> prefill_pb2.KvDestination:
    return prefill_pb2.KvDestination(decode_worker_id=kv.decode_worker_id, kv_endpoint=kv.kv_endpoint,
                                     transfer_id=kv.transfer_id, dst_block_ids=kv.block_ids,
                                     num_cached_tokens=kv.num_cached_tokens, compat=kv.compat,
                                     expires_at_unix_ms=kv.expires_at_unix_ms,
                                     idle_timeout_ms=kv.idle_timeout_ms,
                                     max_expires_at_unix_ms=kv.max_expires_at_unix_ms)


async def _rest(stream) -> list:
    """The stream's remaining messages (read(): an RPC may not mix read() and iteration);
    bounded by the RPC's deadline."""
    msgs = []
    while (m := await stream.read()) is not grpc.aio.EOF:
        msgs.append(m)
    return msgs


def _held(stats) -> int:
    return stats.total_kv_blocks - stats.free_kv_blocks


class System:
    """Both workers and a gateway on one loop (running in a thread of its own)."""

    def __init__(self, model_dir: str, prefill_options: dict = {}, decode_options: dict = {},
                 prefill_config: dict = {}, prefill_transport=None, decode_config: dict = {},
                 token_file: str = "", gateway_config: dict = {}):
        """`*_options`: more EngineOptions by name for that worker (test_quant_pd.py);
        `*_config`: more PrefillWorkerConfig / DecodeWorkerConfig fields
        (test_admission_prefill.py); `token_file`: the internal credential of all three
        (the test's own channels send it too; test_internal_credential.py);
        `prefill_transport`: the prefill worker's KV transport (a LoopbackTransport by
        default; test_faults_kv.py tampers with its messages); `gateway_config`: more
        GatewayConfig fields (default: --disaggregation always, the path these tests
        follow; test_disagg_inprocess.py runs never and auto)."""
        self.gateway_config = {"disaggregation": "always", **gateway_config}
        self.model_dir, self.prefill_config, self.decode_config = model_dir, prefill_config, decode_config
        self.token_file = token_file
        self.prefill_transport = prefill_transport or LoopbackTransport()
        self.prefill_options, self.decode_options = prefill_options, decode_options
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pd-inprocess", daemon=True)
        self.thread.start()

    @classmethod
    @contextlib.contextmanager
    def started(cls, model_dir: str, **kwargs):
        """A started System (arguments as the constructor's); on exit its workers and
        gateway are stopped, also when the body failed, and its loop's thread ends."""
        s = cls(model_dir, **kwargs)
        try:
            s.run(s.start(), 90)
            try:
                yield s
            finally:
                s.run(s.stop(), 45)
        finally:
            s.loop.call_soon_threadsafe(s.loop.stop)
            s.thread.join(10)

    def run(self, coro, timeout: float = TEST_S):
        """Run `coro` on the system's loop, failing after `timeout` seconds."""
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        return fut.result(timeout + 5)

    async def start(self) -> None:
        self.stop_event = asyncio.Event()
        common = dict(model_dir=self.model_dir, drain_timeout_s=5.0, internal_token_file=self.token_file)
        dport = free_port()
        pcfg = PrefillWorkerConfig(port=free_port(), decode=f"127.0.0.1:{dport}", **common,
                                   engine=EngineOptions.of(**{
                                       "block_size": BS, "num_blocks": 64,
                                       "max_num_batched_tokens": 16,     # chunked
                                       **self.prefill_options}),
                                   **self.prefill_config)
        dcfg = DecodeWorkerConfig(port=dport, kv_expiry_s=10, **common, engine=EngineOptions.of(
            **{"block_size": BS, "num_blocks": 64, **self.decode_options}), **self.decode_config)
        ready = [asyncio.Event(), asyncio.Event()]
        self.tasks = [
            asyncio.create_task(serve(pcfg, PREFILL, transport=self.prefill_transport, ready=ready[0],
                                      stop=self.stop_event)),
            asyncio.create_task(serve(dcfg, DECODE, transport=LoopbackTransport(), ready=ready[1],
                                      stop=self.stop_event))]
        both = asyncio.ensure_future(asyncio.gather(ready[0].wait(), ready[1].wait()))
        await asyncio.wait([both, *self.tasks], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        both.cancel()
        for t in self.tasks:
            if t.done():                  # a worker that returned before it was ready failed
                t.result()
                raise RuntimeError("a worker stopped before it was ready")
        assert all(r.is_set() for r in ready), "workers not ready within 60 s"
        self.pre_addr, self.dec_addr = f"127.0.0.1:{pcfg.port}", f"127.0.0.1:{dcfg.port}"
        self.pre_ch = channel(self.pre_addr, None, token=read_token(self.token_file))
        self.dec_ch = channel(self.dec_addr, None, token=read_token(self.token_file))
        self.pre = prefill_pb2_grpc.PrefillWorkerStub(self.pre_ch)
        self.dec = decode_pb2_grpc.DecodeWorkerStub(self.dec_ch)
        self.gateway = Gateway(GatewayConfig(model=self.model_dir, prefill=f"127.0.0.1:{pcfg.port}",
                                             decode=f"127.0.0.1:{dcfg.port}", health_interval_s=0.5,
                                             internal_token_file=self.token_file,
                                             **self.gateway_config))
        await self.gateway.start()

    async def stop(self) -> None:
        await self.gateway.stop()
        await self.pre_ch.close()
        await self.dec_ch.close()
        self.stop_event.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 30)

    async def held(self) -> tuple[int, int]:
        """KV blocks held on (prefill, decode) now."""
        p = await self.pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S)
        d = await self.dec.Stats(common_pb2.StatsRequest(), timeout=RPC_S)
        return _held(p), _held(d)

    async def wait_all_free(self, within: float = 5.0) -> None:
        """Every KV block back in both pools (freeing is a command on each engine thread)."""
        async def poll():
            while await self.held() != (0, 0):
                await asyncio.sleep(0.02)
        try:
            await asyncio.wait_for(poll(), within)
        except asyncio.TimeoutError:
            raise AssertionError(f"blocks still held after {within}s (prefill, decode): "
                                 f"{await self.held()}") from None


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def system(model_dir):
    with System.started(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def offline(model_dir):
    """Greedy reference tokens from the offline engine on the same model."""
    llm = LLM(model_dir, block_size=BS, num_blocks=64)

    def ref(prompt, n):
        return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
    return ref


def test_each_step_of_one_request(system, offline):
    """reserve (blocks held) -> KvReady -> Prefill -> first token -> stream to the end, greedy
    tokens equal to the offline engine's; then every block is free on both workers."""
    prompt, n = _prompt(21, 1), 8
    ref = offline(prompt, n)

    async def main():
        assert await system.held() == (0, 0)
        rid = "steps-" + uuid.uuid4().hex
        stream = system.dec.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                                            sampling=_greedy(n)), timeout=RPC_S)
        first_msg = await asyncio.wait_for(stream.read(), RPC_S)
        assert first_msg.WhichOneof("msg") == "kv_ready"
        kv = first_msg.kv_ready
        assert kv.kv_endpoint.startswith("loopback://") and kv.num_cached_tokens == 0
        assert len(kv.block_ids) == cdiv(len(prompt), BS) and kv.compat.block_size == BS
        assert await system.held() == (0, len(kv.block_ids))          # reserved, nothing computed
        resp = await system.pre.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(n), destination=_dest(kv)),
            timeout=RPC_S)
        assert resp.first_token.token_id == ref.token_ids[0]
        assert resp.blocks_transferred == len(kv.block_ids) * LAYERS
        while (await system.held())[0]:     # the prefill frees its blocks right after answering
            await asyncio.sleep(0.01)         # (bounded by the test's deadline)
        assert (await system.dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
            request_id=rid, first_token=resp.first_token), timeout=RPC_S)).accepted
        tokens, last = [resp.first_token.token_id], None
        for msg in await _rest(stream):
            tokens += [t.token_id for t in msg.tokens.tokens]
            last = msg.tokens
        assert tokens == ref.token_ids
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == n
        await system.wait_all_free()
    system.run(main())


def test_gateway_streams_the_offline_engines_tokens(system, offline):
    prompts = [_prompt(30, 2), _prompt(5, 3)]
    refs = [offline(p, 10) for p in prompts]

    async def one(prompt):
        inp = GenerateInput("gw-" + uuid.uuid4().hex, prompt,
                            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        tokens, last = [], None
        async for ev in system.gateway.generate(inp):
            tokens += ev.token_ids
            last = ev
        return tokens, last

    async def main():
        for (tokens, last), ref in zip(await asyncio.gather(*map(one, prompts)), refs):
            assert tokens == ref.token_ids
            assert last.finish_reason == "length" and last.usage.completion_tokens == 10
        await system.wait_all_free()
    system.run(main())


def test_abort_mid_stream_frees_every_block(system):
    prompt, n = _prompt(30, 4), 400

    async def main():
        rid = "abort-" + uuid.uuid4().hex
        stream = system.dec.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                                            sampling=_greedy(n)), timeout=RPC_S)
        kv = (await asyncio.wait_for(stream.read(), RPC_S)).kv_ready
        resp = await system.pre.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(n), destination=_dest(kv)),
            timeout=RPC_S)
        assert (await system.dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
            request_id=rid, first_token=resp.first_token), timeout=RPC_S)).accepted
        assert (await asyncio.wait_for(stream.read(), RPC_S)).tokens.tokens        # streaming
        assert (await system.held())[1] > 0
        assert (await system.dec.Abort(common_pb2.AbortRequest(request_id=rid, reason="test"),
                                       timeout=RPC_S)).found
        rest = await _rest(stream)
        assert rest[-1].tokens.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert rest[-1].tokens.error == "aborted: test"
        await system.wait_all_free()
    system.run(main())


def test_reservation_expiry_frees_the_blocks(system):
    async def main():
        before = (await system.dec.Stats(common_pb2.StatsRequest(), timeout=RPC_S)).transfers.expirations
        stream = system.dec.Decode(decode_pb2.DecodeRequest(
            request_id="expire-" + uuid.uuid4().hex, prompt_token_ids=_prompt(20, 5), sampling=_greedy(4),
            kv_timeout_ms=300, kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_FAIL), timeout=RPC_S)
        kv = (await asyncio.wait_for(stream.read(), RPC_S)).kv_ready
        assert await system.held() == (0, len(kv.block_ids)) != (0, 0)
        msgs = await _rest(stream)                              # nobody prefills
        assert msgs[-1].tokens.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert "expired" in msgs[-1].tokens.error
        after = await system.dec.Stats(common_pb2.StatsRequest(), timeout=RPC_S)
        assert after.transfers.expirations == before + 1
        await system.wait_all_free()
    system.run(main())


def test_recompute_fallback_matches_the_offline_engine(system, offline):
    prompt, n = _prompt(19, 6), 6
    ref = offline(prompt, n)

    async def main():
        stream = system.dec.Decode(decode_pb2.DecodeRequest(
            request_id="recompute-" + uuid.uuid4().hex, prompt_token_ids=prompt, sampling=_greedy(n),
            kv_timeout_ms=300, kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_RECOMPUTE), timeout=RPC_S)
        assert (await asyncio.wait_for(stream.read(), RPC_S)).kv_ready.block_ids
        msgs = await _rest(stream)
        tokens = [t.token_id for m in msgs for t in m.tokens.tokens]
        assert tokens == ref.token_ids                                # first token unknown: all local
        assert msgs[-1].tokens.finish_reason == common_pb2.FINISH_REASON_LENGTH
        await system.wait_all_free()
    system.run(main())


def test_internal_rpcs_refuse_bad_inputs_and_foreign_destinations(system):
    """SubmitFirstToken's token id, kv_timeout_ms and a Prefill destination that no known
    decode worker announced: refused (nothing is reserved or connected)."""
    async def main():
        rid = "bad-" + uuid.uuid4().hex
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await system.dec.Decode(decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=_prompt(20), sampling=_greedy(4),
                kv_timeout_ms=2**31 - 1), timeout=RPC_S).read()
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "kv_timeout_ms" in e.value.details()
        stream = system.dec.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=_prompt(20),
                                                            sampling=_greedy(4)), timeout=RPC_S)
        kv = (await asyncio.wait_for(stream.read(), RPC_S)).kv_ready
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await system.dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
                request_id=rid, first_token=common_pb2.TokenLogprob(token_id=10**9)), timeout=RPC_S)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in e.value.details()
        dest = _dest(kv)
        dest.kv_endpoint = "loopback://999999"              # announced by nobody
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await system.pre.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=_prompt(20), sampling=_greedy(4), destination=dest),
                timeout=RPC_S)
        assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert (await system.dec.Abort(common_pb2.AbortRequest(request_id=rid), timeout=RPC_S)).found
        await _rest(stream)
        await system.wait_all_free()
    system.run(main())


def test_prefill_drops_work_whose_reservation_expired(system):
    """The reservation's deadline travels in the destination: a Prefill arriving after it
    is refused with DEADLINE_EXCEEDED (counted), and nothing stays held on either side."""
    async def main():
        before = (await system.pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S)).transfers.expirations
        rid, prompt = "late-" + uuid.uuid4().hex, _prompt(20, 7)
        stream = system.dec.Decode(decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(4), kv_timeout_ms=300,
            kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_FAIL), timeout=RPC_S)
        kv = (await asyncio.wait_for(stream.read(), RPC_S)).kv_ready
        assert kv.expires_at_unix_ms > 0
        await asyncio.sleep(0.5)                                   # past the 300 ms deadline
        dest = _dest(kv)
        assert dest.expires_at_unix_ms == kv.expires_at_unix_ms
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await system.pre.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=_greedy(4), destination=dest),
                timeout=RPC_S)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
        assert "expired" in e.value.details()
        after = (await system.pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S)).transfers.expirations
        assert after == before + 1
        await _rest(stream)
        await system.wait_all_free()
    system.run(main())
