"""The gateway's admission (gateway/admission.py): the in-flight cap and the SLO limit (AIMD,
on a fake clock), then through a Gateway over real in-process workers; and the gRPC server
options (services/grpc_options.py) that let a burst of streams through to the servicer."""
from __future__ import annotations

import asyncio
import collections
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from engine.sampling_params import SamplingParams
from gateway import admission
from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.request import GatewayError, GenerateInput
from services.grpc_options import SERVER_OPTIONS

from .test_pd_inprocess import System, _prompt


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_in_flight_cap_refuses_at_the_maximum():
    a = Admission(max_in_flight=3)
    assert a.refusal(2) is None
    assert "maximum" in a.refusal(3)
    assert a.refused == 1


def test_without_slos_latency_never_refuses():
    clock = Clock()
    a = Admission(max_in_flight=100, clock=clock)
    for _ in range(10):
        a.first_token(60.0)
        a.tokens(60.0, 1)
        clock.t += 1.0
        assert a.refusal(50) is None


def test_a_broken_ttft_slo_cuts_the_limit_below_the_peak_then_it_grows_back():
    clock = Clock()
    a = Admission(max_in_flight=1000, slo_ttft_s=0.1, clock=clock)
    for n in range(40):                     # 40 admitted, nothing over the SLO yet
        assert a.refusal(n) is None
    for _ in range(10):
        a.first_token(0.5)                  # p90 over the 100 ms SLO
    clock.t += admission.ADJUST_S
    assert a.refusal(40) is not None        # the adjustment: 40 in flight x DECREASE = 32
    assert a.limit == pytest.approx(40 * admission.DECREASE)
    assert a.refusal(31) is None
    assert "SLO" in a.refusal(32)
    limit = a.limit
    for _ in range(10):                     # the interval after a cut only observes
        a.first_token(0.5)
    clock.t += admission.ADJUST_S
    a.refusal(32)
    assert a.limit == limit
    for _ in range(10):                     # latency back within the SLO, the limit reached:
        a.first_token(0.05)                 # it grows by INCREASE (at least 1) per interval
    clock.t += admission.ADJUST_S
    a.refusal(32)
    assert a.limit == pytest.approx(limit + max(1, admission.INCREASE * limit))
    clock.t += admission.ADJUST_S           # under the SLO but the limit not reached: no growth
    for _ in range(10):
        a.first_token(0.05)
    a.refusal(3)
    clock.t += admission.ADJUST_S
    for _ in range(10):
        a.first_token(0.05)
    before = a.limit
    a.refusal(3)
    assert a.limit == before


def test_an_interval_waits_for_enough_first_tokens():
    clock = Clock()
    a = Admission(max_in_flight=1000, slo_ttft_s=0.1, clock=clock)
    a.refusal(39)                           # admitted: 40 in flight
    for _ in range(admission.MIN_SAMPLES - 1):
        a.first_token(0.5)
    clock.t += admission.ADJUST_S
    a.refusal(39)
    assert a.limit == 1000                  # 9 samples: not yet judged
    clock.t = admission.MAX_INTERVALS * admission.ADJUST_S
    a.refusal(39)
    assert a.limit == pytest.approx(40 * admission.DECREASE)   # judged once the wait is over


def test_a_broken_itl_slo_cuts_the_limit_and_it_never_drops_below_one():
    clock = Clock()
    a = Admission(max_in_flight=1000, slo_itl_s=0.02, clock=clock)
    for _ in range(30):
        a.tokens(0.5, 10)                   # 50 ms per token, SLO 20 ms
        clock.t += admission.ADJUST_S
        a.refusal(0)
    assert a.limit == 1.0
    assert a.refusal(0) is None and a.refusal(1) is not None


def test_a_burst_of_streams_on_a_server_with_these_options_is_never_cancelled():
    """grpc-core cancels calls at random once more than 1,000 wait to be picked up (see
    services/grpc_options.py): 2,500 health Watch streams opened at once on one channel all
    get their first message."""
    async def main():
        server = grpc.aio.server(options=SERVER_OPTIONS)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        results = collections.Counter()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            gate = asyncio.Event()

            async def watch():
                call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
                try:
                    await call.read()
                    results["ok"] += 1
                    await gate.wait()            # hold every stream open until all answered
                except grpc.aio.AioRpcError as e:
                    results[e.code().name] += 1
                finally:
                    call.cancel()

            tasks = [asyncio.create_task(watch()) for _ in range(2500)]
            while sum(results.values()) < len(tasks) and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
            gate.set()
            await asyncio.gather(*tasks)
        await server.stop(None)
        assert results == {"ok": 2500}, results
    asyncio.run(asyncio.wait_for(main(), 120))


@pytest.fixture(scope="module")
def model_dir():
    from engine.tiny_model import ensure_default_model
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def system(model_dir):
    with System.started(model_dir) as s:
        yield s


def _input(max_tokens: int) -> GenerateInput:
    return GenerateInput("adm-" + uuid.uuid4().hex, _prompt(12, 5),
                         SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def _run(gw: Gateway, inp: GenerateInput) -> int:
    return sum([len(ev.token_ids) async for ev in gw.generate(inp)])


async def _gateway(system, **cfg) -> Gateway:
    workers = system.gateway.cfg
    gw = Gateway(GatewayConfig(model=system.model_dir, prefill=workers.prefill,
                               decode=workers.decode, **cfg))
    await gw.start()
    return gw


def test_the_gateway_refuses_past_max_in_flight_with_a_retry_hint(system):
    async def main():
        gw = await _gateway(system, max_in_flight=1)
        try:
            long = asyncio.ensure_future(_run(gw, _input(300)))
            while gw.in_flight == 0:
                await asyncio.sleep(0.005)
            with pytest.raises(GatewayError) as e:
                await _run(gw, _input(2))
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "maximum" in e.value.message
            assert 1 <= e.value.retry_after_s <= 60
            assert await long == 300
            assert await _run(gw, _input(2)) == 2        # room again
        finally:
            await gw.stop()
        await system.wait_all_free()
    system.run(main())


def test_the_gateway_sheds_load_once_its_itl_slo_breaks(system):
    """An ITL SLO no CPU can keep (1 us per token): after one request and the longest
    adjustment interval the limit is 1, so a second request while one runs is refused; nothing is held
    afterwards."""
    async def main():
        gw = await _gateway(system, slo_itl_ms=0.001)
        try:
            assert await _run(gw, _input(20)) == 20
            await asyncio.sleep(admission.MAX_INTERVALS * admission.ADJUST_S)
            long = asyncio.ensure_future(_run(gw, _input(300)))
            while gw.in_flight == 0:
                await asyncio.sleep(0.005)
            assert gw.admission.limit == 1.0
            with pytest.raises(GatewayError) as e:
                await _run(gw, _input(2))
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "SLO" in e.value.message and e.value.retry_after_s >= 1
            assert await long == 300
        finally:
            await gw.stop()
        await system.wait_all_free()
    system.run(main())
