"""Operators' view: Prometheus metrics, OpenTelemetry tracing, GPU energy per request.

A leaf module: it imports only the stdlib, prometheus_client, opentelemetry and grpc (pynvml
lazily), so every package may import it.

Metrics
-------
vLLM's names under the `pdserve:` prefix, every series labelled with the process's `role`
(gateway | prefill | decode). One `CollectorRegistry` per process (never the global one),
owned by a `Metrics` object. Who records what, so that nothing is counted twice when the
dashboard sums over pods:

    gateway  (request-level, as the client sees it)
        time_to_first_token_seconds, inter_token_latency_seconds, e2e_request_latency_seconds,
        prompt_tokens_total, generation_tokens_total, request_success_total{finished_reason},
        request_errors_total{code}, num_requests_running (in flight), kv_transfer_fallbacks_total
    prefill / decode  (engine-level)
        num_requests_running, num_requests_waiting, kv_cache_usage_perc, prefill_queue_tokens,
        prefix_cache_queries_total, prefix_cache_hits_total, num_preemptions_total
          -> all from `set_engine_stats(engine.stats())`: gauges set, counters by delta
        request_queue_time_seconds, request_prefill_time_seconds (prefill),
        request_decode_time_seconds (decode)  -> `observe_phases(...)`
        kv_transfer_bytes_total, kv_transfer_seconds (the sender), kv_transfer_failures_total
        (the side that saw it), kv_transfer_fallbacks_total{kind} (the side that fell back)
        energy_joules_total  -> fed by an `EnergyMeter`; absent where NVML reports no power

`/metrics` is always served in the plain text format 0.0.4: prometheus-client 0.26 drops the
`:` from sample names in OpenMetrics (prometheus/client_python#1177), so the Accept header is
ignored on purpose.

Tracing
-------
`setup_tracing(service)` installs an SDK TracerProvider only if something will receive spans:
OTLP/gRPC (BatchSpanProcessor) when OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT is set, a JSON-lines
`span_file` (tests, several processes), or an injected exporter (unit tests). Otherwise
tracing stays off and costs one global read per call: `span()` returns a shared no-op context
manager, `inject_metadata()` returns its argument, `extract_context()` returns None. The
trace context crosses gRPC as W3C `traceparent`/`tracestate` metadata.

    gateway  pdserve.generate (request_id, model, prompt_tokens, completion_tokens)
      prefill  pdserve.prefill (request_id, prompt_tokens, cached_tokens)
                 pdserve.prefill.queue      arrival -> first scheduled (from timestamps)
                 pdserve.prefill.compute    first scheduled -> first token
                 pdserve.kv.send            events "layer" {layer, blocks}
      decode   pdserve.decode (request_id)
                 pdserve.decode.reservation  blocks reserved (KvReady sent)
                 pdserve.decode.transfer_wait  KvReady -> every layer arrived
                 pdserve.decode.generate     first decode step -> finished

Energy
------
`EnergyMeter.step(duration_s, {request_id: num_tokens})` after each engine step: power (W)
times the step's wall time, split over the step's requests by their share of its tokens;
`pop(request_id)` -> joules (None where there is no power reading). Only energy spent inside
steps is counted (idle power is nobody's request).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode, get_current_span, set_span_in_context
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

log = logging.getLogger(__name__)

PREFIX = "pdserve:"
ROLES = ("gateway", "prefill", "decode")

# Buckets (seconds). vLLM's, extended downwards: a decode step on an H200 is ~4 ms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0,
                   10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)


# ============================================================================ metrics
class Metrics:
    """The Prometheus metrics of one process, in its own registry.

    Methods are cheap (a dict lookup and a locked add) and thread-safe: the engine thread
    and the event loop may both call them.
    """

    def __init__(self, role: str, registry: CollectorRegistry | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._stats_source: Callable[[], Any] | None = None
        # Registered first, so a scrape refreshes the engine gauges before reading them.
        r.register(_BeforeScrape(self._refresh))

        def counter(name, doc, *labels):
            return Counter(PREFIX + name, doc, ("role", *labels), registry=r)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, ("role",), registry=r).labels(role)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ("role",), buckets=buckets, registry=r).labels(role)

        # Every role.
        self.num_requests_running = gauge(
            "num_requests_running",
            "Requests in the engine's running batch (gateway: requests in flight)")
        self._kv_fallbacks = counter(
            "kv_transfer_fallbacks",
            "KV transfers replaced by a fallback (recompute, retry on another worker, migrate)",
            "kind")
        self._energy: Any = None          # created on the first joule: absent, not zero
        self._lock = threading.Lock()

        if role == "gateway":
            self.ttft = histogram("time_to_first_token_seconds",
                                  "Time to first token, as the gateway sees it", TTFT_BUCKETS)
            self.itl = histogram("inter_token_latency_seconds",
                                 "Time between consecutive output tokens", ITL_BUCKETS)
            self.e2e = histogram("e2e_request_latency_seconds",
                                 "End-to-end request latency", REQUEST_BUCKETS)
            self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests").labels(role)
            self.generation_tokens = counter(
                "generation_tokens", "Generated tokens of finished requests").labels(role)
            self.request_success = counter(
                "request_success", "Finished requests, by finish reason", "finished_reason")
            self.request_errors = counter(
                "request_errors", "Requests that failed, by gRPC status code name", "code")
            return

        # Workers.
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests waiting to be scheduled (incl. remote KV)")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        self.prefill_queue_tokens = gauge("prefill_queue_tokens",
                                          "Prompt tokens queued and not yet computed")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache").labels(role)
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache").labels(role)
        self.num_preemptions = counter("num_preemptions", "Requests preempted").labels(role)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time from arrival to first scheduled", REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Time computing the prompt", REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Time from the first decode step to the end", REQUEST_BUCKETS)
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "KV cache bytes transferred").labels(role)
        self.kv_transfer_time = histogram("kv_transfer_seconds", "Duration of one request's KV transfer",
                                          TRANSFER_BUCKETS)
        self.kv_transfer_failures = counter("kv_transfer_failures", "KV transfers that failed").labels(role)
        self._last_totals: dict[str, int] = {}

    # ---------------------------------------------------------------- gateway
    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_itl(self, seconds: float, num_tokens: int = 1) -> None:
        """`num_tokens` arrived together `seconds` after the previous ones: one observation
        of seconds/num_tokens per token."""
        if num_tokens <= 0:
            return
        per = seconds / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per)

    def observe_finished(self, e2e_s: float, prompt_tokens: int, gen_tokens: int,
                         finish_reason: str, ttft_s: float | None = None) -> None:
        """A request that finished without error (finish_reason: stop | length | abort)."""
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(gen_tokens)
        self.request_success.labels(self.role, finish_reason).inc()

    def request_timer(self) -> "RequestTimer":
        """Starts now; see RequestTimer."""
        return RequestTimer(self)

    def in_flight(self):
        """`with metrics.in_flight():` counts the block in num_requests_running."""
        return self.num_requests_running.track_inprogress()

    def observe_error(self, code: str) -> None:
        """A failed request; `code` is a grpc.StatusCode name such as "UNAVAILABLE"."""
        self.request_errors.labels(self.role, code).inc()

    # ---------------------------------------------------------------- both

    def observe_kv_fallback(self, kind: str) -> None:
        """kind: "recompute" (decode computes the prompt itself), "retry" (another worker),
        "migrate" (re-prefill after a decode worker died)."""
        self._kv_fallbacks.labels(self.role, kind).inc()

    def add_energy(self, joules: float) -> None:
        """Feeds energy_joules_total; the family exists from the first call on."""
        e = self._energy
        if e is None:
            with self._lock:
                if self._energy is None:
                    self._energy = Counter(PREFIX + "energy_joules", "GPU energy spent in engine steps",
                                           ("role",), registry=self.registry).labels(self.role)
                e = self._energy
        e.inc(joules)

    # ---------------------------------------------------------------- workers
    def watch_engine(self, stats_fn: Callable[[], Any]) -> None:
        """Call `set_engine_stats(stats_fn())` at every scrape (e.g. AsyncEngine.stats, a
        snapshot that never blocks), so no timer is needed."""
        self._stats_source = stats_fn

    def _refresh(self) -> None:
        fn = self._stats_source
        if fn is not None:
            try:
                self.set_engine_stats(fn())
            except Exception:   # a scrape must not fail because of one source
                log.exception("engine stats for metrics failed")

    def set_engine_stats(self, stats: Any) -> None:
        """From an engine.outputs.EngineStats (or anything with its attributes): gauges are
        set; the engine's monotonic totals feed the counters by difference. Thread-safe
        (concurrent scrapes)."""
        with self._lock:
            self._set_engine_stats(stats)

    def _set_engine_stats(self, stats: Any) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting + getattr(stats, "num_waiting_for_remote_kv", 0))
        total = stats.num_total_blocks
        self.kv_cache_usage.set(1.0 - stats.num_free_blocks / total if total else 0.0)
        self.prefill_queue_tokens.set(stats.queued_prefill_tokens)
        for attr, c in (("num_preemptions", self.num_preemptions),
                        ("prefix_cache_queries", self.prefix_cache_queries),
                        ("prefix_cache_hits", self.prefix_cache_hits)):
            now = getattr(stats, attr)
            last = self._last_totals.get(attr, 0)
            # A total that went down means a new engine: its whole value is new.
            delta = now - last if now >= last else now
            if delta:
                c.inc(delta)
            self._last_totals[attr] = now

    def observe_phases(self, queue_s: float | None = None, prefill_s: float | None = None,
                       decode_s: float | None = None) -> None:
        if queue_s is not None:
            self.queue_time.observe(queue_s)
        if prefill_s is not None:
            self.prefill_time.observe(prefill_s)
        if decode_s is not None:
            self.decode_time.observe(decode_s)

    def observe_kv_transfer(self, nbytes: int, seconds: float | None = None) -> None:
        """One request's KV transfer done: its bytes and (sender side) its duration."""
        self.kv_transfer_bytes.inc(nbytes)
        if seconds is not None:
            self.kv_transfer_time.observe(seconds)

    def observe_kv_failure(self) -> None:
        self.kv_transfer_failures.inc()


class _BeforeScrape:
    """A collector that yields nothing: it runs `fn` when the registry is collected."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def describe(self):
        return []

    def collect(self):
        self.fn()
        return []


class RequestTimer:
    """The gateway's per-request clock: `token(n)` whenever n output tokens arrive (first
    call -> TTFT, later ones -> inter-token latency), then `finish(...)` or `error(code)`."""

    __slots__ = ("metrics", "start", "first", "last")

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.first: float | None = None

    def token(self, n: int = 1) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.observe_first_token(now - self.start)
            if n > 1:
                self.metrics.observe_itl(0.0, n - 1)
        else:
            self.metrics.observe_itl(now - self.last, n)
        self.last = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def finish(self, prompt_tokens: int, gen_tokens: int, finish_reason: str) -> float:
        """Records the finished request; returns its end-to-end seconds."""
        e2e = time.monotonic() - self.start
        self.metrics.observe_finished(e2e, prompt_tokens, gen_tokens, finish_reason)
        return e2e

    def error(self, code: str) -> None:
        self.metrics.observe_error(code)


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The registry in the plain text format 0.0.4 (what /metrics serves)."""
    return generate_latest(registry)


def start_metrics_server(registry: CollectorRegistry, host: str = "0.0.0.0",
                         port: int = 0) -> tuple[ThreadingHTTPServer, int]:
    """Serve GET /metrics (plain text) from a daemon thread. Port 0 picks a free port;
    returns (server, port). Stop with `server.shutdown(); server.server_close()`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404)
                return
            body = render_metrics(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):   # no access log on stderr per scrape
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server, server.server_address[1]


class _MetricsASGI:
    # A class instance, not a function: Starlette's add_route() then mounts it as a raw ASGI
    # app on the exact path (no /metrics -> /metrics/ redirect as with Mount).
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = render_metrics(self.registry)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_PLAIN_0_0_4.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def metrics_asgi_app(registry: CollectorRegistry):
    """An ASGI app serving the registry; on FastAPI: `app.add_route("/metrics", it)`."""
    return _MetricsASGI(registry)


# ============================================================================ tracing
_tracer: Any = None            # an SDK Tracer while tracing is on, else None
_provider: Any = None
_propagator: Any = None


class _NoopSpanCM:
    """The shared context manager `span()` returns while tracing is off."""
    __slots__ = ()

    def __enter__(self):
        return INVALID_SPAN

    def __exit__(self, *exc):
        return False


_NOOP_CM = _NoopSpanCM()


class JsonLinesSpanExporter:
    """Appends each finished span as one JSON line (tests read spans of several processes).
    Fields: service, name, trace_id, span_id, parent_span_id (hex; None for a root), start_ns,
    end_ns, attributes, events [{name, attributes}], status."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._f = open(path, "a", buffering=1, encoding="utf-8")

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult
        lines = []
        for s in spans:
            ctx, parent = s.get_span_context(), s.parent
            lines.append(json.dumps({
                "service": s.resource.attributes.get("service.name"),
                "name": s.name,
                "trace_id": format(ctx.trace_id, "032x"),
                "span_id": format(ctx.span_id, "016x"),
                "parent_span_id": format(parent.span_id, "016x") if parent else None,
                "start_ns": s.start_time, "end_ns": s.end_time,
                "attributes": dict(s.attributes or {}),
                "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in s.events],
                "status": s.status.status_code.name,
            }, default=str))
        with self._lock:
            if self._f.closed:
                return SpanExportResult.FAILURE
            self._f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if not self._f.closed:
                self._f.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._f.close()


def read_span_file(path: str) -> list[dict]:
    """The spans a JsonLinesSpanExporter wrote (missing file -> [])."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _otlp_endpoint() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def setup_tracing(service_name: str, *, span_file: str | None = None, exporter: Any = None) -> bool:
    """Turn tracing on for this process if anything will receive spans (see module doc).
    Returns whether it is on. Calling it again replaces the previous setup."""
    global _tracer, _provider, _propagator
    shutdown_tracing()
    endpoint = _otlp_endpoint()
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        endpoint = None
    if not (endpoint or span_file or exporter is not None):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              shutdown_on_exit=False)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if span_file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(span_file)))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("tracing: OTLP export to %s as %s", endpoint, service_name)
    # The provider stays ours (not the OTel global): tests may set up several in turn.
    _provider = provider
    _propagator = TraceContextTextMapPropagator()
    _tracer = provider.get_tracer("pdserve")
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporters (BatchSpanProcessor would otherwise hold spans for 5 s)."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is not None:
        try:
            provider.force_flush()
        finally:
            provider.shutdown()


def tracing_enabled() -> bool:
    return _tracer is not None


def _as_context(parent):
    if parent is None:
        return None
    return set_span_in_context(parent) if isinstance(parent, Span) else parent


def span(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None):
    """`with span("pdserve.prefill", ctx) as sp:` starts a span (current inside the block),
    child of `parent` (a Context from extract_context, a Span, or None: the current span).
    Off: a shared no-op manager yielding a non-recording span. To build attributes only when
    on: `span(name, ctx, tracing_enabled() and {...})`, or `if sp.is_recording(): ...`."""
    t = _tracer
    if t is None:
        return _NOOP_CM
    return t.start_as_current_span(name, context=_as_context(parent), attributes=attributes or None)


def start_span(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
               start_time_ns: int | None = None):
    """A span that is not made current; end it with `.end()`. Off: the non-recording span."""
    t = _tracer
    if t is None:
        return INVALID_SPAN
    return t.start_span(name, context=_as_context(parent), attributes=attributes or None,
                        start_time=start_time_ns)


def current_span():
    """The current span (a non-recording one when off or outside any span)."""
    return get_current_span()


def error_status(message: str) -> Status:
    """`span.set_status(error_status(msg))` marks a span as failed."""
    return Status(StatusCode.ERROR, message)


def monotonic_to_ns(t_monotonic: float, offset_ns: int | None = None) -> int:
    """A time.monotonic() timestamp as wall-clock ns since the epoch (what spans use).
    Pass one `offset_ns=wall_offset_ns()` to convert several timestamps consistently."""
    if offset_ns is None:
        offset_ns = wall_offset_ns()
    return int(t_monotonic * 1e9) + offset_ns


def wall_offset_ns() -> int:
    """time.time_ns() - time.monotonic_ns(), now."""
    return time.time_ns() - time.monotonic_ns()


def record_span(name: str, parent: Any, start_monotonic: float, end_monotonic: float,
                attributes: Mapping[str, Any] | None = None) -> None:
    """A span from two time.monotonic() timestamps taken earlier (e.g. an engine request's
    arrival_time and first_scheduled_time). No-op when off."""
    if _tracer is None:
        return
    off = wall_offset_ns()
    s = start_span(name, parent, attributes, monotonic_to_ns(start_monotonic, off))
    s.end(end_time=monotonic_to_ns(end_monotonic, off))


def inject_metadata(metadata: list | tuple | None = None, parent: Any = None) -> list | tuple | None:
    """Client side: the call's metadata plus traceparent/tracestate of `parent` (a Span or
    Context; None: the current span). Off, or no span: `metadata` itself, unchanged."""
    if _tracer is None:
        return metadata
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=_as_context(parent))
    if not carrier:
        return metadata
    return [*(metadata or ()), *carrier.items()]


def extract_context(carrier: Any):
    """Server side: the remote parent Context from a grpc(.aio) ServicerContext's invocation
    metadata, or from a header mapping (HTTP). Off: None (use it as span()'s parent anyway)."""
    if _tracer is None or carrier is None:
        return None
    if hasattr(carrier, "invocation_metadata"):
        carrier = {k: v for k, v in (carrier.invocation_metadata() or ()) if isinstance(v, str)}
    return _propagator.extract(carrier)


# ============================================================================ energy
PowerReader = Callable[[], "float | None"]     # watts now, or None when unknown


def nvml_power_reader(device_index: int = 0) -> PowerReader | None:
    """A reader of the GPU's power draw in watts via NVML; None where NVML is not there
    (no pynvml, no driver, no GPU, or a GPU that does not report power)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        pynvml.nvmlDeviceGetPowerUsage(handle)          # probe: raises if unsupported
    except Exception as e:  # ImportError, NVMLError_* (library not found, not supported)
        log.info("energy: no NVML power reading (%s: %s)", type(e).__name__, e)
        return None

    def read() -> float | None:
        try:
            return pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0    # mW -> W
        except Exception:
            return None
    return read


class EnergyMeter:
    """Integrates power over engine steps and attributes it to requests by token share.

    Thread-safe: `step` runs on the engine thread, `pop` on the event loop. Power is read at
    most every `min_interval_s` (an NVML call costs tens of microseconds; its own reading is
    an average over a longer window anyway); in between the last reading is reused.
    """

    def __init__(self, read_power_w: PowerReader | None,
                 on_joules: Callable[[float], None] | None = None, min_interval_s: float = 0.02):
        self._read = read_power_w
        self.on_joules = on_joules
        self.min_interval_s = min_interval_s
        self._watts: float | None = None
        self._read_at = float("-inf")
        self._joules: dict[str, float] = {}
        self._lock = threading.Lock()
        self.total_joules = 0.0

    @classmethod
    def for_gpu(cls, device_index: int = 0, on_joules: Callable[[float], None] | None = None
                ) -> "EnergyMeter":
        return cls(nvml_power_reader(device_index), on_joules)

    @property
    def available(self) -> bool:
        return self._read is not None

    def step(self, duration_s: float, tokens: Mapping[str, int]) -> None:
        """One engine step of `duration_s` wall seconds that computed tokens[request_id]
        tokens per request."""
        if self._read is None or duration_s <= 0:
            return
        now = time.monotonic()
        if now - self._read_at >= self.min_interval_s:
            self._watts, self._read_at = self._read(), now
        watts = self._watts
        if watts is None:
            return
        joules = watts * duration_s
        total = sum(tokens.values())
        with self._lock:
            self.total_joules += joules
            if total > 0:
                for rid, n in tokens.items():
                    if n:
                        self._joules[rid] = self._joules.get(rid, 0.0) + joules * n / total
        if self.on_joules is not None:
            self.on_joules(joules)

    def pop(self, request_id: str) -> float | None:
        """The joules attributed to a request (and forget it); None without a power reading.
        Call it when the request finishes or is aborted."""
        if self._read is None:
            return None
        with self._lock:
            return self._joules.pop(request_id, 0.0)


def instrument_engine_steps(engine: Any, meter: EnergyMeter) -> bool:
    """Feed `meter.step` from every `engine.step()` of an engine.llm_engine.LLMEngine
    (duck-typed: `engine.step()` and `engine.scheduler.schedule()` returning an object whose
    `.scheduled` items have `.request.request_id` and `.num_new_tokens`). Call it on the
    thread that owns the engine, before it steps. Does nothing (False) when the meter has no
    power reading, so CPU hosts pay nothing."""
    if not meter.available:
        return False
    scheduler = engine.scheduler
    schedule, step = scheduler.schedule, engine.step
    last: list[Any] = [None]

    def schedule_and_keep(*args, **kwargs):
        last[0] = out = schedule(*args, **kwargs)
        return out

    def metered_step(*args, **kwargs):
        last[0] = None
        t0 = time.perf_counter()
        try:
            return step(*args, **kwargs)       # samples: the GPU work is done when it returns
        finally:
            sched = last[0]
            if sched:
                meter.step(time.perf_counter() - t0,
                           {s.request.request_id: s.num_new_tokens for s in sched.scheduled})

    scheduler.schedule = schedule_and_keep
    engine.step = metered_step
    return True


def gpu_index(device: str) -> int | None:
    """The NVML index of a torch device string ("cuda", "cuda:1"); None for CPU. Honours a
    numeric CUDA_VISIBLE_DEVICES (torch's index i is the i-th listed GPU)."""
    if not device.startswith("cuda"):
        return None
    i = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and all(v.strip().isdigit() for v in visible) and i < len(visible):
        return int(visible[i])
    return i


class RoleTelemetry:
    """What one server process sets up: tracing, its Metrics (+ /metrics server), and for a
    worker on a GPU an EnergyMeter fed by its engine's steps. See `start_role_telemetry`."""

    def __init__(self, metrics: Metrics, meter: EnergyMeter, server: Any, port: int):
        self.metrics, self.meter, self.server, self.port = metrics, meter, server, port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        shutdown_tracing()


def start_role_telemetry(role: str, *, host: str = "0.0.0.0", metrics_port: int | None = None,
                         trace_file: str = "", device: str = "cpu",
                         service_name: str = "") -> RoleTelemetry:
    """Tracing as `pdserve-<role>` (trace_file: JSON-lines spans, see setup_tracing), a
    Metrics, a /metrics server on metrics_port when it is given (0: a free port; None: none,
    e.g. the gateway serves /metrics on its HTTP app), an EnergyMeter for a CUDA device."""
    setup_tracing(service_name or f"pdserve-{role}", span_file=trace_file or None)
    metrics = Metrics(role)
    server, port = (None, 0)
    if metrics_port is not None:
        server, port = start_metrics_server(metrics.registry, host, metrics_port)
        log.info("%s metrics on http://%s:%d/metrics", role, host, port)
    idx = gpu_index(device) if role != "gateway" else None
    meter = EnergyMeter(nvml_power_reader(idx) if idx is not None else None, metrics.add_energy)
    return RoleTelemetry(metrics, meter, server, port)
