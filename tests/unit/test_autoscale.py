"""pdserve/autoscale.py: the Autoscaler against a fake gateway /metrics (Prometheus text as
the real gateway writes it, parsed by prometheus_client) and a fake actuator.

Up within K intervals (at once on a measured SLO breach), down only after the longer hold
and with margin, the cool-down, the budget, unknown metrics hold (a failed scrape, a pool
missing, a worker not answering), a new worker's passes left out of the measured costs,
no change at constant load over many intervals (the real simulator in the loop), the
/plan JSON over HTTP.
"""
from __future__ import annotations

import json
import random
import urllib.request

import pytest

from pdserve.autoscale import AutoscaleConfig, Autoscaler, serve_plan
from pdserve.autoscale_plan import CostCorrection, Planner, Recommendation
from pdserve.autoscale_signals import Hist, Snapshot
from sim.profile import example

BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))


class FakeGateway:
    """Cumulative counters a gateway and its workers would show; `advance` adds one interval
    of load at `rate` requests/s. Workers follow the actuator's shape."""

    def __init__(self, actuator, interval_s=10.0, rate=0.0, ttft_s=0.2, step_s=0.01):
        self.actuator, self.interval_s, self.rate = actuator, interval_s, rate
        self.ttft_s, self.step_s = ttft_s, step_s
        self.n = self.prompt = self.gen = 0.0
        self.ttft = {le: 0.0 for le in BUCKETS}
        self.ttft_sum = 0.0
        self.steps: dict[str, list[float]] = {}
        self.fail = False
        self.down_worker = ""               # a worker whose /metrics does not answer
        self.hide_role = ""                 # a role whose workers are missing
        self.slow_workers: dict[str, float] = {}   # worker -> its step seconds
        self.rng = random.Random(1)
        self.now = 0.0                      # the autoscaler's clock: one interval per scrape

    def clock(self):
        return self.now

    def workers(self):
        p, d = self.actuator.current()
        return [f"prefill-{i}" for i in range(p)] + [f"decode-{i}" for i in range(d)]

    def advance(self):
        self.now += self.interval_s
        k = self.rate * self.interval_s
        k = max(0, round(k + self.rng.uniform(-0.15, 0.15) * k))   # a little noise
        self.n += k
        self.prompt += 500 * k
        self.gen += 60 * k
        for le in BUCKETS:
            self.ttft[le] += k if self.ttft_s <= le else 0
        self.ttft_sum += self.ttft_s * k
        for w in self.workers():
            row = self.steps.setdefault(w, [0.0, 0.0, 0.0, 0.0, 0.0])
            step = self.slow_workers.get(w, self.step_s)
            row[0] += 100
            row[1] += 100 * step
            row[2] += 400
            row[3] += 400
            row[4] += 400 * 300

    def scrape(self) -> str:
        if self.fail:
            raise OSError("connection refused")
        self.advance()
        g = '{role="gateway",model_name="m"}'
        lines = [f'pdserve:request_success_total{{role="gateway",finished_reason="stop",model_name="m"}} {self.n}',
                 f"pdserve:prompt_tokens_total{g} {self.prompt}",
                 f"pdserve:generation_tokens_total{g} {self.gen}",
                 f"pdserve:num_requests_running{g} 0"]
        for le, c in self.ttft.items():
            lines.append(f'pdserve:time_to_first_token_seconds_bucket{{role="gateway",model_name="m",'
                         f'le="{"+Inf" if le == float("inf") else le}"}} {c}')
        lines += [f"pdserve:time_to_first_token_seconds_sum{g} {self.ttft_sum}",
                  f"pdserve:time_to_first_token_seconds_count{g} {self.n}"]
        for w in self.workers():
            role = w.split("-")[0]
            if role == self.hide_role:
                continue
            up = 0 if w == self.down_worker else 1
            lines.append(f'pdserve:worker_metrics_up{{worker="{w}"}} {up}')
            if not up:
                continue
            lab = f'role="{role}",worker="{w}"'
            lines.append(f"pdserve:num_requests_running{{{lab}}} 1")
            kind = "decode" if role == "decode" else "prefill"
            for name, v in zip(("engine_steps", "engine_step_seconds", "engine_step_tokens",
                                "engine_step_requests", "engine_step_context_tokens"), self.steps[w]):
                lines.append(f'pdserve:{name}_total{{{lab},kind="{kind}",bucket="4"}} {v}')
        return "\n".join(lines) + "\n"


class FakeActuator:
    def __init__(self, shape=(1, 1)):
        self.shape, self.calls = tuple(shape), []

    def current(self):
        return self.shape

    def scale(self, prefill, decode):
        self.calls.append((prefill, decode))
        self.shape = (prefill, decode)


class FakePlanner:
    """Capacities (req/s) per shape; recommends the fewest workers meeting the rate."""

    def __init__(self, capacity, allow_colocated=True):
        self.capacity = capacity
        self.correction = CostCorrection(example(), skip_intervals=2)
        self.recommended = []

    def recommend(self, rate, input_mean, output_mean):
        ok = [s for s in sorted(self.capacity, key=lambda s: (sum(s), -self.capacity[s]))
              if self.capacity[s] >= rate]
        shape = ok[0] if ok else max(self.capacity, key=self.capacity.get)
        self.recommended.append(shape)
        return Recommendation(shape, [], 1.0)

    def meets(self, shape, rate, input_mean, output_mean):
        return self.capacity.get(shape, 0.0) >= rate


CAPACITY = {(0, 1): 1.0, (1, 1): 3.0, (0, 2): 2.0}


def make(shape=(0, 1), rate=0.5, capacity=CAPACITY, **kw):
    cfg = AutoscaleConfig(**{"slo_ttft_ms": 1000, "slo_itl_ms": 100, "max_workers": 2,
                             "up_intervals": 2, "down_intervals": 5, "cooldown_intervals": 3, **kw})
    act = FakeActuator(shape)
    gw = FakeGateway(act, rate=rate)
    return Autoscaler(cfg, gw, act, example(), planner=FakePlanner(capacity), clock=gw.clock), gw, act


def steps(auto, n):
    return [auto.step() for _ in range(n)]


def test_scales_up_within_k_intervals():
    auto, gw, act = make((0, 1), rate=2.5)
    ds = steps(auto, 4)
    assert "first scrape" in ds[0].reasons[0]
    assert act.calls == [(1, 1)]
    assert (ds[2].prefill, ds[2].decode) == (1, 1)          # 1st known + K=2 -> the 3rd step
    assert any("2 interval(s) in a row" in r for r in ds[2].reasons)
    assert "1/2 intervals" in ds[1].reasons[0]


def test_slo_breach_scales_up_at_once():
    auto, gw, act = make((0, 1), rate=2.5)
    gw.ttft_s = 4.0                                         # over the 1000 ms SLO
    ds = steps(auto, 2)
    assert act.calls == [(1, 1)] and "SLO breach: TTFT p90" in ds[1].reasons[0]


def test_scales_down_only_after_the_hold_with_margin():
    auto, gw, act = make((1, 1), rate=0.5)
    ds = steps(auto, 5)                                    # a first scrape, then 4 intervals
    assert act.calls == [] and "4/5 intervals" in ds[4].reasons[0]
    d = auto.step()
    assert act.calls == [(0, 1)] and "meets the SLOs at x1.3" in d.reasons[0]


def test_no_scale_down_without_margin():
    auto, gw, act = make((1, 1), rate=0.9)                 # (0,1) meets 0.9, not 0.9 x 1.3
    ds = steps(auto, 20)
    assert act.calls == []
    assert "misses the SLOs at" in ds[-1].reasons[0]


def test_cool_down_after_a_change():
    auto, gw, act = make((0, 1), rate=2.5, down_intervals=1, rate_intervals=1)
    steps(auto, 3)
    assert act.calls == [(1, 1)]
    gw.rate = 0.1                                          # down is due at once, but cooling
    ds = steps(auto, 3)
    assert act.calls == [(1, 1)]
    assert all("cool-down" in d.reasons[0] for d in ds)
    auto.step()
    assert act.calls == [(1, 1), (0, 1)]


def test_never_above_the_budget():
    auto, gw, act = make((1, 1), rate=10.0, capacity={(2, 2): 20.0, (1, 1): 3.0})
    steps(auto, 4)
    assert act.calls == [] or all(sum(c) <= 2 for c in act.calls)
    assert sum(act.current()) <= 2
    planner = Planner(example(), 3, (5000, 300))
    assert all(p + d <= 3 and d >= 1 for p, d in planner.shapes())
    assert (0, 1) not in Planner(example(), 2, (5000, 300), allow_colocated=False).shapes()
    with pytest.raises(ValueError, match="max-workers"):
        AutoscaleConfig(1000, 100, max_workers=1, allow_colocated=False)


@pytest.mark.parametrize("fault", ["fail", "down_worker", "hide_role"])
def test_unknown_metrics_hold(fault):
    """A failed scrape, a worker's /metrics not answering, a pool absent: never zero load."""
    auto, gw, act = make((1, 1), rate=0.0, down_intervals=1)
    auto.step()
    setattr(gw, fault, {"fail": True, "down_worker": "prefill-0", "hide_role": "decode"}[fault])
    ds = steps(auto, 10)
    assert act.calls == []
    assert all("metrics unknown" in d.reasons[0] and "holding" in d.reasons[0] for d in ds)
    assert all(d.signals == {"known": False} for d in ds)
    setattr(gw, fault, False if fault == "fail" else "")
    steps(auto, 4)                                         # known again: the idle load shows
    assert act.calls == [(0, 1)]


def test_new_worker_passes_are_ignored_in_measured_costs():
    auto, gw, act = make((1, 1), rate=0.5, capacity={(1, 1): 3.0})
    predicted = example().decode_s(4, 4 * 300)
    gw.step_s = predicted                                  # the profile is right ...
    gw.slow_workers["decode-0"] = 50 * predicted           # ... but a cold first pass is slow
    d = steps(auto, 3)[-1]                                 # decode-0 seen 3 times: 1 delta used?
    corr = d.signals["correction"]
    assert "decode-0" in corr["skipped"] and corr["factors"]["decode"] == 1.0
    gw.slow_workers.clear()
    for _ in range(4):
        d = auto.step()
    assert "decode-0" in d.signals["correction"]["workers"]
    assert d.signals["correction"]["factors"]["decode"] == pytest.approx(1.0, abs=0.05)


def test_measured_costs_correct_the_profile():
    corr = CostCorrection(example(), skip_intervals=0)
    b = example().decode_s(4, 1200)
    rows = {"decode-0": {("decode", 4): [10, 10 * 2 * b, 40, 40, 12000]}}
    for _ in range(8):
        corr.observe(rows, {"decode-0"})
    assert corr.factors["decode"] == pytest.approx(2.0, rel=0.02)
    assert corr.profile().decode_s(4, 1200) == pytest.approx(2 * b, rel=0.05)


def test_constant_load_never_oscillates_with_the_simulator():
    """The real Planner (simulator in the loop) at a constant noisy load: one change at most
    (to the shape the load needs), none after it over many intervals."""
    cfg = AutoscaleConfig(slo_ttft_ms=8000, slo_itl_ms=300, max_workers=2, up_intervals=2,
                          down_intervals=4, cooldown_intervals=2, window_s=20)
    act = FakeActuator((1, 1))
    gw = FakeGateway(act, rate=0.2)
    auto = Autoscaler(cfg, gw, act, example(), clock=gw.clock)
    ds = steps(auto, 20)
    assert len(act.calls) <= 1 and len(auto.history) == len(act.calls)
    assert all(d.reasons for d in ds)
    plan = ds[-1].signals["plan"]
    assert plan["took_ms"] < 5000 and plan["ranked"]


def test_histogram_quantile_and_snapshot_parse():
    h = Hist({0.1: 0, 0.5: 5, 1.0: 10, float("inf"): 10}, 5.0, 10)
    assert h.quantile(0.5) == pytest.approx(0.5) and h.quantile(0.9) == pytest.approx(0.9)
    assert h.mean() == 0.5
    text = ('vllm:num_requests_running{role="gateway",model_name="m"} 3\n'
            'vllm:request_success_total{role="gateway",finished_reason="stop",model_name="m"} 7\n')
    snap = Snapshot.parse(text, at=1.0)
    assert snap.gateway == {"in_flight": 3.0, "success": 7.0}


def test_state_json_is_served_at_plan():
    auto, gw, act = make((0, 1), rate=2.5)
    steps(auto, 3)
    server = serve_plan(auto)
    try:
        host, port = server.server_address[:2]
        with urllib.request.urlopen(f"http://{host}:{port}/plan", timeout=5) as r:
            state = json.loads(r.read())
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://{host}:{port}/nope", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert state["mode"] == "autoscale"
    assert state["target"] == {"prefill": 1, "decode": 1}
    assert set(state["current"]) == {"prefill", "decode"}
    assert state["reasons"] and isinstance(state["updated_unix"], float)
    assert state["signals"]["known"] and state["signals"]["rate_rps"] > 0
    assert [set(h) for h in state["history"]] == [{"at_unix", "prefill", "decode", "reasons"}]
