"""sim.system runs pdserve's own policies: the engine Scheduler's KV capacity and
preemption, the decode worker's reservation refusal (429), the gateway's SLO admission,
the prefill worker's queue bound, and the gateway's pick (load against the prefix
the workers' KV events say they hold)."""
from __future__ import annotations

import random

from sim.profile import Profile, example
from sim.system import SystemConfig, simulate
from sim.trace import TraceRecord

P = example()


def small_kv(num_blocks: int) -> Profile:
    d = example().to_json()
    d["kv"] = {"block_size": 16, "num_blocks": num_blocks}
    return Profile.from_json(d)


def burst(count: int, n: int, out: int, hash_ids=()) -> list[TraceRecord]:
    return [TraceRecord(0.0, n, out, tuple(hash_ids)) for _ in range(count)]


def test_kv_capacity_bounds_the_batch_and_blocks_running_out_preempt():
    """16 streams of 100 prompt + 200 output tokens on 64 blocks of 16: at least 7 blocks
    each, so at most 9 run at once; as they grow, the youngest are preempted and recomputed,
    and every one still completes."""
    res = simulate(small_kv(64), SystemConfig(0, 1, 2), burst(16, 100, 200))
    w = res.workers[0]
    assert w["max_batch"] <= 64 // 7
    assert res.preemptions > 0 and w["preemptions"] == res.preemptions
    assert all(r.status == "ok" and r.output_tokens == 200 for r in res.requests)
    assert res.queue["decode_max"] > 0         # preempted mid-decode, waiting for a place


def test_more_kv_means_no_preemption_and_a_larger_batch():
    res = simulate(small_kv(4096), SystemConfig(0, 1, 2), burst(16, 100, 200))
    assert res.preemptions == 0 and res.workers[0]["max_batch"] == 16


def test_a_full_decode_worker_refuses_the_reservation_and_the_gateway_answers_429():
    """Decode first: each reservation takes the whole prompt's blocks up front; past the
    free blocks (less the watermark) the decode worker refuses, the gateway tries the other,
    then answers 429, before any prefill compute is spent."""
    res = simulate(small_kv(128), SystemConfig(1, 2, 2), burst(12, 500, 4))
    s = res.summary()
    # all arrive at once: 32 blocks a prompt, 128 in a worker, a watermark of one block per
    # request held: the fourth reservation would leave 0 < 3 free, so 3 on each worker
    assert (s["completed"], s["rejected_429"]) == (6, 6)
    prefill = next(w for w in res.workers if w["role"] == "prefill")
    assert prefill["requests"] == 6
    assert [w["requests"] for w in res.workers if w["role"] == "decode"] == [3, 3]


def _poisson(rate: float, count: int, seed: int = 0) -> list[TraceRecord]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(TraceRecord(t * 1e3, rng.randint(100, 600), rng.randint(8, 64)))
    return out


def test_more_workers_never_predict_a_worse_ttft_at_the_same_rate():
    trace = _poisson(1.2, 200)
    prev = None
    for p, d in ((1, 1), (2, 1), (2, 2), (3, 2)):
        s = simulate(P, SystemConfig(p, d, cores=p + d), trace).summary()
        cur = (s["ttft_p50_ms"], s["ttft_p90_ms"])
        if prev is not None:
            assert cur[0] <= prev[0] * 1.0001 and cur[1] <= prev[1] * 1.0001, (p, d, cur, prev)
        prev = cur


def test_the_gateway_slo_admission_refuses_under_overload():
    """Well past capacity: without SLOs the gateway admits all (they queue and miss any
    target); with a TTFT SLO its adaptive limit refuses some and the admitted keep a
    better TTFT."""
    trace = _poisson(4.0, 200, seed=2)
    big = small_kv(20_000)
    cfg = dict(prefill=1, decode=1, cores=2, max_queued_prefill_tokens=10**7, max_num_seqs=512,
               kv_max_reservation_s=1e6,
               max_queue_delay_factor=0)                          # nothing else refuses
    free = simulate(big, SystemConfig(**cfg), trace)
    slo = simulate(big, SystemConfig(**cfg, slo_ttft_s=5.0), trace)
    a, b = free.summary(slo_ttft_ms=5000), slo.summary(slo_ttft_ms=5000)
    assert a["rejected_429"] == 0
    assert b["rejected_429"] > 0
    assert b["ttft_p50_ms"] < a["ttft_p50_ms"] and b["goodput_rps"] > a["goodput_rps"]


def test_the_prefill_slowdown_bound_refuses_under_overload():
    """The prefill worker's own default (--max-queue-delay-factor 10), no SLO given: past
    capacity it refuses what would wait over 10x its own compute, and the admitted keep a
    TTFT far below the unbounded queue's."""
    trace = _poisson(4.0, 200, seed=2)
    big = small_kv(20_000)
    cfg = dict(prefill=1, decode=1, cores=2, max_queued_prefill_tokens=10**7, max_num_seqs=512,
               kv_max_reservation_s=1e6)
    free = simulate(big, SystemConfig(**cfg, max_queue_delay_factor=0), trace).summary()
    bound = simulate(big, SystemConfig(**cfg), trace).summary()
    assert free["rejected_429"] == 0 < bound["rejected_429"]
    assert bound["ttft_p90_ms"] < 0.5 * free["ttft_p90_ms"]


def test_the_prefill_queue_bound_refuses():
    res = simulate(P, SystemConfig(1, 1, 2, max_queued_prefill_tokens=1000), burst(5, 400, 2))
    s = res.summary()
    # 400 queued, 800 queued, the third would pass 1000: refused, and so the rest
    assert s["rejected_429"] == 3 and s["completed"] == 2
    assert next(w for w in res.workers if w["role"] == "prefill")["refused"] == 3


def test_prefix_affinity_sends_a_shared_prefix_back_to_the_same_prefill_worker():
    """Requests of two conversations (each its own 1024-token prefix) spaced out: the
    gateway's rule on what the workers hold sends each conversation to the prefill worker
    that cached it, so every later request is a prefix hit there."""
    trace = [TraceRecord(i * 30_000.0, 1100, 2, (i % 2 * 100, i % 2 * 100 + 1, 500 + i))
             for i in range(8)]
    res = simulate(P, SystemConfig(2, 1, 3), trace)
    hits = sum(w["prefix_hit_tokens"] for w in res.workers if w["role"] == "prefill")
    assert hits == 6 * 1024
    assert all(r.status == "ok" for r in res.requests)


def test_routing_on_the_workers_kv_events_finds_each_conversation_where_it_is_cached():
    """Three conversations (a 1024-token prefix each) over two prefill workers, spaced out:
    the simulated gateway's index, fed by the workers' own KV event logs, sends each later
    request where its prefix is cached (9 of 12 full hits); blind least-loaded routing
    alternates workers and misses some. After the run the index holds what the caches do."""
    from sim.flow import Flow
    trace = [TraceRecord(i * 30_000.0, 1100, 2, (i % 3 * 100, i % 3 * 100 + 1, 500 + i))
             for i in range(12)]
    flow = Flow(P, SystemConfig(2, 1, 3), trace)
    flow.run()
    assert sum(w.kv.prefix_hits for w in flow.prefill) == 9 * 1024
    flow._sync()
    for w in (*flow.prefill, *flow.decode):
        assert flow.index.contents(w.address)["device"] == w.kv.events.held() != set()
    blind = simulate(P, SystemConfig(2, 1, 3, prefix_routing="none"), trace)
    assert sum(w["prefix_hit_tokens"] for w in blind.workers if w["role"] == "prefill") < 9 * 1024


def test_the_least_loaded_decode_worker_takes_the_next_stream():
    res = simulate(P, SystemConfig(1, 2, 3), burst(6, 64, 100))
    decode = [w for w in res.workers if w["role"] == "decode"]
    assert [w["requests"] for w in decode] == [3, 3]


def test_the_policies_are_the_projects_own_objects_not_copies():
    """The gateway and the simulator call one pick rule; each simulated worker holds the
    engine's Scheduler, KVCacheManager and the prefill worker's PrefillAdmission."""
    import engine.kv_cache_manager
    import engine.scheduler
    import gateway.admission
    import gateway.affinity
    import gateway.registry
    import prefill_worker.admission
    from sim import flow, workers
    assert flow.choose is gateway.affinity.choose is gateway.registry.choose
    assert flow.Admission is gateway.admission.Admission
    assert workers.Scheduler is engine.scheduler.Scheduler
    assert workers.KVCacheManager is engine.kv_cache_manager.KVCacheManager
    assert workers.PrefillAdmission is prefill_worker.admission.PrefillAdmission
