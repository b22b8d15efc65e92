"""The gateway's per-worker accounting (Worker.attach / detach, through Segment): every call a
segment opens is counted on its worker until the call ends or cleanup() lets it go, on every
way out: a refused reservation, a failed Prefill and its retry, a failed retry, a caller that
went away. Real Worker objects and pools, fake stubs in place of the workers' RPCs."""
import asyncio
from types import SimpleNamespace

import grpc
import pytest

from engine.sampling_params import SamplingParams
from gateway import registry
from gateway.config import GatewayConfig
from gateway.request import GatewayError
from gateway.routing import Router
from gateway.segment import Segment, Segments
from gateway.waterfall import PhaseClock
from protos.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from services.metrics import Metrics

pytestmark = pytest.mark.timeout(30)


def _rpc_error(code):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "fake says no")


class _Call:
    """A unary Prefill (awaited) or a Decode stream (read()); `outcome`: the response, an
    exception to raise, or None to wait until cancelled."""

    def __init__(self, outcome):
        self.outcome, self.cancelled = outcome, False

    async def _result(self):
        if self.outcome is None:
            await asyncio.Event().wait()          # until the caller is cancelled
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def __await__(self):
        return self._result().__await__()

    read = _result

    def cancel(self):
        self.cancelled = True


class _Stub:
    """`outcome`: every call's, or a list: one per call, in order."""

    def __init__(self, outcome):
        self.outcome, self.aborted, self.calls = outcome, [], []

    def _next(self, req):
        self.calls.append(req.request_id)
        return _Call(self.outcome.pop(0) if isinstance(self.outcome, list) else self.outcome)

    def Decode(self, req, **kw):                  # noqa: N802 (the RPC's name)
        return self._next(req)

    def Prefill(self, req, **kw):                 # noqa: N802
        return self._next(req)

    async def SubmitFirstToken(self, req, **kw):  # noqa: N802
        self.calls.append(req.request_id)
        return decode_pb2.SubmitFirstTokenResponse(accepted=self.accept_first)

    accept_first = True

    async def Abort(self, req, **kw):             # noqa: N802
        self.aborted.append(req.request_id)
        return common_pb2.AbortResponse(found=True)


KV_READY = decode_pb2.DecodeResponse(kv_ready=decode_pb2.KvReady(
    transfer_id="t", kv_endpoint="loopback://1", block_ids=[1]))
FIRST = prefill_pb2.PrefillResponse(first_token=common_pb2.TokenLogprob(token_id=5))


def _pool(kind, outcomes):
    pool = registry.WorkerPool(kind, None, 3600, 1)
    for i, outcome in enumerate(outcomes):
        w = registry.Worker(kind, f"{kind}:{i}", lambda ch, o=outcome: _Stub(o))
        w.healthy = True
        pool.workers[w.address] = w
    return pool


async def _run_segment(decode_outcomes, prefill_outcomes, cancel_in_prefill=False):
    """One segment's reservation and Prefill (with its retry), then cleanup(), as
    Segments.run does; `cancel_in_prefill`: its caller goes away once a Prefill is open.
    Returns (what it raised or returned, the segment, the decode and prefill pools)."""
    decode, prefill = _pool("decode", decode_outcomes), _pool("prefill", prefill_outcomes)
    segs = Segments(Router(prefill, decode, 16, 1.5), GatewayConfig(disaggregation="always"), Metrics("gateway"))
    req = SimpleNamespace(lost=set(), deadline=asyncio.get_running_loop().time() + 10,
                          clock=PhaseClock())
    seg = Segment("r1")

    async def one():
        try:
            return await segs._prefill_with_retry(seg, [1, 2, 3], SamplingParams(), req)
        finally:
            segs.cleanup(seg)
    task = asyncio.create_task(one())
    if cancel_in_prefill:
        for _ in range(1000):                     # no sleeps: let the loop run the task
            await asyncio.sleep(0)
            if any(w.in_flight for w in prefill.workers.values()):
                break
        assert any(w.in_flight for w in prefill.workers.values()), "no Prefill opened"
        task.cancel()
    got = (await asyncio.gather(task, return_exceptions=True))[0]
    await segs.drain()
    for w in [*decode.workers.values(), *prefill.workers.values()]:
        await w.close()
    return got, seg, decode, prefill


def _balanced(*pools):
    for pool in pools:
        for w in pool.workers.values():
            assert w.in_flight == 0 and not w.streams, (w.address, w.streams)


def test_a_failed_prefill_retried_elsewhere_balances_every_count():
    async def main():
        got, seg, decode, prefill = await _run_segment(
            [KV_READY], [_rpc_error(grpc.StatusCode.UNAVAILABLE), FIRST])
        kv, resp = got
        assert resp.first_token.token_id == 5 and seg.rid == "r1#r1"
        _balanced(decode, prefill)
        d = decode.workers["decode:0"]
        assert d.requests_total == 2                 # a fresh reservation for the retry
        assert [w.requests_total for w in prefill.workers.values()] == [1, 1]
        assert d.stub.aborted == ["r1", "r1#r1"]     # the first reservation, then cleanup's
        assert prefill.workers["prefill:0"].stub.aborted == ["r1"]
        assert not prefill.workers["prefill:0"].healthy
    asyncio.run(main())


def test_a_failed_retry_fails_the_request_and_balances_every_count():
    async def main():
        got, seg, decode, prefill = await _run_segment(
            [KV_READY], [_rpc_error(grpc.StatusCode.INTERNAL)] * 2)
        assert isinstance(got, GatewayError) and got.code == grpc.StatusCode.INTERNAL
        _balanced(decode, prefill)
        assert seg.decode is seg.prefill is None
        assert decode.workers["decode:0"].requests_total == 2
    asyncio.run(main())


def test_refused_and_broken_reservations_are_let_go():
    async def main():
        # the first decode worker refuses (RESOURCE_EXHAUSTED), the second starts wrong
        got, seg, decode, prefill = await _run_segment(
            [_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED),
             decode_pb2.DecodeResponse()], [FIRST])
        assert isinstance(got, GatewayError) and "did not start with KvReady" in got.message
        _balanced(decode, prefill)
        assert [w.requests_total for w in decode.workers.values()] == [1, 1]
        assert [w.requests_total for w in prefill.workers.values()] == [0]
    asyncio.run(main())


def test_a_caller_gone_mid_prefill_lets_both_workers_go():
    async def main():
        got, seg, decode, prefill = await _run_segment([KV_READY], [None], cancel_in_prefill=True)
        assert isinstance(got, asyncio.CancelledError)
        _balanced(decode, prefill)
        assert decode.workers["decode:0"].stub.aborted == ["r1"]
        assert prefill.workers["prefill:0"].stub.aborted == ["r1"]
    asyncio.run(main())


def test_attach_twice_and_retry_while_attached_are_refused():
    async def main():
        w = registry.Worker("decode", "d:0", lambda ch: _Stub(KV_READY))
        seg = Segment("r1")
        seg.attach_decode(w, _Call(KV_READY))
        assert w.in_flight == 1 and w.requests_total == 1 and seg in w.streams
        with pytest.raises(RuntimeError, match="attached twice"):
            w.attach(seg)
        with pytest.raises(RuntimeError, match="retried while"):
            seg.retry(1)
        seg.detach(w)
        seg.detach(w)                                # a second detach changes nothing
        seg.detach(None)
        assert w.in_flight == 0 and w.requests_total == 1 and seg.decode is None
        seg.retry(1)
        assert seg.rid == "r1#r1"
        await w.close()
    asyncio.run(main())
