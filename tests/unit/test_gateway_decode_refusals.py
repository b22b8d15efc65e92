"""How the gateway reads a decode worker's Decode stream that ends before KvReady: a refusal
(UNAVAILABLE, RESOURCE_EXHAUSTED, or CANCELLED from a worker whose server is stopping: it
cancels the calls that reach it during its grace) sends the request to another worker;
anything else is the request's error. Fake stubs stand in for the worker: the race with a
stopping server cannot be timed with a real one."""
import asyncio

import grpc
import pytest

from engine.sampling_params import SamplingParams
from gateway import registry
from gateway.config import GatewayConfig
from gateway.request import GatewayError
from gateway.segment import Segment, Segments


class _Call:
    def __init__(self, code):
        self.code = code

    async def read(self):
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "said no")


class _Worker:
    attach, detach, in_flight = registry.Worker.attach, registry.Worker.detach, registry.Worker.in_flight

    def __init__(self, code):
        self.kind, self.address, self.streams, self.requests_total = "decode", "w:1", set(), 0
        self.tokens_of, self.open_tokens = {}, 0
        self.healthy, self.errors = True, []
        self.stub = type("Stub", (), {"Decode": lambda _, req, **kw: _Call(code)})()

    def mark_failed(self, error):
        self.healthy = False
        self.errors.append(error)


@pytest.mark.parametrize("code,unhealthy", [(grpc.StatusCode.CANCELLED, True),
                                            (grpc.StatusCode.UNAVAILABLE, True),
                                            (grpc.StatusCode.RESOURCE_EXHAUSTED, False)])
def test_a_refusal_before_kv_ready_lets_another_worker_take_it(code, unhealthy):
    segs, w = Segments(None, GatewayConfig(disaggregation="always"), None), _Worker(code)
    seg = Segment("r1")

    async def reserve():
        return await segs._reserve(seg, w, [1, 2, 3], SamplingParams(), asyncio.get_running_loop().time() + 5)
    got = asyncio.run(reserve())
    assert isinstance(got, GatewayError)               # returned (try the next), not raised
    assert got.code == code and "said no" in str(got)
    assert w.healthy is not unhealthy
    assert w.in_flight == 0 and not w.streams and seg.decode is None


def test_other_errors_before_kv_ready_fail_the_request():
    segs, w = Segments(None, GatewayConfig(disaggregation="always"), None), _Worker(grpc.StatusCode.INVALID_ARGUMENT)

    async def reserve():
        return await segs._reserve(Segment("r1"), w, [1], SamplingParams(), asyncio.get_running_loop().time() + 5)
    with pytest.raises(GatewayError) as e:
        asyncio.run(reserve())
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and w.healthy and w.in_flight == 0
