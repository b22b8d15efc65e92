"""A Prefill's retries (gateway/worker_errors.py PrefillRetries, through Segments): a prefill
worker's death costs the request nothing (its work goes to the other workers in turn, the
ones that refused it before included), a refusal or other failure is retried once. Real
Segments, Worker objects and pools; fake stubs in place of the workers' RPCs
(test_segment_accounting.py's), so the order of refusals and deaths is exact."""
import asyncio

import grpc
import pytest

from gateway.request import GatewayError
from gateway.worker_errors import PrefillRetries

from .test_segment_accounting import FIRST, KV_READY, _balanced, _rpc_error, _run_segment

pytestmark = pytest.mark.timeout(30)

REFUSED = grpc.StatusCode.RESOURCE_EXHAUSTED
DIED = grpc.StatusCode.UNAVAILABLE


def _prefill_calls(prefill) -> list[int]:
    return [len(w.stub.calls) for w in prefill.workers.values()]


def test_a_refusal_then_a_death_is_requeued_on_the_worker_that_refused():
    """The issue's burst: a request refused by one prefill worker (the stale estimate's
    refusal spends its one charged retry) goes to the other, which dies: it is requeued
    on the first, which takes it. Before, the death ended it with 503."""
    async def main():
        got, seg, decode, prefill = await _run_segment(
            [KV_READY], [[_rpc_error(REFUSED), FIRST], [_rpc_error(DIED)]])
        kv, resp = got
        assert resp.first_token.token_id == 5 and seg.rid == "r1#r1#r2"
        assert _prefill_calls(prefill) == [2, 1]
        _balanced(decode, prefill)
        d = decode.workers["decode:0"]
        assert d.requests_total == 3                  # a fresh reservation each attempt
        assert d.stub.aborted[:2] == ["r1", "r1#r1"]  # the first two let go
        assert not prefill.workers["prefill:1"].healthy
    asyncio.run(main())


def test_deaths_are_free_until_the_pool_is_spent():
    async def main():
        got, seg, decode, prefill = await _run_segment(
            [KV_READY], [[_rpc_error(DIED)], [_rpc_error(DIED)], [FIRST]])
        assert got[1].first_token.token_id == 5 and _prefill_calls(prefill) == [1, 1, 1]
        _balanced(decode, prefill)

        got, seg, decode, prefill = await _run_segment(
            [KV_READY], [[_rpc_error(DIED)], [_rpc_error(DIED)]])
        assert isinstance(got, GatewayError) and got.code == DIED
        _balanced(decode, prefill)
    asyncio.run(main())


def test_refusals_get_one_retry_even_around_a_death():
    """Refused by both: RESOURCE_EXHAUSTED after one retry (the gateway's 429). Refused,
    then a death, then refused again by the survivor: RESOURCE_EXHAUSTED, three attempts."""
    async def main():
        got, seg, decode, prefill = await _run_segment(
            [KV_READY], [[_rpc_error(REFUSED)], [_rpc_error(REFUSED)], [FIRST]])
        assert isinstance(got, GatewayError) and got.code == REFUSED
        assert _prefill_calls(prefill) == [1, 1, 0]
        _balanced(decode, prefill)

        got, seg, decode, prefill = await _run_segment(
            [KV_READY], [[_rpc_error(REFUSED), _rpc_error(REFUSED)], [_rpc_error(DIED)]])
        assert isinstance(got, GatewayError) and got.code == REFUSED
        assert _prefill_calls(prefill) == [2, 1]
        _balanced(decode, prefill)
    asyncio.run(main())


def test_the_policy_alone():
    r = PrefillRetries()
    assert r.failed(REFUSED, "p0") and r.exclude() == ["p0"]
    assert r.failed(DIED, "p1") and r.exclude() == ["p1"]       # p0 may take it again
    assert not r.failed(REFUSED, "p0") and r.exclude() == ["p1", "p0"]
    assert not PrefillRetries().failed(grpc.StatusCode.INVALID_ARGUMENT, "p0")
    d = PrefillRetries()
    assert d.failed(DIED, None) and not d.failed(DIED, None)   # a KV destination's fault: once


def test_a_lapsed_reservation_fails_the_request_before_its_first_event():
    """The burst's failures after a 200: the decode worker no longer takes the first token
    (its reservation lapsed while the prefill ran). The gateway hands the first token to the
    client only once SubmitFirstToken was accepted, so the request fails before any event
    (the REST shim's status comes with the first event: a 429, not an error after a 200),
    RESOURCE_EXHAUSTED (try again later), and lets both workers go."""
    from engine.output_processor import OutputProcessor
    from engine.sampling_params import SamplingParams
    from engine.tiny_model import ensure_default_model
    from engine.tokenizer import Tokenizer
    from gateway.config import GatewayConfig
    from gateway.request import GenerateInput, RequestState
    from gateway.routing import Router
    from gateway.segment import Segments
    from services.metrics import Metrics

    from .test_segment_accounting import _pool

    tok = Tokenizer.from_dir(str(ensure_default_model()))

    async def main():
        decode, prefill = _pool("decode", [KV_READY]), _pool("prefill", [FIRST])
        d = decode.workers["decode:0"]
        d.stub.accept_first = False
        segs = Segments(Router(prefill, decode, 16, 1.5), GatewayConfig(disaggregation="always"), Metrics("gateway"))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        req = RequestState(GenerateInput("r1", [1, 2, 3], params),
                           OutputProcessor(tok, [1, 2, 3], params, 64),
                           deadline=asyncio.get_running_loop().time() + 10, timeout_s=10,
                           timer=None, span=None)
        events = []
        with pytest.raises(GatewayError) as e:
            async for ev in segs.run(req):
                events.append(ev)
        await segs.drain()
        assert events == [] and e.value.code == REFUSED, e.value.message
        assert "did not accept the first token" in e.value.message
        _balanced(decode, prefill)
        assert d.stub.aborted == ["r1"]
        for w in [*decode.workers.values(), *prefill.workers.values()]:
            await w.close()
    asyncio.run(main())
