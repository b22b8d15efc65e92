"""The TTFT waterfall (gateway/waterfall.py): the per-request clock and the recent-window
summary exactly, then the plumbing on real workers in one process (test_pd_inprocess's
System): PrefillResponse.timings agree with the response's older fields, and a request
through Gateway.generate() puts its phases into the summary, the histogram and a clock whose
phases add up to the time its first event took, as this test measured it."""
from __future__ import annotations

import time
import uuid

import pytest

from engine.sampling_params import SamplingParams
from gateway.request import GenerateInput
from gateway.waterfall import PHASES, PhaseClock, Waterfall, prefill_phases
from prometheus_client import CollectorRegistry
from protos.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from tests.unit.test_pd_inprocess import RPC_S, System, _dest, _greedy, _prompt
from tests.unit.test_pd_inprocess import model_dir  # noqa: F401  (fixture)


def test_clock_laps_and_splits_cover_the_whole_interval():
    c = PhaseClock(start=10.0)
    c.lap("gateway_queue", 10.002)
    c.lap("routing", 10.0025)
    c.lap("decode_reservation", 10.0045)
    # a 30 ms Prefill call whose worker reports 3 + 20 + 4 ms: 3 ms of transit -> queue
    c.split({"prefill_queue": 3.0, "prefill_compute": 20.0, "kv_transfer": 4.0},
            "prefill_queue", 10.0345)
    c.lap("decode_admission", 10.0355)
    c.stop("first_token_out", 10.0365)
    c.lap("routing", 11.0)                 # stopped: nothing more counts
    ms = c.phases_ms()
    assert list(ms) == [p for p in PHASES if p in ms]
    assert ms == pytest.approx({"gateway_queue": 2.0, "routing": 0.5, "decode_reservation": 2.0,
                                "prefill_queue": 6.0, "prefill_compute": 20.0,
                                "kv_transfer": 4.0, "decode_admission": 1.0,
                                "first_token_out": 1.0})
    assert c.ttft_ms == pytest.approx(36.5)
    # the spans tile the interval in order, no gap and no overlap
    assert c.spans[0][1] == 10.0 and c.spans[-1][2] == pytest.approx(10.0365)
    assert all(a[2] == pytest.approx(b[1]) for a, b in zip(c.spans, c.spans[1:]))


def test_a_worker_reporting_more_than_the_call_took_is_clamped():
    c = PhaseClock(start=0.0)
    c.split({"prefill_compute": 50.0, "kv_transfer": 5.0}, "prefill_queue", 0.040)
    assert c.ttft_ms == pytest.approx(40.0)
    assert c.ms["prefill_queue"] == pytest.approx(0.0) and c.ms["kv_transfer"] == pytest.approx(0.0)


def test_summary_percentiles_means_and_shares():
    reg = CollectorRegistry()
    w = Waterfall(reg, window=4)
    assert w.summary() == {"count": 0, "phases": {}}
    w.observe({"gateway_queue": 100.0})                    # falls out of the window of 4
    for q in (1.0, 2.0, 3.0):
        w.observe({"gateway_queue": q, "prefill_compute": 10.0 * q})
    w.observe({"gateway_queue": 4.0, "local_prefill": 20.0})
    s = w.summary()
    assert s["count"] == 4 and list(s["phases"]) == ["gateway_queue", "prefill_compute", "local_prefill"]
    g, p, lp = (s["phases"][k] for k in ("gateway_queue", "prefill_compute", "local_prefill"))
    assert (g["p50_ms"], g["p90_ms"], g["mean_ms"], g["count"]) == (3.0, 4.0, 2.5, 4)
    assert (p["p50_ms"], p["p90_ms"], p["count"]) == (20.0, 30.0, 3)
    assert p["mean_ms"] == pytest.approx(15.0)            # over all 4: the local one had none
    assert lp["mean_ms"] == pytest.approx(5.0)
    total = 2.5 + 15.0 + 5.0
    assert [x["share"] for x in (g, p, lp)] == pytest.approx([2.5 / total, 15 / total, 5 / total])
    assert sum(x["share"] for x in s["phases"].values()) == pytest.approx(1.0)
    count = reg.get_sample_value("pdserve:ttft_phase_seconds_count",
                                 {"role": "gateway", "phase": "gateway_queue"})
    assert count == 5
    assert reg.get_sample_value("pdserve:ttft_phase_seconds_sum",
                                {"role": "gateway", "phase": "local_prefill"}) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="unknown TTFT phases"):
        w.observe({"warp_drive": 1.0})


def test_each_phase_is_a_child_span_of_the_request():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from services import tracing
    exp = InMemorySpanExporter()
    assert tracing.setup_tracing("pdserve-test", exporter=exp)
    try:
        root = tracing.start_span("pdserve.generate")
        c = PhaseClock(start=100.0)
        c.lap("gateway_queue", 100.001)
        c.split({"prefill_compute": 2.0}, "prefill_queue", 100.004)
        c.stop("first_token_out", 100.005)
        Waterfall().observe_request(c, root)
        root.end()
        spans = exp.get_finished_spans()
        phases = [s for s in spans if s.name.startswith("pdserve.phase.")]
        assert [s.name for s in phases] == ["pdserve.phase.gateway_queue", "pdserve.phase.prefill_queue",
                                            "pdserve.phase.prefill_compute", "pdserve.phase.first_token_out"]
        gen = next(s for s in spans if s.name == "pdserve.generate")
        assert all(s.parent.span_id == gen.context.span_id for s in phases)
        durations = [(s.end_time - s.start_time) / 1e6 for s in phases]
        assert durations == pytest.approx([1.0, 1.0, 2.0, 1.0], abs=1e-3)
        assert all(a.end_time == b.start_time for a, b in zip(phases, phases[1:]))
    finally:
        tracing.shutdown_tracing()


@pytest.fixture(scope="module")
def system(model_dir):  # noqa: F811
    with System.started(model_dir) as s:
        yield s


def test_prefill_response_carries_its_phase_timings(system):
    prompt, n = _prompt(40, 5), 4

    async def main():
        rid = "timings-" + uuid.uuid4().hex
        stream = system.dec.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                                            sampling=_greedy(n)), timeout=RPC_S)
        kv = (await stream.read()).kv_ready
        resp = await system.pre.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(n), destination=_dest(kv)),
            timeout=RPC_S)
        await system.dec.Abort(common_pb2.AbortRequest(request_id=rid), timeout=RPC_S)
        await system.wait_all_free()
        return resp
    resp = system.run(main())
    t = resp.timings
    assert resp.HasField("timings") and t.queue_ms >= 0 and t.compute_ms > 0 and t.kv_tail_ms >= 0
    # the older fields, measured by the same clock: compute_ms = queue + compute
    assert t.queue_ms + t.compute_ms == pytest.approx(resp.compute_ms, rel=1e-4, abs=1e-3)
    assert t.kv_tail_ms == pytest.approx(resp.transfer_wait_ms, rel=1e-4, abs=1e-3)
    assert prefill_phases(resp) == {"prefill_queue": t.queue_ms, "prefill_compute": t.compute_ms,
                                    "kv_transfer": t.kv_tail_ms}
    assert prefill_phases(prefill_pb2.PrefillResponse()) == {}


def test_a_request_through_the_gateway_fills_the_waterfall(system):
    gw = system.gateway
    reg = gw.metrics.registry
    label = {"role": "gateway", "phase": "prefill_compute"}
    before = gw.waterfall.summary()["count"]
    hist_before = reg.get_sample_value("pdserve:ttft_phase_seconds_count", label) or 0

    async def main():
        inp = GenerateInput("wf-" + uuid.uuid4().hex, _prompt(30, 6),
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                            arrived=time.monotonic())
        at, last = [], None
        async for ev in gw.generate(inp):
            if ev.token_ids:
                at.append(time.monotonic())
            last = ev
        at.append(time.monotonic())      # the end: the bound when one event held every token
        await system.wait_all_free()
        return inp.arrived, at, last
    arrived, at, last = system.run(main())
    clock = last.usage.timings
    assert clock.done
    phases = clock.phases_ms()
    assert set(phases) == {"gateway_queue", "routing", "decode_reservation", "prefill_queue",
                           "prefill_compute", "kv_transfer", "decode_admission", "first_token_out"}
    assert all(v >= 0 for v in phases.values())
    # the clock ends when this loop took the first event: after it read the time, before the
    # second event came (or the stream ended: a fast decode can put every token in one event);
    # it started at `arrived`
    assert (at[0] - arrived) * 1e3 <= clock.ttft_ms <= (at[1] - arrived) * 1e3, (at, phases)
    assert gw.waterfall.summary()["count"] == before + 1
    assert reg.get_sample_value("pdserve:ttft_phase_seconds_count", label) == hist_before + 1


def test_a_local_request_has_the_local_shape(model_dir):  # noqa: F811
    """--disaggregation never: the decode worker computes the prompt; the phases are
    gateway_queue, routing, local_prefill, first_token_out, adding up as before."""
    with System.started(model_dir, gateway_config={"disaggregation": "never"}) as s:
        async def main():
            inp = GenerateInput("wfl-" + uuid.uuid4().hex, _prompt(30, 8),
                                SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                arrived=time.monotonic())
            at, last = [], None
            async for ev in s.gateway.generate(inp):
                if ev.token_ids:
                    at.append(time.monotonic())
                last = ev
            at.append(time.monotonic())  # the end: the bound when one event held every token
            await s.wait_all_free()
            return inp.arrived, at, last
        arrived, at, last = s.run(main())
        clock = last.usage.timings
        assert list(clock.phases_ms()) == ["gateway_queue", "routing", "local_prefill",
                                           "first_token_out"]
        assert (at[0] - arrived) * 1e3 <= clock.ttft_ms <= (at[1] - arrived) * 1e3
        assert s.gateway.waterfall.summary()["phases"]["local_prefill"]["count"] == 1
