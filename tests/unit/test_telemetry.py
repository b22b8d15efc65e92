"""services.metrics, services.tracing, services.energy: exact scraped values, tracing off/on, W3C propagation over gRPC, energy."""
from __future__ import annotations

import asyncio
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from services import energy
from services import metrics
from services import telemetry
from services import tracing


def scrape(text: str) -> dict[tuple, float]:
    """{(sample name, frozenset(labels)): value} from the plain text format."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


def stats(**kw):
    base = dict(num_running=0, num_waiting=0, num_waiting_for_remote_kv=0, num_free_blocks=100,
                num_total_blocks=100, num_held_blocks=0, queued_prefill_tokens=0,
                num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(autouse=True)
def _tracing_off():
    tracing.shutdown_tracing()
    yield
    tracing.shutdown_tracing()


# ----------------------------------------------------------------------------- metrics
def test_gateway_counters_and_histograms_exact():
    m = metrics.Metrics("gateway")
    m.observe_finished(0.3, prompt_tokens=10, gen_tokens=5, finish_reason="stop", ttft_s=0.05)
    m.observe_finished(2.0, prompt_tokens=7, gen_tokens=16, finish_reason="length", ttft_s=0.5)
    m.observe_finished(0.01, prompt_tokens=3, gen_tokens=0, finish_reason="abort")
    m.observe_itl(0.02, num_tokens=2)          # two tokens at once: two observations of 0.01
    m.observe_itl(0.003)
    m.observe_error("UNAVAILABLE")
    m.observe_error("UNAVAILABLE")
    m.observe_error("INVALID_ARGUMENT")
    m.observe_kv_fallback("retry")
    s = scrape(metrics.render_metrics(m.registry).decode())
    g = {"role": "gateway"}
    assert value(s, "pdserve:prompt_tokens_total", **g) == 20
    assert value(s, "pdserve:generation_tokens_total", **g) == 21
    assert value(s, "pdserve:request_success_total", finished_reason="stop", **g) == 1
    assert value(s, "pdserve:request_success_total", finished_reason="length", **g) == 1
    assert value(s, "pdserve:request_success_total", finished_reason="abort", **g) == 1
    assert value(s, "pdserve:request_errors_total", code="UNAVAILABLE", **g) == 2
    assert value(s, "pdserve:request_errors_total", code="INVALID_ARGUMENT", **g) == 1
    assert value(s, "pdserve:kv_transfer_fallbacks_total", kind="retry", **g) == 1
    assert value(s, "pdserve:time_to_first_token_seconds_count", **g) == 2
    assert value(s, "pdserve:time_to_first_token_seconds_bucket", le="0.1", **g) == 1
    assert value(s, "pdserve:time_to_first_token_seconds_bucket", le="+Inf", **g) == 2
    assert value(s, "pdserve:time_to_first_token_seconds_sum", **g) == pytest.approx(0.55)
    assert value(s, "pdserve:e2e_request_latency_seconds_count", **g) == 3
    assert value(s, "pdserve:e2e_request_latency_seconds_bucket", le="0.01", **g) == 1
    assert value(s, "pdserve:e2e_request_latency_seconds_bucket", le="0.5", **g) == 2
    assert value(s, "pdserve:inter_token_latency_seconds_count", **g) == 3
    assert value(s, "pdserve:inter_token_latency_seconds_bucket", le="0.005", **g) == 1
    assert value(s, "pdserve:inter_token_latency_seconds_bucket", le="0.01", **g) == 3
    # Worker-only families are not exported by the gateway (no double counting in sums).
    names = {k[0] for k in s}
    assert "pdserve:kv_cache_usage_perc" not in names
    assert "pdserve:energy_joules_total" not in names


def test_request_timer_ttft_then_itl():
    m = metrics.Metrics("gateway")
    t = m.request_timer()
    t.token(1)
    t.token(1)
    t.token(3)
    assert t.finish(prompt_tokens=4, gen_tokens=5, finish_reason="stop") >= t.ttft_s >= 0
    s = scrape(metrics.render_metrics(m.registry).decode())
    assert value(s, "pdserve:time_to_first_token_seconds_count", role="gateway") == 1
    assert value(s, "pdserve:inter_token_latency_seconds_count", role="gateway") == 4
    assert value(s, "pdserve:e2e_request_latency_seconds_count", role="gateway") == 1
    with m.in_flight():
        s = scrape(metrics.render_metrics(m.registry).decode())
        assert value(s, "pdserve:num_requests_running", role="gateway") == 1


def test_engine_stats_gauges_and_counter_deltas():
    m = metrics.Metrics("decode")
    m.set_engine_stats(stats(num_running=3, num_waiting=1, num_waiting_for_remote_kv=2,
                             num_free_blocks=25, queued_prefill_tokens=40, num_preemptions=2,
                             prefix_cache_queries=100, prefix_cache_hits=30))
    m.set_engine_stats(stats(num_running=5, num_free_blocks=60, num_preemptions=3,
                             prefix_cache_queries=164, prefix_cache_hits=62))
    m.set_engine_stats(stats(num_running=5, num_free_blocks=60, num_preemptions=3,
                             prefix_cache_queries=164, prefix_cache_hits=62))   # unchanged
    s = scrape(metrics.render_metrics(m.registry).decode())
    d = {"role": "decode"}
    assert value(s, "pdserve:num_requests_running", **d) == 5
    assert value(s, "pdserve:num_requests_waiting", **d) == 0
    assert value(s, "pdserve:kv_cache_usage_perc", **d) == pytest.approx(0.4)
    assert value(s, "pdserve:prefill_queue_tokens", **d) == 0
    assert value(s, "pdserve:num_preemptions_total", **d) == 3
    assert value(s, "pdserve:prefix_cache_queries_total", **d) == 164
    assert value(s, "pdserve:prefix_cache_hits_total", **d) == 62
    # A new engine (totals restart from zero): its values count in full.
    m.set_engine_stats(stats(num_preemptions=1, prefix_cache_queries=10, prefix_cache_hits=4))
    s = scrape(metrics.render_metrics(m.registry).decode())
    assert value(s, "pdserve:num_preemptions_total", **d) == 4
    assert value(s, "pdserve:prefix_cache_hits_total", **d) == 66


def test_worker_phases_and_kv_transfer():
    m = metrics.Metrics("prefill")
    m.set_engine_stats(stats(num_waiting=4, queued_prefill_tokens=8192))
    m.observe_phases(queue_s=0.002, prefill_s=0.2)
    m.observe_phases(queue_s=0.03)
    m.observe_kv_transfer(4096, 0.004)
    m.observe_kv_transfer(1024, 0.2)
    m.observe_kv_failure()
    m.observe_kv_fallback("recompute")
    s = scrape(metrics.render_metrics(m.registry).decode())
    p = {"role": "prefill"}
    assert value(s, "pdserve:num_requests_waiting", **p) == 4
    assert value(s, "pdserve:prefill_queue_tokens", **p) == 8192
    assert value(s, "pdserve:request_queue_time_seconds_count", **p) == 2
    assert value(s, "pdserve:request_queue_time_seconds_bucket", le="0.005", **p) == 1
    assert value(s, "pdserve:request_prefill_time_seconds_count", **p) == 1
    assert value(s, "pdserve:request_decode_time_seconds_count", **p) == 0
    assert value(s, "pdserve:kv_transfer_bytes_total", **p) == 5120
    assert value(s, "pdserve:kv_transfer_seconds_count", **p) == 2
    assert value(s, "pdserve:kv_transfer_seconds_bucket", le="0.005", **p) == 1
    assert value(s, "pdserve:kv_transfer_failures_total", **p) == 1
    assert value(s, "pdserve:kv_transfer_fallbacks_total", kind="recompute", **p) == 1
    assert ("pdserve:request_success_total", frozenset()) not in s


def test_registries_are_per_object_and_role_checked():
    a, b = metrics.Metrics("decode"), metrics.Metrics("decode")     # no clash: not the global registry
    a.observe_kv_failure()
    s = scrape(metrics.render_metrics(b.registry).decode())
    assert value(s, "pdserve:kv_transfer_failures_total", role="decode") == 0
    with pytest.raises(ValueError):
        metrics.Metrics("router")


def test_metrics_http_server_plain_text_even_for_openmetrics_accept():
    m = metrics.Metrics("decode")
    m.observe_kv_transfer(10)
    server, port = metrics.start_metrics_server(m.registry, "127.0.0.1", 0)
    try:
        assert port > 0
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        assert value(scrape(text), "pdserve:kv_transfer_bytes_total", role="decode") == 10
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------- tracing
def test_tracing_off_is_a_noop(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert tracing.setup_tracing("pdserve-test") is False
    assert not tracing.tracing_enabled() and tracing._provider is None
    with tracing.span("pdserve.generate", None, tracing.tracing_enabled() and {"x": 1}) as sp:
        assert not sp.is_recording()
        md = [("a", "b")]
        assert tracing.inject_metadata(md) is md
    assert tracing.span("a") is tracing.span("b")                   # one shared manager, nothing allocated
    assert tracing.extract_context({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    assert not tracing.start_span("x").is_recording()
    tracing.record_span("x", None, 0.0, 1.0)


def test_otlp_endpoint_turns_tracing_on(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")   # nothing listens
    assert tracing.setup_tracing("pdserve-test") is True
    tracing.shutdown_tracing()
    assert not tracing.tracing_enabled()


def test_spans_attributes_and_recorded_span():
    exp = InMemorySpanExporter()
    assert tracing.setup_tracing("pdserve-test", exporter=exp)
    import time
    t0 = time.monotonic()
    with tracing.span("pdserve.prefill", None, tracing.tracing_enabled() and {"request_id": "r1"}) as sp:
        tracing.record_span("pdserve.prefill.queue", None, t0, t0 + 0.001)
        with tracing.span("pdserve.kv.send") as kv:
            kv.add_event("layer", {"layer": 0})
    spans = {s.name: s for s in exp.get_finished_spans()}
    assert set(spans) == {"pdserve.prefill", "pdserve.prefill.queue", "pdserve.kv.send"}
    root = spans["pdserve.prefill"]
    assert root.attributes["request_id"] == "r1" and root.parent is None
    assert root.resource.attributes["service.name"] == "pdserve-test"
    for child in ("pdserve.prefill.queue", "pdserve.kv.send"):
        assert spans[child].parent.span_id == sp.get_span_context().span_id
    q = spans["pdserve.prefill.queue"]
    assert abs((q.end_time - q.start_time) - 1_000_000) < 1000   # both ends, one clock offset
    assert [e.name for e in spans["pdserve.kv.send"].events] == ["layer"]


def test_span_file_writes_json_lines(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracing.setup_tracing("pdserve-gateway", span_file=str(path))
    with tracing.span("pdserve.generate", None, {"request_id": "r"}) as root:
        with tracing.span("child"):
            pass
    tracing.shutdown_tracing()
    spans = tracing.read_span_file(str(path))
    by = {s["name"]: s for s in spans}
    assert by["child"]["parent_span_id"] == by["pdserve.generate"]["span_id"]
    assert by["child"]["trace_id"] == by["pdserve.generate"]["trace_id"] == \
        format(root.get_span_context().trace_id, "032x")
    assert by["pdserve.generate"]["service"] == "pdserve-gateway"
    assert by["pdserve.generate"]["attributes"] == {"request_id": "r"}


def test_propagation_over_grpc_aio():
    """A client span injected into metadata is the parent of the server's span."""
    exp = InMemorySpanExporter()
    tracing.setup_tracing("pdserve-test", exporter=exp)

    async def handler(request: bytes, context) -> bytes:
        with tracing.span("server", tracing.extract_context(context)):
            return request

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(handler)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_unary("/test.Echo/Call")
                with tracing.span("client") as client_span:
                    md = tracing.inject_metadata([("x-other", "1")])
                    assert md[0] == ("x-other", "1") and md[1][0] == "traceparent"
                    assert await call(b"hi", metadata=md, timeout=10) == b"hi"
                assert await call(b"no-parent", timeout=10) == b"no-parent"
        finally:
            await server.stop(None)
        return client_span.get_span_context()

    client_ctx = asyncio.run(main())
    servers = [s for s in exp.get_finished_spans() if s.name == "server"]
    assert len(servers) == 2
    child, orphan = servers
    assert child.context.trace_id == client_ctx.trace_id
    assert child.parent.span_id == client_ctx.span_id and child.parent.is_remote
    assert orphan.parent is None and orphan.context.trace_id != client_ctx.trace_id


# ----------------------------------------------------------------------------- energy
class FakePower:
    def __init__(self, *watts):
        self.watts, self.calls = list(watts), 0

    def __call__(self):
        self.calls += 1
        return self.watts.pop(0) if len(self.watts) > 1 else self.watts[0]


def test_energy_attribution_by_token_share():
    m = metrics.Metrics("decode")
    meter = energy.EnergyMeter(FakePower(200.0, 100.0), on_joules=m.add_energy, min_interval_s=0)
    assert meter.available
    meter.on_step(0.5, {"a": 30, "b": 10})          # 100 J: a 75, b 25
    meter.on_step(0.2, {"b": 1, "c": 1})            # 20 J: b 10, c 10
    meter.on_step(0.1, {})                          # 10 J: nobody's, still counted
    assert meter.pop("a") == pytest.approx(75.0)
    assert meter.pop("b") == pytest.approx(35.0)
    assert meter.pop("b") == 0.0                 # forgotten after pop
    assert meter.pop("c") == pytest.approx(10.0)
    assert meter.pop("never-seen") == 0.0
    assert meter.total_joules == pytest.approx(130.0)
    s = scrape(metrics.render_metrics(m.registry).decode())
    assert value(s, "pdserve:energy_joules_total", role="decode") == pytest.approx(130.0)


def test_energy_power_read_rate_limited_and_unavailable():
    power = FakePower(100.0)
    meter = energy.EnergyMeter(power, min_interval_s=3600)
    meter.on_step(0.1, {"a": 1})
    meter.on_step(0.1, {"a": 1})                    # reuses the first reading
    assert power.calls == 1 and meter.pop("a") == pytest.approx(20.0)
    # No NVML here (or anywhere pynvml fails): absent, not zero.
    m = metrics.Metrics("prefill")
    off = energy.EnergyMeter(None, on_joules=m.add_energy)
    off.on_step(1.0, {"a": 5})
    assert not off.available and off.pop("a") is None
    assert "pdserve:energy_joules" not in metrics.render_metrics(m.registry).decode()
    # A reader that fails mid-run (None) attributes nothing.
    flaky = energy.EnergyMeter(lambda: None, min_interval_s=0)
    flaky.on_step(1.0, {"a": 5})
    assert flaky.pop("a") == 0.0


def test_nvml_reader_absent_without_gpu(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", None)       # import fails
    assert energy.nvml_power_reader() is None
    assert not energy.EnergyMeter(energy.nvml_power_reader()).available


def test_watch_engine_refreshes_at_scrape():
    m = metrics.Metrics("prefill")
    current = [stats(num_running=1, prefix_cache_queries=10)]
    m.watch_engine(lambda: current[0])
    s = scrape(metrics.render_metrics(m.registry).decode())
    assert value(s, "pdserve:num_requests_running", role="prefill") == 1
    current[0] = stats(num_running=7, prefix_cache_queries=25)
    s = scrape(metrics.render_metrics(m.registry).decode())
    assert value(s, "pdserve:num_requests_running", role="prefill") == 7
    assert value(s, "pdserve:prefix_cache_queries_total", role="prefill") == 25


def test_inject_metadata_from_an_explicit_span():
    exp = InMemorySpanExporter()
    tracing.setup_tracing("pdserve-test", exporter=exp)
    sp = tracing.start_span("pdserve.generate")           # not current (as in an async generator)
    md = tracing.inject_metadata(None, sp)
    ctx = sp.get_span_context()
    assert dict(md)["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
    with tracing.span("server", tracing.extract_context(dict(md))) as child:
        pass
    sp.end()
    assert child.parent.span_id == ctx.span_id


def test_engine_tells_step_observers_scheduled_tokens():
    """LLMEngine calls on_step(duration, {request_id: tokens}) after each step that computed
    tokens; attribution follows the tokens (a 3-token prompt vs a 1-token one: 3x)."""
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tiny_model import ensure_default_model
    meter = energy.EnergyMeter(lambda: 100.0, min_interval_s=0)
    seen = []

    class Recorder:
        def on_step(self, d, t):
            seen.append((d, dict(t)))

    eng = LLMEngine.from_model_dir(str(ensure_default_model()), num_blocks=8, block_size=8,
                                   step_observers=[meter, Recorder()])
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1))
    eng.add_request("b", [4], SamplingParams(temperature=0.0, max_tokens=1))
    eng.step()
    assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1] == {"a": 3, "b": 1}
    a, b = meter.pop("a"), meter.pop("b")
    assert a > 0 and a == pytest.approx(3 * b)
    assert eng.step() == [] and len(seen) == 1          # nothing scheduled: nobody told
    assert energy.gpu_index("cpu") is None and energy.gpu_index("cuda:1") == 1


def test_role_telemetry_worker_without_gpu(tmp_path):
    t = telemetry.start_role_telemetry("decode", host="127.0.0.1", metrics_port=0,
                                trace_file=str(tmp_path / "s.jsonl"))
    try:
        assert t.port > 0 and tracing.tracing_enabled() and not t.meter.available
        # CPU: no energy meter; the step-time counters (services/step_metrics.py) and the
        # decode worker's per-token path (services/token_path.py: engine_step)
        assert [type(o).__name__ for o in t.step_observers()] == ["StepMetrics", "TokenPath"]
        with urllib.request.urlopen(f"http://127.0.0.1:{t.port}/metrics", timeout=5) as r:
            assert b"pdserve:kv_cache_usage_perc" in r.read()
    finally:
        t.close()
    assert not tracing.tracing_enabled()


def test_energy_reaches_usage_summed_by_the_gateway():
    from gateway.request import RequestState
    from protos.pdserve.v1 import common_pb2, prefill_pb2
    acc = SimpleNamespace(energy_joules=None)
    RequestState.add_energy(acc, prefill_pb2.PrefillResponse())     # no power reading there
    RequestState.add_energy(acc, common_pb2.Usage(energy_joules=None))
    assert acc.energy_joules is None                               # absent, not zero
    RequestState.add_energy(acc, prefill_pb2.PrefillResponse(energy_joules=2.5))
    RequestState.add_energy(acc, common_pb2.Usage(energy_joules=1.0))
    assert acc.energy_joules == pytest.approx(3.5)


def test_energy_hook_on_a_real_engine():
    """The meter as a step observer of engine.LLMEngine: every prompt and generated token
    of a request is attributed to it."""
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tiny_model import ensure_default_model
    watts = 10.0
    meter = energy.EnergyMeter(lambda: watts, min_interval_s=0)
    tokens = {"a": 0, "b": 0}
    inner = meter.on_step
    meter.on_step = lambda d, t: (inner(d, t), [tokens.__setitem__(k, tokens[k] + v) for k, v in t.items()])
    eng = LLMEngine.from_model_dir(str(ensure_default_model()), num_blocks=32, block_size=8,
                                   max_num_batched_tokens=8, step_observers=[meter])   # 2 prefill chunks
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    eng.add_request("a", list(range(1, 13)), p)
    eng.add_request("b", list(range(20, 24)), p)
    while eng.has_unfinished_requests():
        eng.step()
    # prompt tokens + generated tokens fed back (the last sampled one is never computed)
    assert tokens == {"a": 12 + 2, "b": 4 + 2}
    a, b = meter.pop("a"), meter.pop("b")
    assert a > 0 and b > 0 and a + b == pytest.approx(meter.total_joules)
