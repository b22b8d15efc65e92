"""gateway/disagg.py: each rule of the conditional-disaggregation decision, in its order,
with its reason; the online cost lines; the profile reader."""
from __future__ import annotations

import json

import pytest

from gateway.disagg import (DISAGGREGATED, LOCAL, DecodeView, DisaggPolicy, OnlineLine,
                            PrefillView, read_profile_costs)

ONE_P = PrefillView(healthy=1)
IDLE_D = DecodeView(running=0, waiting=0, free_kv_blocks=900, total_kv_blocks=1000)


def _policy(**kw):
    # local: 1 ms/token; remote: 50 ms + 0.5 ms/token (the handover's fixed cost)
    kw.setdefault("local", OnlineLine(0.0, 0.001))
    kw.setdefault("remote", OnlineLine(0.05, 0.0005))
    return DisaggPolicy(**kw)


def test_never_and_always_force_each_way():
    assert _policy(mode="never").decide(5000, 0, ONE_P, IDLE_D).kind == LOCAL
    c = _policy(mode="always").decide(3, 0, PrefillView(0), IDLE_D)
    assert c.kind == DISAGGREGATED and c.reasons == ["--disaggregation always"]


def test_no_healthy_prefill_worker_is_local_not_an_error():
    c = _policy().decide(5000, 0, PrefillView(healthy=0), DecodeView(running=50, waiting=3))
    assert c.kind == LOCAL and c.reasons == ["no healthy prefill worker"]


def test_a_short_uncached_part_is_local():
    c = _policy(max_local_tokens=64).decide(64, 0, ONE_P, IDLE_D)
    assert c.kind == LOCAL and "uncached 64 tokens <= 64" in c.reasons[0]
    # a long prompt whose prefix the decode worker holds: only the rest counts
    c = _policy(max_local_tokens=64).decide(1000, 960, ONE_P, IDLE_D)
    assert c.kind == LOCAL and c.uncached == 40


def test_costs_decide_past_the_short_bound():
    p = _policy(max_local_tokens=0)
    # 80 tokens: local 80 ms > remote 50 + 40 = 90 ms? no: 80 <= 90 -> local
    c = p.decide(80, 0, ONE_P, IDLE_D)
    assert c.kind == LOCAL and "<= queue + prefill + handover" in c.reasons[0]
    assert c.local_s == pytest.approx(0.08) and c.remote_s == pytest.approx(0.09)
    # 200 tokens: local 200 ms > remote 150 ms -> disaggregated
    c = p.decide(200, 0, ONE_P, IDLE_D)
    assert c.kind == DISAGGREGATED and "> queue + prefill + handover" in c.reasons[0]


def test_a_long_prefill_queue_makes_local_pay():
    p = _policy(max_local_tokens=0)
    assert p.decide(200, 0, ONE_P, IDLE_D).kind == DISAGGREGATED
    # 4000 tokens queued over 2 workers: 2000 per worker ahead of this prompt
    c = p.decide(200, 0, PrefillView(healthy=2, queued_tokens=4000), IDLE_D)
    assert c.kind == LOCAL and "2000 tokens queued per prefill worker" in c.reasons[0]


def test_a_loaded_decode_worker_disaggregates_even_a_short_prompt():
    p = _policy(max_local_tokens=64, min_free_kv=0.1)
    c = p.decide(10, 0, ONE_P, DecodeView(free_kv_blocks=50, total_kv_blocks=1000))
    assert c.kind == DISAGGREGATED and "50 of 1000 KV blocks free" in c.reasons[0]
    c = p.decide(10, 0, ONE_P, DecodeView(waiting=2, free_kv_blocks=900, total_kv_blocks=1000))
    assert c.kind == DISAGGREGATED and "2 prompt(s) already queued" in c.reasons[0]
    # no Stats yet (total 0): the KV rule does not apply
    assert p.decide(10, 0, ONE_P, DecodeView()).kind == LOCAL


def test_the_stall_bound_protects_running_streams():
    p = _policy(max_local_tokens=1000, max_stall_s=0.1)
    assert p.decide(500, 0, ONE_P, IDLE_D).kind == LOCAL           # nothing running to stall
    c = p.decide(500, 0, ONE_P, DecodeView(running=3, free_kv_blocks=900, total_kv_blocks=1000))
    assert c.kind == DISAGGREGATED and "stall its 3 stream(s) past 100 ms" in c.reasons[0]
    assert p.decide(50, 0, ONE_P, DecodeView(running=3)).kind == LOCAL   # 50 ms: within


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="--disaggregation must be one of"):
        DisaggPolicy(mode="sometimes")
    with pytest.raises(ValueError):
        DisaggPolicy(min_free_kv=1.5)


def test_online_line_learns_the_observed_costs_and_forgets_the_seed():
    line = OnlineLine(0.0, 0.0001)                    # seeded far too cheap
    for n in (100, 300, 500, 700) * 10:
        line.observe(n, 0.2 + 0.002 * n)
    a, b = line.coef()
    assert a == pytest.approx(0.2, rel=0.1) and b == pytest.approx(0.002, rel=0.05)
    assert line.cost(1000) == pytest.approx(2.2, rel=0.05) and line.n == 40


def test_online_line_never_goes_negative():
    line = OnlineLine(0.1, 0.001)
    for n in range(10, 500, 10):
        line.observe(n, max(0.5 - 0.001 * n, 0.0))       # falling cost: b clamps at 0
    a, b = line.coef()
    assert b == 0.0 and a >= 0.0 and line.cost(10_000) >= 0.0


def test_learnt_costs_move_the_decision():
    p = _policy(max_local_tokens=0)
    assert p.decide(80, 0, ONE_P, IDLE_D).kind == LOCAL
    for _ in range(60):                                    # local turns out 10x dearer
        p.observe_local(80, 0.8)
        p.observe_local(160, 1.6)
    assert p.decide(80, 0, ONE_P, IDLE_D).kind == DISAGGREGATED


def test_profile_seeds_the_costs(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"schema": "pdserve.profile/1", "fits": {
        "prefill": [0.01, 0.001, 0.0], "decode": [0, 0, 0], "handover": [0.2, 0.0001]}}))
    (pa, pb), (ha, hb) = read_profile_costs(str(f))
    assert (pa, pb, ha, hb) == pytest.approx((0.01, 0.001, 0.2, 0.0001))
    p = DisaggPolicy.with_profile(str(f), max_local_tokens=0)
    assert p.local.cost(100) == pytest.approx(0.11) and p.remote.cost(100) == pytest.approx(0.32)
    f.write_text(json.dumps({"schema": "other/1"}))
    with pytest.raises(ValueError, match="not a pdserve.profile/1"):
        read_profile_costs(str(f))
    with pytest.raises(ValueError, match="cannot read"):
        read_profile_costs(str(tmp_path / "missing.json"))


def test_the_shipped_profile_reads():
    from pathlib import Path
    (pa, pb), (ha, hb) = read_profile_costs(
        str(Path(__file__).parents[2] / "bench" / "profiles" / "smollm2-2core.json"))
    assert pb > 0 and ha > 0


def _lone_prompts(p: DisaggPolicy, tokens: int, n: int = 8) -> str:
    """`n` lone prompts of `tokens`, each observed at this machine's true cost (local: a
    1-thread decode worker, 1.6 ms a token; remote: a 2-thread prefill worker, 1 ms a token,
    plus the handover): the kinds chosen, "l"/"d" each."""
    kinds = ""
    for _ in range(n):
        c = p.decide(tokens, 0, ONE_P, IDLE_D)
        kinds += c.kind[0]
        if c.kind == LOCAL:
            p.observe_local(tokens, 0.01 + 0.0016 * tokens)
        else:
            p.observe_remote(tokens, 0.03 + 0.00102 * tokens)
    return kinds


def test_the_workers_measures_seed_the_lines_and_end_the_guessing():
    # the defaults (a GPU's guess) send the first long prompt to the slower side, and
    # mid-length ones alternate; seeded by the workers' warm-up measures, none does
    assert _lone_prompts(DisaggPolicy(), 1024).startswith("ld")
    assert "l" in _lone_prompts(DisaggPolicy(), 300)[1:]
    for tokens in (1024, 300):
        p = DisaggPolicy()
        p.seed_measured(local=(0.01, 0.0016), remote=(0.01, 0.001))
        assert p.local.cost(100) == pytest.approx(0.17)
        assert p.remote.cost(100) == pytest.approx(0.01 + 0.02 + (0.001 + 0.00002) * 100)
        assert _lone_prompts(p, tokens) == "d" * 8


def test_measured_seeds_follow_the_workers_until_a_line_is_observed():
    p = DisaggPolicy()
    p.seed_measured(local=None, remote=(0.0, 0.001))          # no decode worker's measure yet
    assert p.local.cost(100) == pytest.approx(DisaggPolicy().local.cost(100))
    p.seed_measured(local=(0.0, 0.002), remote=(0.0, 0.0009))  # the prefill worker refitted
    assert p.remote.cost(100) == pytest.approx(0.02 + 0.00092 * 100)
    p.observe_local(100, 0.5)
    local = p.local.cost(100)
    p.seed_measured(local=(0.0, 0.0001), remote=(0.0, 0.0009))
    assert p.local.cost(100) == local                          # observed: it learns on its own
    f = DisaggPolicy.from_costs(((0.01, 0.001), (0.2, 0.0001)))
    f.seed_measured(local=(0.0, 0.01), remote=(0.0, 0.01))
    assert f.local.cost(100) == pytest.approx(0.11)            # a --profile's seeds stay


def test_a_call_that_ended_since_the_last_stats_is_not_queued_again():
    """Placement reads the prefill pool's queue through the registry's load_tokens: the
    worker's last Stats still show the previous lone prompt queued, but this gateway's call
    for it has ended, so the next lone prompt sees an idle prefill worker (raw Stats sent
    every other lone long prompt local on a CPU)."""
    import asyncio
    from types import SimpleNamespace

    from gateway.placement import Placement
    from gateway.registry import Worker
    from protos.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
    from services.metrics import Metrics

    async def workers():                                   # their channels want a loop
        return (Worker("prefill", "127.0.0.1:1", lambda ch: None),
                Worker("decode", "127.0.0.1:2", lambda ch: None))
    pw, dw = asyncio.run(workers())
    pw.healthy = True
    holder = object()
    pw.attach(holder, 1050)
    pw.stats, pw.stats_open_tokens = prefill_pb2.PrefillStats(queued_prefill_tokens=1050), 1050
    pw.detach(holder)                                      # done before the next probe
    cost = common_pb2.PrefillCost
    pw.stats.prefill_cost.CopyFrom(cost(fixed_s=0.02, per_token_s=0.0007))
    dw.stats = decode_pb2.DecodeStats(free_kv_blocks=900, total_kv_blocks=1000,
                                      prefill_cost=cost(fixed_s=0.02, per_token_s=0.001))
    pool = SimpleNamespace(healthy=lambda: [pw])
    placement = Placement(DisaggPolicy(), pool, Metrics("gateway"))
    t = placement.choose(dw, list(range(1050)), 0)
    assert t.choice.kind == DISAGGREGATED and t.queued_per_worker == 0
    pw.attach(object(), 1050)                              # one really queued: it counts
    assert placement.choose(dw, list(range(1050)), 0).choice.kind == LOCAL


def test_the_side_not_observed_yet_is_scaled_like_the_observed_one():
    """A warm-up times compute alone; an observation has everything a served request adds.
    Once one side is observed, the other's measured seed is scaled by the observed side's
    cost over its own seed, so an unobserved seed does not win on optimism alone."""
    def seeded():
        p = DisaggPolicy()
        p.seed_measured(local=(0.02, 0.0008), remote=(0.02, 0.00067))
        return p
    n = 1050
    p = seeded()
    assert p.decide(n, 0, ONE_P, IDLE_D).kind == DISAGGREGATED
    p.observe_remote(n, 1.15)                      # served: 1.5x its seed
    c = p.decide(n, 0, ONE_P, IDLE_D)
    scale = p.remote.cost(n) / (0.02 + 0.02 + (0.00067 + 0.00002) * n)
    assert scale > 1.2 and c.local_s == pytest.approx((0.02 + 0.0008 * n) * scale)
    assert c.kind == DISAGGREGATED                 # unscaled, the local seed (0.86 s) won
    assert p.local.cost(n) < p.remote.cost(n)
    q = seeded()
    q.observe_local(n, 2.0)                        # the local side seen first, slow
    c = q.decide(n, 0, ONE_P, IDLE_D)
    assert c.remote_s > q.remote.cost(n) and c.kind == DISAGGREGATED
    q.observe_remote(n, 1.0)                       # both seen: the lines as learnt
    c = q.decide(n, 0, ONE_P, IDLE_D)
    assert (c.local_s, c.remote_s) == (q.local.cost(n), q.remote.cost(n))
