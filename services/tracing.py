"""OpenTelemetry tracing across the three roles.

`setup_tracing(service)` installs an SDK TracerProvider only if something will receive spans:
OTLP/gRPC (BatchSpanProcessor) when OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT is set, a JSON-lines
`span_file` (tests, several processes), or an injected exporter (unit tests). Otherwise
tracing stays off and costs one global read per call: `span()` returns a shared no-op context
manager, `inject_metadata()` returns its argument, `extract_context()` returns None. The
trace context crosses gRPC as W3C `traceparent`/`tracestate` metadata.

    gateway  pdserve.generate (request_id, model, prompt_tokens, completion_tokens)
               pdserve.phase.<name>  each TTFT phase (gateway/waterfall.py), from its clock
      prefill  pdserve.prefill (request_id, prompt_tokens, cached_tokens)
                 pdserve.prefill.queue      arrival -> first scheduled (from timestamps)
                 pdserve.prefill.compute    first scheduled -> first token
                 pdserve.kv.send            events "layer" {layer, blocks}
      decode   pdserve.decode (request_id)
                 pdserve.decode.reservation  blocks reserved (KvReady sent)
                 pdserve.decode.transfer_wait  KvReady -> every layer arrived
                 pdserve.decode.generate     first decode step -> finished
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode, get_current_span, set_span_in_context

log = logging.getLogger(__name__)

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
