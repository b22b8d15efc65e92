"""sim: conditional disaggregation runs gateway/disagg.py's rule in simulated time: never with
prefill workers is the colocated system exactly; auto keeps what is short local and
disaggregates a long prompt that arrives while the decode worker streams."""
from __future__ import annotations

import pytest

from sim.profile import example
from sim.system import SystemConfig, simulate
from sim.trace import TraceRecord

P = example()


def test_never_with_a_prefill_worker_is_the_colocated_system():
    trace = [TraceRecord(0.0, 300, 20), TraceRecord(50.0, 120, 10), TraceRecord(400.0, 700, 5)]
    colocated = simulate(P, SystemConfig(0, 1, 2), trace)
    never = simulate(P, SystemConfig(1, 1, 2, disaggregation="never"), trace)
    assert [r.ttft_s for r in never.requests] == pytest.approx([r.ttft_s for r in colocated.requests],
                                                               rel=1e-12)
    assert never.prefills == {"disaggregated": 0, "local": 3}
    assert never.utilisation["prefill"] == 0.0


def test_always_is_the_disaggregated_system():
    trace = [TraceRecord(0.0, 300, 20), TraceRecord(50.0, 120, 10)]
    before = simulate(P, SystemConfig(1, 1, 2), trace)
    always = simulate(P, SystemConfig(1, 1, 2, disaggregation="always"), trace)
    assert always == before and always.prefills == {"disaggregated": 2, "local": 0}


def test_auto_keeps_short_prompts_local_and_sends_a_long_one_past_a_busy_decoder():
    one = simulate(P, SystemConfig(1, 1, 2, disaggregation="auto"), [TraceRecord(0.0, 20, 5)])
    assert one.prefills == {"disaggregated": 0, "local": 1}
    # the first streams 400 tokens; a 2000-token prompt meanwhile would stall it past 50 ms
    cfg = SystemConfig(1, 1, 2, disaggregation="auto", disagg_max_stall_ms=50.0)
    assert P.prefill_s(2000, 0) > 0.05
    res = simulate(P, cfg, [TraceRecord(0.0, 20, 400), TraceRecord(200.0, 2000, 5)])
    assert res.prefills == {"disaggregated": 1, "local": 1}
    assert all(r.status == "ok" for r in res.requests)


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="--disaggregation must be one of"):
        simulate(P, SystemConfig(1, 1, 2, disaggregation="maybe"), [TraceRecord(0.0, 20, 5)])
