"""The prefill worker's admission (prefill_worker/admission.py): a queue bounded in tokens and
no work taken that cannot finish before its reservation expires; through real workers and
the gateway (one process, tests/unit/test_pd_inprocess.py's System): RESOURCE_EXHAUSTED from
the worker, then the gateway's refusal with a retry hint, and nothing held afterwards."""
from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from engine.sampling_params import SamplingParams
from gateway.request import GatewayError, GenerateInput
from prefill_worker.admission import PrefillAdmission
from protos.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2

from .test_pd_inprocess import RPC_S, System, _dest, _greedy, _prompt, _rest

LONG, SHORT, BOUND = 400, 20, 410      # LONG alone fits the bound, LONG + SHORT does not


def test_the_bound_refuses_only_when_something_is_queued():
    a = PrefillAdmission(max_queued_tokens=100)
    assert a.refusal(500, None, now=0.0) is None            # alone: served, however long
    a.started(500, now=0.0)
    assert "queue full" in a.refusal(1, None, now=0.0)
    a.ended(500, computed=True, now=1.0)
    assert a.queued == 0 and a.refusal(100, None, now=1.0) is None


def test_the_rate_counts_busy_seconds_only_and_refuses_what_cannot_finish_in_time():
    a = PrefillAdmission(max_queued_tokens=10_000, window_s=10.0)
    assert a.rate(0.0) is None
    a.started(100, now=0.0)
    a.started(100, now=0.5)
    a.ended(100, computed=True, now=1.0)
    a.ended(100, computed=True, now=2.0)          # 200 tokens in 2 busy seconds
    assert a.rate(2.0) == pytest.approx(100.0)
    a.started(300, now=50.0)                      # 48 idle seconds count for nothing
    a.ended(300, computed=True, now=53.0)         # 300 tokens in 3 more busy seconds
    assert a.rate(53.0) == pytest.approx(100.0)
    a.started(50, now=53.0)
    a.ended(50, computed=False, now=60.0)         # dropped: no sample (its busy time counts
    assert a.rate(60.0) == pytest.approx(100.0)   # in the next one)
    a.started(300, now=60.0)
    assert a.refusal(300, seconds_left=7.0, now=60.0) is None      # 600 tokens at 100/s: 6 s
    why = a.refusal(300, seconds_left=5.0, now=60.0)
    assert why is not None and "cannot finish in time" in why
    assert a.refusal(300, seconds_left=None, now=60.0) is None     # no deadline: bound only


@pytest.fixture(scope="module")
def system(model_dir):
    with System.started(model_dir, prefill_options={"max_num_batched_tokens": 4},  # 100 steps
                        prefill_config={"max_queued_prefill_tokens": BOUND}) as s:
        yield s


@pytest.fixture(scope="module")
def model_dir():
    from engine.tiny_model import ensure_default_model
    return str(ensure_default_model())


async def _reserve(system, rid, prompt):
    stream = system.dec.Decode(decode_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=_greedy(2)), timeout=RPC_S)
    return stream, (await asyncio.wait_for(stream.read(), RPC_S)).kv_ready


def test_a_full_prefill_queue_refuses_then_the_gateway_answers_resource_exhausted(system):
    """A long prompt computing (chunked: 4 tokens a step) fills the queue: a second Prefill
    is refused with RESOURCE_EXHAUSTED naming the bound, and a request through the gateway
    (one prefill worker: nowhere to retry) fails RESOURCE_EXHAUSTED with a retry hint. Once
    the long one is done, the same short prompt is served; every block comes back."""
    async def main():
        long_rid, long_prompt = "long-" + uuid.uuid4().hex, _prompt(LONG, 1)
        stream, kv = await _reserve(system, long_rid, long_prompt)
        long_call = system.pre.Prefill(prefill_pb2.PrefillRequest(
            request_id=long_rid, prompt_token_ids=long_prompt, sampling=_greedy(2),
            destination=_dest(kv)), timeout=RPC_S)
        while (await system.pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S)).queued_prefill_tokens == 0:
            await asyncio.sleep(0.005)
        short_rid, short_prompt = "short-" + uuid.uuid4().hex, _prompt(SHORT, 2)
        short_stream, short_kv = await _reserve(system, short_rid, short_prompt)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await system.pre.Prefill(prefill_pb2.PrefillRequest(
                request_id=short_rid, prompt_token_ids=short_prompt, sampling=_greedy(2),
                destination=_dest(short_kv)), timeout=RPC_S)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "prefill queue full" in e.value.details()
        await system.dec.Abort(common_pb2.AbortRequest(request_id=short_rid), timeout=RPC_S)
        await _rest(short_stream)

        inp = GenerateInput("gw-" + uuid.uuid4().hex, _prompt(SHORT, 3),
                            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        with pytest.raises(GatewayError) as ge:
            async for _ in system.gateway.generate(inp):
                pass
        assert ge.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, ge.value.message
        assert ge.value.retry_after_s is not None and 1 <= ge.value.retry_after_s <= 60

        first = await long_call
        await system.dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
            request_id=long_rid, first_token=first.first_token), timeout=RPC_S)
        await _rest(stream)
        inp = GenerateInput("gw-" + uuid.uuid4().hex, _prompt(SHORT, 3),
                            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        tokens = [t async for ev in system.gateway.generate(inp) for t in ev.token_ids]
        assert len(tokens) == 2
        await system.wait_all_free()
    system.run(main())
