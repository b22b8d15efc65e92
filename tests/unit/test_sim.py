"""sim.system: the simulator's timing against references computed here from the profile's
cost functions (sim.profile.example()) and against queueing theory: one request's TTFT and
ITL exactly, M/D/1 waiting (Lindley's recursion exactly, the Pollaczek-Khinchine mean within
a few %), prefix sharing, processor sharing, colocated steps, determinism, the event count."""
from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import fields

import pytest

from sim.cores import Cores
from sim.profile import example
from sim.stats import SUMMARY_KEYS
from sim.system import KV_MAX_RESERVATION_S, SystemConfig, simulate
from sim.trace import TraceRecord
from sim.workers import fixed_cost

P = example()


def one(n: int, out: int, **kw) -> "object":
    return simulate(P, SystemConfig(**{"prefill": 1, "decode": 1, "cores": 2, **kw}),
                    [TraceRecord(0.0, n, out)]).requests[0]


def test_one_request_ttft_is_gateway_plus_prefill_plus_handover():
    r = one(300, 10)
    assert r.status == "ok"
    assert r.ttft_s == pytest.approx(P.gateway_s + P.prefill_s(300, 0) + P.handover_s(300), rel=1e-12)


def test_a_chunked_prompt_costs_its_chunks_each_after_the_ones_before():
    r = one(2500, 2, max_num_batched_tokens=1024)
    chunks = P.prefill_s(1024, 0) + P.prefill_s(1024, 1024) + P.prefill_s(452, 2048)
    assert r.ttft_s == pytest.approx(P.gateway_s + chunks + P.handover_s(2500), rel=1e-12)


def test_one_decode_stream_itl_is_the_decode_step_of_its_context():
    n, out = 300, 12
    r = one(n, out)
    steps = [P.decode_s(1, n + k) for k in range(1, out)]     # token k+1 from a context of n+k
    assert r.itl_s == pytest.approx(sum(steps) / len(steps), rel=1e-12)
    assert r.e2e_s == pytest.approx(r.ttft_s + sum(steps), rel=1e-12)
    assert r.output_tokens == out


def _poisson(rate: float, count: int, n: int, seed: int, out: int = 1) -> list[TraceRecord]:
    rng, t, trace = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        trace.append(TraceRecord(t * 1e3, n, out))
    return trace


def test_prefill_queueing_is_m_d_1():
    """One prefill worker taking one prompt a step (the budget is one prompt) is an M/D/1
    queue of service D = prefill_s(n): each request's wait follows Lindley's recursion
    exactly, and the mean wait is rho D / (2 (1 - rho)) (Pollaczek-Khinchine)."""
    n, rho = 64, 0.5
    d = P.prefill_s(n, 0)
    base = P.gateway_s + d + P.handover_s(n)
    waits, expected = [], []
    for seed in range(3):
        trace = _poisson(rho / d, 3000, n, seed)
        res = simulate(P, SystemConfig(1, 1, 2, max_num_batched_tokens=n), trace)
        w, prev = 0.0, None
        for rec, r in zip(trace, res.requests):
            t = rec.timestamp_ms / 1e3
            w = 0.0 if prev is None else max(0.0, w + d - (t - prev))
            prev = t
            assert r.status == "ok"
            expected.append(w)
            waits.append(r.ttft_s - base)
    assert waits == pytest.approx(expected, abs=1e-9)
    mean = sum(waits) / len(waits)
    assert mean == pytest.approx(rho * d / (2 * (1 - rho)), rel=0.08)


def test_a_shared_prefix_is_a_prefix_hit_on_both_sides():
    """The second request shares the first's two 512-token blocks: the prefill worker computes
    only what its cache lacks (the engine leaves one block's tokens to sample from), the
    decode worker holds the whole prompt cached, so nothing is handed over."""
    a = TraceRecord(0.0, 1024, 2, (7, 8))
    b = TraceRecord(60_000.0, 1024, 2, (7, 8))
    c = TraceRecord(120_000.0, 1024, 2, (9, 10))
    res = simulate(P, SystemConfig(1, 1, 2), [a, b, c])
    first, second, other = res.requests
    assert second.ttft_s == pytest.approx(P.gateway_s + P.prefill_s(16, 1008), rel=1e-12)
    assert second.ttft_s < first.ttft_s / 10
    assert other.ttft_s == pytest.approx(first.ttft_s, rel=1e-12)
    assert res.workers[0]["prefix_hit_tokens"] == 1008


def test_processor_sharing_stretches_steps_when_workers_exceed_cores():
    """Two prompts at once go to two prefill workers (least loaded): with one core between
    them both take twice as long; with two, neither is stretched."""
    trace = [TraceRecord(0.0, 200, 1), TraceRecord(0.0, 200, 1)]
    d, h = P.prefill_s(200, 0), P.handover_s(200)
    for cores, stretch in ((1, 2.0), (2, 1.0), (1.5, 4 / 3)):
        res = simulate(P, SystemConfig(2, 1, cores), trace)
        for r in res.requests:
            assert r.ttft_s == pytest.approx(P.gateway_s + stretch * d + h, rel=1e-12), cores


def test_cores_rate_follows_the_busy_threads():
    class W:
        def __init__(self, threads):
            self.threads = threads
    c = Cores(2)
    a, b, e = W(1), W(1), W(2)
    c.start(0.0, a, 1.0)
    assert c.next_done() == (1.0, a)
    c.start(0.5, b, 1.0)                   # two threads on two cores: no stretch
    c.start(0.5, e, 1.0)                   # four threads on two: half speed
    t, w = c.next_done()
    assert w is a and t == pytest.approx(0.5 + 0.5 * 2)
    c.finish(t, a)                         # three threads on two: 2/3 speed
    t2, _ = c.next_done()
    assert t2 == pytest.approx(t + 0.5 * 1.5)   # b and e had half their work left


def test_colocated_decode_workers_prefill_and_the_chunk_rides_the_decode_step():
    n = 300
    cfg = SystemConfig(0, 1, 2)
    alone = simulate(P, cfg, [TraceRecord(0.0, n, 5)]).requests[0]
    assert alone.ttft_s == pytest.approx(P.gateway_s + P.prefill_s(n, 0), rel=1e-12)
    # a second prompt arriving while the first decodes waits for the step in progress, then
    # joins the next: that step costs the decode step plus the chunk less one pass's fixed cost
    arrival = alone.ttft_s + 0.1
    res = simulate(P, cfg, [TraceRecord(0.0, n, 50), TraceRecord(arrival * 1e3, 100, 2)])
    first, second = res.requests
    t, k = first.ttft_s, 0                  # step k ends at t (its token: the (k+1)th)
    while t < arrival + P.gateway_s:
        k += 1
        t += P.decode_s(1, n + k)
    mixed = P.decode_s(1, n + k + 1) + P.prefill_s(100, 0) - fixed_cost(P)
    assert second.ttft_s == pytest.approx(t + mixed - arrival, rel=1e-9)
    assert res.utilisation["prefill"] == 0.0 and 0 < res.utilisation["decode"] <= 1


def test_same_seed_same_result_and_the_summary_has_the_bench_keys():
    trace = _poisson(0.5, 80, 400, seed=3, out=20)
    trace = [TraceRecord(r.timestamp_ms, r.input_length, r.output_length, (i % 3,))
             for i, r in enumerate(trace)]
    cfg = SystemConfig(1, 2, 2)
    a, b = simulate(P, cfg, trace, seed=5), simulate(P, cfg, trace, seed=5)
    assert a == b
    s = a.summary(slo_ttft_ms=2000, slo_itl_ms=100)
    assert tuple(s) == SUMMARY_KEYS
    assert s["requests"] == 80 and s["completed"] + s["rejected_429"] + s["errors"] == 80


def test_a_ten_minute_trace_is_a_bounded_number_of_events():
    """The simulator's work: one event per arrival, routing and handover, one per engine
    step, and steps no more than tokens: no busy loop, however slow the machine."""
    rng, t, trace = random.Random(1), 0.0, []
    for i in range(600):
        t += rng.expovariate(1.0)
        n = rng.randint(200, 2000)
        trace.append(TraceRecord(t * 1e3, n, rng.randint(16, 256),
                                 (rng.randrange(20),) + tuple(range(1000 + 8 * i, 1000 + 8 * i + n // 512))))
    assert trace[-1].timestamp_ms > 500_000
    res = simulate(P, SystemConfig(2, 2, 2), trace)
    out_tokens = sum(r.output_tokens for r in res.requests)
    steps = res.steps["prefill"] + res.steps["decode"]
    assert steps <= out_tokens + len(trace) * 4
    assert res.events <= 3 * len(trace) + steps + 1


def test_sim_system_does_not_import_torch():
    code = ("import sys, sim.system, sim.profile, sim.trace; "
            "from sim.system import simulate, SystemConfig; "
            "simulate(sim.profile.example(), SystemConfig(1, 1, 2), [sim.trace.TraceRecord(0, 64, 4)]); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'triton', 'decode_worker', 'kvtransfer')); assert not bad, bad[:5]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_defaults_are_the_workers_own():
    from decode_worker.config import DecodeWorkerConfig
    from engine.config import SchedulerConfig
    d = {f.name: f.default for f in fields(DecodeWorkerConfig)}
    assert d["kv_max_reservation_s"] == KV_MAX_RESERVATION_S
    s = SchedulerConfig()
    cfg = SystemConfig(1, 1, 2)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (s.max_num_seqs, s.max_num_batched_tokens)
    with pytest.raises(ValueError):
        SystemConfig(1, 0, 2)


def test_what_the_engine_or_gateway_would_refuse_is_an_error():
    small = dict(example().to_json(), kv={"block_size": 16, "num_blocks": 8},
                 model={"max_model_len": 200})
    from sim.profile import Profile
    res = simulate(Profile.from_json(small), SystemConfig(1, 1, 2), [
        TraceRecord(0.0, 100, 20),          # fits: 8 blocks of 16, within the context
        TraceRecord(1.0, 100, 40),          # 9 blocks
        TraceRecord(2.0, 190, 20),          # past the context of 200
        TraceRecord(3.0, 10, 0)])           # nothing to generate
    assert [r.status for r in res.requests] == ["ok", "error", "error", "error"]
    assert res.summary()["errors"] == 3
