"""The prefill worker's admission (prefill_worker/admission.py): a queue bounded in tokens, a
wait bounded by K x the prompt's own cost, and no work taken that cannot finish before its
deadline; through real workers and
the gateway (one process, tests/unit/test_pd_inprocess.py's System): RESOURCE_EXHAUSTED from
the worker, then the gateway's refusal with a retry hint, and nothing held afterwards."""
from __future__ import annotations

import asyncio
import uuid
from collections import deque

import grpc
import numpy as np
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


FIXED_S, PER_TOKEN_S = 0.15, 0.008       # a CPU worker: 150 ms a call, 125 tokens/s


def _serve(a: PrefillAdmission, tokens: int, now: float, fixed=FIXED_S, per_token=PER_TOKEN_S) -> float:
    """One call of `tokens` computed alone from `now` at the true cost; returns its end."""
    a.started(tokens, now=now)
    end = now + fixed + per_token * tokens
    a.ended(tokens, computed=True, now=end)
    return end


def test_the_fit_is_numpys_least_squares_line_over_varied_prompts():
    """Calls of varied length, each with a little noise, then idle gaps (which count for
    nothing): the fitted (fixed, per-token) cost is numpy.polyfit's line through the same
    points, and close to the true one."""
    rng = np.random.default_rng(0)
    a, now, pts = PrefillAdmission(max_queued_tokens=100_000), 0.0, []
    for n in rng.integers(5, 1500, size=20):
        took = (FIXED_S + PER_TOKEN_S * n) * rng.uniform(0.95, 1.05)
        a.started(int(n), now=now)
        a.ended(int(n), computed=True, now=now + took)
        pts.append((n, took))
        now += took + rng.uniform(0, 30)
    fixed, per_token = a.cost()
    slope, intercept = np.polyfit([n for n, _ in pts], [t for _, t in pts], 1)
    assert (fixed, per_token) == (pytest.approx(intercept), pytest.approx(slope))
    assert per_token == pytest.approx(PER_TOKEN_S, rel=0.1)
    assert fixed == pytest.approx(FIXED_S, abs=0.1)


def test_short_prompts_then_a_long_one_an_idle_worker_admits_it():
    """The issue's case: after short prompts only, a 1,201-token prompt on an idle worker.
    Seeded by the warm-up (a short and a long prompt), the fit prices it at its true cost;
    without the seed the short prompts alone make the long one look slow (per-request
    overhead read as per-token), and the idle worker admits it anyway."""
    warm = [(256, FIXED_S + PER_TOKEN_S * 256), (8, FIXED_S + PER_TOKEN_S * 8)]
    for seeded in (True, False):
        a, now = PrefillAdmission(max_queued_tokens=65536), 100.0
        if seeded:
            a.seed(warm)
        for _ in range(40):                       # more than max_samples: only shorts kept
            now = _serve(a, 20, now) + 1.0
        assert a.refusal(1201, seconds_left=30.0, now=now) is None
        true_s = FIXED_S + PER_TOKEN_S * 1201     # 9.8 s
        if seeded:
            assert a.estimate(1201) == pytest.approx(true_s, rel=0.02)
        else:
            assert a.estimate(1201) > 1.5 * true_s          # the old mistake, kept harmless
        assert a.refusal(1201, seconds_left=1.0, now=now) is None   # idle: alone, never refused


def test_a_busy_worker_refuses_what_its_real_queue_cannot_finish_in_time():
    """Three 1,201-token prompts queued (~29.4 s of work at the true cost): another long
    prompt would finish at ~39 s, past a 30 s reservation, and is refused with the figures;
    a short one (~29.7 s) still fits. Once the worker has spent 10 busy seconds on the
    queue, the long one fits again (the backlog counts only the work left)."""
    a, now = PrefillAdmission(max_queued_tokens=65536), 0.0
    for n in (8, 256, 1000, 40, 600):
        now = _serve(a, n, now) + 5.0
    for _ in range(3):
        a.started(1201, now=now)
    assert a.backlog_s(now) == pytest.approx(3 * (FIXED_S + PER_TOKEN_S * 1201), rel=0.01)
    why = a.refusal(1201, seconds_left=30.0, now=now)
    assert why is not None and "cannot finish in time" in why and "3 call(s) queued" in why
    assert a.refusal(20, seconds_left=30.0, now=now) is None
    assert a.refusal(1201, seconds_left=30.0, now=now + 10.0) is None
    assert a.refusal(1201, seconds_left=None, now=now) is None      # no deadline: bound only


def test_the_slowdown_bound_refuses_a_wait_over_k_times_the_prompts_own_cost():
    """With --max-queue-delay-factor 10 and three 1,201-token prompts queued (~29.4 s of
    work): a 100-token prompt (~0.95 s alone) would wait over 10x that and is refused, with
    the figures; another 1,201-token one (~9.8 s alone, 98 s allowed) is admitted, and so is
    the short one once the queue is down to a few seconds; an idle worker refuses nothing
    and a wait under MIN_QUEUE_DELAY_S is never refused; factor 0 is off."""
    a, now = PrefillAdmission(max_queued_tokens=65536, max_queue_delay_factor=10), 0.0
    for n in (8, 256, 1000, 40, 600):
        now = _serve(a, n, now) + 5.0
    assert a.refusal(100, seconds_left=None, now=now) is None      # idle
    for _ in range(3):
        a.started(1201, now=now)
    why = a.refusal(100, seconds_left=None, now=now)
    assert why is not None and "prefill queue too long" in why and "over 10x" in why, why
    assert a.refused == 1
    assert a.refusal(1201, seconds_left=None, now=now) is None
    assert a.refusal(100, seconds_left=None, now=now + 21.0) is None   # ~8.4 s left < 9.5 s
    b = PrefillAdmission(max_queued_tokens=65536, max_queue_delay_factor=2)
    for n in (8, 256):
        now = _serve(b, n, now) + 5.0
    b.started(60, now=now)                                          # ~0.63 s ahead
    assert b.refusal(1, seconds_left=None, now=now) is None         # over 2x 0.16 s, under 1 s
    b.started(60, now=now)                                          # ~1.26 s ahead
    assert b.refusal(1, seconds_left=None, now=now) is not None
    off = PrefillAdmission(max_queued_tokens=65536)
    for n in (8, 256):
        now = _serve(off, n, now) + 5.0
    for _ in range(30):
        off.started(1201, now=now)
    assert off.refusal(1, seconds_left=None, now=now) is None


def test_the_fit_is_clamped_to_a_positive_cost():
    """Noise that makes longer prompts look faster cannot give a negative per-token cost,
    and a steep line cannot give a negative fixed one."""
    a = PrefillAdmission(max_queued_tokens=100_000)
    a.seed([(10, 0.5), (1000, 0.4)])
    fixed, per_token = a.cost()
    assert per_token > 0 and fixed == pytest.approx(0.45, rel=1e-3)
    a.seed([(10, 0.001), (1000, 2.0)])
    fixed, per_token = a.cost()
    assert fixed == 0.0 and per_token > 0
    assert a.estimate(1000) == pytest.approx(2.0, rel=0.01)


def test_samples_count_busy_seconds_only_and_skip_an_interval_with_a_dropped_call():
    a = PrefillAdmission(max_queued_tokens=10_000)
    assert a.cost() is None and a.refusal(5000, seconds_left=0.1, now=0.0) is None
    a.started(100, now=0.0)
    a.started(100, now=0.5)
    a.ended(100, computed=True, now=1.0)          # 1 busy second
    a.ended(100, computed=True, now=2.0)          # 1 more (queued behind it)
    a.started(300, now=50.0)                      # 48 idle seconds count for nothing
    a.ended(300, computed=True, now=53.0)
    assert a._samples == deque([(100, 1.0), (100, 1.0), (300, 3.0)])
    a.started(50, now=60.0)
    a.started(70, now=60.0)
    a.ended(50, computed=False, now=61.0)         # dropped: its work is in the interval
    a.ended(70, computed=True, now=65.0)          # so this one gives no sample
    a.started(30, now=70.0)
    a.ended(30, computed=True, now=71.0)
    assert list(a._samples)[3:] == [(30, 1.0)]


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
