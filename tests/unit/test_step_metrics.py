"""services/step_metrics.py (step time by shape) on a real tiny engine, and what
pdserve/profile_live.py makes of its counters: parse, delta, points, merge into a base."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny_model import ensure_default_model
from pdserve import profile_live as live
from services.step_metrics import StepMetrics, bucket
from sim.profile import example


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 17, 64, 65)] == [1, 2, 4, 4, 8, 32, 64, 128]


class Recorder:
    def __init__(self):
        self.steps = []

    def on_step(self, duration_s, tokens):
        self.steps.append((duration_s, dict(tokens)))


def _engine_run(registry):
    sm, rec = StepMetrics("decode", registry), Recorder()
    eng = LLMEngine.from_model_dir(ensure_default_model(), block_size=8, num_blocks=64,
                                   max_num_batched_tokens=16, step_observers=[sm, rec])
    sm.bind(eng)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    eng.add_request("a", list(range(3, 23)), params)        # 20 tokens: chunks of 16 + 4
    eng.add_request("b", list(range(40, 45)), params)        # 5 tokens
    for _ in range(40):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    assert not eng.has_unfinished_requests()
    return rec.steps


def test_counters_match_what_the_engine_did():
    registry = CollectorRegistry()
    steps = _engine_run(registry)
    sums, _ = live.parse(generate_latest(registry).decode())
    # the reference: the recorder's own view of each step, classified by hand
    want: dict = {}
    for seconds, tokens in steps:
        decode = all(n == 1 for n in tokens.values())
        key = ("decode", bucket(len(tokens))) if decode else ("prefill", bucket(sum(tokens.values())))
        w = want.setdefault(key, [0, 0.0, 0, 0])
        w[0] += 1
        w[1] += seconds
        w[2] += sum(tokens.values())
        w[3] += len(tokens)
    assert set(sums) == set(want)
    for key, (n, seconds, tokens, requests) in want.items():
        got = sums[key]
        assert got[0] == n and got[2] == tokens and got[3] == requests
        # each observer reads the clock in turn (the engine's loop): a little apart
        assert got[1] == pytest.approx(seconds, rel=0.1, abs=1e-3 * n)
    # context: a decode step of both requests holds their computed tokens, 20 + 5 and on
    steps_b2 = sums[("decode", 2)]
    assert steps_b2[4] / steps_b2[0] >= 25
    # the first step: a's first chunk of 16 from nothing cached (prefill context 0)
    assert steps[0][1] == {"a": 16}


def test_live_points_delta_and_merge():
    before = {("decode", 4): [10, 1.0, 40, 40, 4000], ("prefill", 512): [2, 1.0, 1000, 2, 0]}
    after = {("decode", 4): [30, 4.0, 120, 120, 12000], ("prefill", 512): [2, 1.0, 1000, 2, 0],
             ("decode", 8): [5, 1.0, 40, 40, 800], ("prefill", 64): [1, 0.1, 50, 1, 0]}
    d = live.delta(after, before)
    assert d[("decode", 4)] == [20, 3.0, 80, 80, 8000]
    assert d[("prefill", 512)][0] == 0
    restarted = live.delta({("decode", 4): [3, 0.3, 12, 12, 100]}, before)
    assert restarted[("decode", 4)] == [3, 0.3, 12, 12, 100]     # counters went down: all new
    pts = live.live_points(d, min_steps=3)
    assert pts["prefill"] == []                                     # 0 and 1 step: too few
    assert [(p["batch"], p["context_tokens"], p["seconds"]) for p in pts["decode"]] == [
        (4.0, 400.0, pytest.approx(0.15)), (8.0, 160.0, pytest.approx(0.2))]
    base = example()
    prof = live.refreshed(base, pts, 0, {"url": "x"})
    batches = sorted(p["batch"] for p in prof.decode)
    assert [b for b in batches if 4 <= b <= 8] == [4.0, 8.0]        # the base's 4 and 8 replaced
    assert 1 in batches and 16 in batches                           # outside the live range: kept
    assert prof.prefill == base.prefill and prof.handover == base.handover
    assert prof.gateway_s == base.gateway_s and prof.options["live"] == {"url": "x"}
    # the fit moved toward the live points (the base's others pull the other way)
    assert abs(prof.decode_s(4, 400) - 0.15) < abs(base.decode_s(4, 400) - 0.15)
    with pytest.raises(ValueError, match="no live prefill"):
        live.refreshed(None, pts, 100, {})


def _prompt_computed(registry) -> float:
    return registry.get_sample_value("pdserve:prompt_tokens_computed_total", {"role": "prefill"})


def _run(eng, rid, ids, params) -> int:
    """Run one request to its end; its prefix-cache hit (tokens)."""
    req = eng.add_request(rid, ids, params)
    for _ in range(40):
        if not eng.has_unfinished_requests():
            return req.num_cached_tokens
        eng.step()
    raise AssertionError("the engine did not finish")


def test_prompt_tokens_computed_counts_only_what_the_prefix_cache_missed():
    registry = CollectorRegistry()
    sm = StepMetrics("prefill", registry)
    eng = LLMEngine.from_model_dir(ensure_default_model(), block_size=8, num_blocks=64,
                                   max_num_batched_tokens=16, step_observers=[sm])
    sm.bind(eng)
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    prompt = list(range(3, 23))                               # 20 tokens: 2 whole blocks of 8
    assert _run(eng, "first", prompt, params) == 0
    assert _prompt_computed(registry) == 20                   # chunks of 16 + 4, nothing cached
    assert _run(eng, "again", prompt, params) == 16
    assert _prompt_computed(registry) == 20 + 4               # the 16 cached tokens are not run
    # a longer prompt sharing those blocks: the partial block's 4 tokens and its own 8
    assert _run(eng, "longer", prompt + list(range(50, 58)), params) == 16
    assert _prompt_computed(registry) == 24 + 12
    assert eng.prompt_tokens_computed == 36                   # the engine's own count


def test_prompt_tokens_received_from_a_prefill_worker_are_not_counted():
    registry = CollectorRegistry()
    sm = StepMetrics("decode", registry)
    eng = LLMEngine.from_model_dir(ensure_default_model(), block_size=8, num_blocks=64,
                                   step_observers=[sm])
    sm.bind(eng)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    assert eng.add_remote_request("r", list(range(3, 23)), params) is not None
    eng.remote_kv_done("r", 7)                                # the KV "arrived" (zeros: fine)
    steps = 0
    while eng.has_unfinished_requests() and steps < 20:
        eng.step()
        steps += 1
    assert not eng.has_unfinished_requests() and steps == 3   # tokens 2..4 decoded
    assert registry.get_sample_value("pdserve:prompt_tokens_computed_total",
                                     {"role": "decode"}) == 0
    assert registry.get_sample_value("pdserve:engine_step_tokens_total",
                                     {"role": "decode", "kind": "decode", "bucket": "1"}) == 3
