"""Prometheus metrics of one process (gateway, prefill or decode), in its own registry.

vLLM's names under the `pdserve:` prefix, every series labelled with the process's `role`
(gateway | prefill | decode). One `CollectorRegistry` per process (never the global one),
owned by a `Metrics` object. Who records what, so that nothing is counted twice when the
dashboard sums over pods:

    gateway  (request-level, as the client sees it)
        time_to_first_token_seconds, inter_token_latency_seconds, e2e_request_latency_seconds,
        prompt_tokens_total, generation_tokens_total, request_success_total{finished_reason},
        request_errors_total{code}, num_requests_running (in flight), kv_transfer_fallbacks_total,
        prefills_total{kind=disaggregated|local} (gateway/disagg.py's choice, per segment),
        and the TTFT and ITL observations again in `recent_ttft` / `recent_itl`
        (services/recent.py: the last minute, exact, for the gateway's /status page)
    prefill / decode  (engine-level)
        num_requests_running, num_requests_waiting, kv_cache_usage_perc, prefill_queue_tokens,
        prefix_cache_queries_total, prefix_cache_hits_total, num_preemptions_total,
        spec_decode_num_{drafts,draft_tokens,accepted_tokens,emitted_tokens}_total (decode)
          -> all from `set_engine_stats(engine.stats())`: gauges set, counters by delta
        request_queue_time_seconds, request_prefill_time_seconds (prefill),
        request_decode_time_seconds (decode)  -> `observe_phases(...)`
        kv_transfer_bytes_total, kv_transfer_seconds (the sender), kv_transfer_failures_total
        (the side that saw it), kv_transfer_fallbacks_total{kind} (the side that fell back)
        peer_fetch_total{result=ok|fallback}, peer_fetch_blocks_total (prefill: prefixes
          fetched from a peer prefill worker, prefill_worker/peer_fetch.py)
        energy_joules_total  -> fed by an `EnergyMeter`; absent where NVML reports no power
        kv_tier_{blocks,hits_total,bytes_total,seconds_total,dropped_total}{tier}: the KV
        offload tiers, read from the engine at each scrape (services/kv_tier_metrics.py)
    every role: token_path_seconds{stage} (services/token_path.py: the per-token path)

`/metrics` is always served in the plain text format 0.0.4: prometheus-client 0.26 drops the
`:` from sample names in OpenMetrics (prometheus/client_python#1177), so the Accept header is
ignored on purpose.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from .recent import RecentWindow

from .token_path import TokenPath

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


class Metrics:
    """The Prometheus metrics of one process, in its own registry.

    Methods are cheap (a dict lookup and a locked add) and thread-safe: the engine thread
    and the event loop may both call them.
    """

    def __init__(self, role: str, registry: CollectorRegistry | None = None, restarts: int = 0):
        """`restarts`: a worker's restart count by its supervisor (its --restarts)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._stats_source: Callable[[], Any] | None = None
        # Registered first, so a scrape refreshes the engine gauges before reading them.
        self.registry.register(_BeforeScrape(self._refresh))
        # Every role.
        self.num_requests_running = self._gauge("num_requests_running",
            "Requests in the engine's running batch (gateway: requests in flight)")
        self._kv_fallbacks = self._counter("kv_transfer_fallbacks",
            "KV transfers replaced by a fallback (recompute, retry on another worker, migrate)",
            "kind")
        self._energy: Any = None          # created on the first joule: absent, not zero
        self._lock = threading.Lock()
        self.token_path = TokenPath(self.registry, role)    # services/token_path.py
        if role == "gateway":
            self._gateway_metrics()
        else:
            self._worker_metrics(restarts)

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(PREFIX + name, doc, ("role", *labels), registry=self.registry)

    def _gauge(self, name: str, doc: str):
        return Gauge(PREFIX + name, doc, ("role",), registry=self.registry).labels(self.role)

    def _histogram(self, name: str, doc: str, buckets):
        return Histogram(PREFIX + name, doc, ("role",), buckets=buckets,
                         registry=self.registry).labels(self.role)

    def _gateway_metrics(self) -> None:
        """Request-level, as the client sees it."""
        role, counter, histogram = self.role, self._counter, self._histogram
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time to first token, as the gateway sees it", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive output tokens", ITL_BUCKETS)
        # the same observations over the last minute, exact (the gateway's /status)
        self.recent_ttft, self.recent_itl = RecentWindow(), RecentWindow()
        self.e2e = histogram("e2e_request_latency_seconds",
                             "End-to-end request latency", REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests").labels(role)
        self.generation_tokens = counter(
            "generation_tokens", "Generated tokens of finished requests").labels(role)
        self.request_success = counter(
            "request_success", "Finished requests, by finish reason", "finished_reason")
        self.request_errors = counter(
            "request_errors", "Requests that failed, by gRPC status code name", "code")
        self.prefills = counter(
            "prefills", "Prompts computed, by where: a prefill worker (disaggregated) or the "
            "decode worker itself (local)", "kind")
        for kind in ("disaggregated", "local"):       # both series from the start (0)
            self.prefills.labels(role, kind)

    def _worker_metrics(self, restarts: int) -> None:
        """Engine-level: queues, cache, phases, KV transfers."""
        role, counter, gauge, histogram = self.role, self._counter, self._gauge, self._histogram
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests waiting to be scheduled (incl. remote KV)")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        self.kv_cache_blocks = gauge("kv_cache_blocks",
                                     "KV cache blocks the engine holds (its sizing's choice)")
        self.prefill_queue_tokens = gauge("prefill_queue_tokens",
                                          "Prompt tokens queued and not yet computed")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache").labels(role)
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache").labels(role)
        self.num_preemptions = counter("num_preemptions", "Requests preempted").labels(role)
        # speculative decoding, vLLM's names (engine/spec_decode.py)
        self.spec_num_drafts = counter(
            "spec_decode_num_drafts", "Request-steps that verified a speculative proposal").labels(role)
        self.spec_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative tokens proposed").labels(role)
        self.spec_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative tokens accepted").labels(role)
        self.spec_num_emitted_tokens = counter(
            "spec_decode_num_emitted_tokens",
            "Tokens emitted by speculating request-steps (accepted + one each)").labels(role)
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
        gauge("process_restarts", "Times this worker was restarted by its supervisor").set(restarts)
        self.peer_fetch = counter("peer_fetch", "Prompt prefixes fetched from a peer prefill worker "
                                  "(ok) or computed after the fetch failed (fallback)", "result")
        self.peer_fetch_blocks = counter("peer_fetch_blocks",
                                         "KV blocks fetched from peer prefill workers").labels(role)
        self._last_totals: dict[str, int] = {}

    # ---------------------------------------------------------------- gateway
    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.recent_ttft.add(ttft_s)

    def observe_itl(self, seconds: float, num_tokens: int = 1) -> None:
        """`num_tokens` arrived together `seconds` after the previous ones: one observation
        of seconds/num_tokens per token."""
        if num_tokens <= 0:
            return
        per = seconds / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per)
        self.recent_itl.add(per, num_tokens)

    def observe_finished(self, e2e_s: float, prompt_tokens: int, gen_tokens: int,
                         finish_reason: str, ttft_s: float | None = None) -> None:
        """A request that finished without error (finish_reason: stop | length | abort)."""
        if ttft_s is not None:
            self.observe_first_token(ttft_s)
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

    def observe_prefill(self, kind: str) -> None:
        """One segment's prompt computed: kind "disaggregated" or "local"."""
        self.prefills.labels(self.role, kind).inc()

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
        self.kv_cache_blocks.set(total)
        self.kv_cache_usage.set(1.0 - stats.num_free_blocks / total if total else 0.0)
        self.prefill_queue_tokens.set(stats.queued_prefill_tokens)
        for attr, c in (("num_preemptions", self.num_preemptions),
                        ("prefix_cache_queries", self.prefix_cache_queries),
                        ("prefix_cache_hits", self.prefix_cache_hits),
                        ("spec_num_drafts", self.spec_num_drafts),
                        ("spec_num_draft_tokens", self.spec_num_draft_tokens),
                        ("spec_num_accepted_tokens", self.spec_num_accepted_tokens),
                        ("spec_num_emitted_tokens", self.spec_num_emitted_tokens)):
            now = getattr(stats, attr, 0)
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
