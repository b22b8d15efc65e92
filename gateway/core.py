"""The gateway: one request through a decode and a prefill worker, transport-free.

Both the public gRPC servicer and the OpenAI REST shim call `Gateway.generate()`, which
yields `GenerateEvent`s and raises `GatewayError(grpc.StatusCode, message)`:

    admit    check the prompt (gateway/prompt.py) and the params; refuse it when overloaded
             (gateway/admission.py: in-flight cap, latency SLOs); a RequestState with its
             deadline, output processor, metrics timer and trace span
    run      segments on (decode, prefill) pairs, migrating when a decode worker dies
             (gateway/segment.py; workers picked by gateway/routing.py), or on a decode
             worker alone that computes the prompt itself (--disaggregation never|auto:
             gateway/disagg.py decides per segment; `prefill_counts` counts both kinds)
    finish   the deadline (request_timeout: it follows the tokens asked for) becomes
             DEADLINE_EXCEEDED; metrics and the span record the end;
             a refusal (RESOURCE_EXHAUSTED: every worker full) carries a retry hint, the
             seconds the requests in flight take to drain at the measured completion rate;
             once the caller took the first token event, its TTFT phases go to
             `Gateway.waterfall` (gateway/waterfall.py)

When the caller goes away (generator closed, task cancelled) or anything fails, the open
segment's cleanup cancels its calls and aborts the request on both workers.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from engine.gguf import model_name
from engine.output_processor import OutputProcessor
from engine.tokenizer import StopStrings, Tokenizer
from protos.pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc
from services import tracing
from services.metrics import Metrics
from services.security import MTLS, read_token

from .admission import Admission
from .affinity import Weights
from .config import GatewayConfig
from .discovery import StaticResolver, WorkerSet, resolver_from_args
from .kv_events_client import KvEventsClient
from .prompt import check_prompt
from .validate import GrammarCheck
from .waterfall import PhaseClock, Waterfall
from .registry import PoolStates, WorkerPool
from .request import GatewayError, GenerateEvent, GenerateInput, RequestState
from .routing import Router
from .segment import Segments


class DrainRate:
    """Completions per second over the last `window_s`, and the retry hint derived from it."""

    def __init__(self, window_s: float = 10.0, max_events: int = 10_000):
        self.window_s = window_s
        self._done: deque[float] = deque(maxlen=max_events)

    def completed(self, now: float | None = None) -> None:
        self._done.append(time.monotonic() if now is None else now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._done and now - self._done[0] > self.window_s:
            self._done.popleft()
        return len(self._done) / self.window_s

    def retry_after_s(self, in_flight: int, now: float | None = None) -> int:
        """Seconds until the requests in flight have drained at the measured rate, in
        [1, 60] (1 with nothing measured yet)."""
        r = self.rate(now)
        return 1 if r <= 0 else min(max(math.ceil(in_flight / r), 1), 60)


def _prefill_resolver(cfg: GatewayConfig):
    """The prefill pool's addresses; none given is legal unless --disaggregation always
    (every prompt is then computed by the decode workers: colocated)."""
    if not (cfg.prefill or cfg.prefill_dns or cfg.prefill_file) and cfg.disaggregation != "always":
        return StaticResolver([])
    return resolver_from_args(cfg.prefill, cfg.prefill_dns, cfg.discovery_interval_s,
                              cfg.prefill_file)


class Gateway:
    """Routes requests over prefill and decode pools. `start()` before use, `stop()` after."""

    def __init__(self, cfg: GatewayConfig, tokenizer: Tokenizer | None = None):
        self.cfg = cfg
        model_dir = cfg.resolved_model_dir()
        self.tokenizer = tokenizer or Tokenizer.from_dir(model_dir)
        self.model_name = cfg.model_name(model_dir)
        self._configured_len = cfg.context_length(model_dir)
        self.vocab_size = cfg.vocab_size(model_dir)
        self.grammars = GrammarCheck(self.tokenizer, self.vocab_size)
        self.metrics = Metrics("gateway")    # the caller serves metrics.registry
        self.waterfall = Waterfall(self.metrics.registry)    # the TTFT phases (waterfall.py)
        mtls = MTLS.from_config(cfg)         # workers over mTLS when configured
        token = read_token(cfg.internal_token_file)   # and the deployment's credential
        served = model_name(model_dir)       # what the workers' KV compat keys must name
        self.prefill = WorkerPool("prefill", prefill_pb2_grpc.PrefillWorkerStub,
                                  cfg.health_interval_s, cfg.probe_timeout_s, mtls,
                                  cfg.stall_timeout_s, model=served, token=token)
        self.decode = WorkerPool("decode", decode_pb2_grpc.DecodeWorkerStub,
                                 cfg.health_interval_s, cfg.probe_timeout_s, mtls,
                                 cfg.stall_timeout_s, model=served, token=token)
        self.metrics.registry.register(PoolStates([self.prefill, self.decode]))
        self._sets = [
            (WorkerSet(_prefill_resolver(cfg), name="prefill"), self.prefill),
            (WorkerSet(resolver_from_args(cfg.decode, cfg.decode_dns, cfg.discovery_interval_s,
                                          cfg.decode_file), name="decode"), self.decode)]
        self.router = Router(self.prefill, self.decode, cfg.affinity_slack,
                             cfg.affinity_slack_ratio, cfg.decode_affinity_slack,
                             cfg.prefix_routing, Weights(cfg.prefix_weight_host,
                                                         cfg.prefix_weight_disk,
                                                         cfg.prefix_weight_recompute), self.metrics)
        self.router.peer_fetch_min_blocks = cfg.peer_fetch_min_blocks if cfg.peer_fetch == "on" else 0
        self._segments = Segments(self.router, cfg, self.metrics)
        # every worker's KV events into router.index (gateway/kv_events_client.py)
        self.kv_events = KvEventsClient(self.router.index, [self.prefill, self.decode], self.metrics)
        self.drain_rate = DrainRate()
        self.admission = Admission(cfg.max_in_flight, cfg.slo_ttft_ms / 1e3, cfg.slo_itl_ms / 1e3)
        self.in_flight = 0

    @property
    def prefill_counts(self) -> dict[str, int]:
        """Segments' prompts by where they were computed: {"disaggregated": n, "local": n}
        (gateway/placement.py; pdserve:prefills_total{kind})."""
        return dict(self._segments.placement.counts)

    @property
    def max_model_len(self) -> int:
        """The context length the workers serve: the smallest their Stats report (a prompt
        must fit any worker it may be routed to); until Stats arrive, the configured one."""
        served = [w.stats.max_model_len for pool in (self.prefill, self.decode)
                  for w in pool.workers.values() if w.stats is not None and w.stats.max_model_len]
        return min(served) if served else self._configured_len

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Discover the workers and probe each once (so routing works on return); follow
        each worker's KV events into router.index (gateway/kv_events_client.py)."""
        for wset, pool in self._sets:
            wset.on_change(pool.on_change)
            wset.on_change(self.kv_events.watch(pool))    # after the pool's: its Worker exists
            await wset.start()
            await pool.start()

    async def stop(self) -> None:
        for wset, _ in self._sets:
            await wset.stop()
        await self._segments.drain()
        await self.kv_events.stop()
        for _, pool in self._sets:
            await pool.stop()

    def worker_addresses(self) -> list[str]:
        """Every worker address this gateway knows (kept out of client-facing errors)."""
        return [a for pool in (self.prefill, self.decode) for a in pool.workers]

    def check_prompt(self, ids: list[int], max_tokens: int | None = None) -> None:
        """Raise prompt.PromptError unless this model can continue `ids` (see check_prompt)."""
        check_prompt(ids, self.max_model_len, self.vocab_size, max_tokens)

    def request_timeout(self, prompt_tokens: int, max_tokens: int | None) -> float:
        """The end-to-end deadline of a request asking for these tokens: request_timeout_s
        + (prompt + max_tokens) x request_timeout_per_token_s, at most max_request_timeout_s.
        max_tokens None: what the context leaves (as the workers bound it)."""
        cfg = self.cfg
        if max_tokens is None:
            max_tokens = max(self.max_model_len - prompt_tokens, 1) if self.max_model_len else None
        if max_tokens is None:                 # no context length known: nothing bounds it
            return cfg.max_request_timeout_s
        t = cfg.request_timeout_s + (prompt_tokens + max_tokens) * cfg.request_timeout_per_token_s
        return min(t, cfg.max_request_timeout_s)

    # -- one request ---------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateEvent]:
        """Stream the completion of one prompt (params.n must be 1)."""
        entered = time.monotonic()
        if inp.params.stop:          # the stop-string automaton is built off the event loop
            await asyncio.to_thread(StopStrings.prepare, inp.params.stop)
        if inp.params.structured is not None:      # compiled as a worker would, off the loop
            await asyncio.to_thread(self.grammars.check, inp.params.structured)
        req = self._admit(inp, entered)
        self.in_flight += 1
        last, first = time.monotonic(), True       # latencies for admission's SLOs
        try:
            async with aclosing(self._segments.run(req)) as events:
                async for ev in events:
                    req.timer.token(len(ev.token_ids))
                    if ev.token_ids:
                        now = time.monotonic()
                        if first:
                            self.admission.first_token(now - last)
                        else:
                            self.admission.tokens(now - last, len(ev.token_ids))
                        last = now
                    yield ev
                    if first and ev.token_ids:     # resumed: the caller took it (REST: written)
                        first = False
                        req.clock.stop()
                        self.waterfall.observe_request(req.clock, req.span)
            req.ok = True
            self.drain_rate.completed()
        except asyncio.TimeoutError:
            req.error = grpc.StatusCode.DEADLINE_EXCEEDED.name
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"request exceeded its deadline of {req.timeout_s:.1f}s") from None
        except GatewayError as e:
            req.error = e.code.name
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after_s is None:
                e.retry_after_s = self.drain_rate.retry_after_s(self.in_flight)
            raise
        finally:
            self.in_flight -= 1
            self._observe_end(req)

    def _admit(self, inp: GenerateInput, entered: float) -> RequestState:
        """Check the request and open its state: deadline, output processor, timer, span, and
        the phase clock, from when the front got it (else `entered`: generate() was called)."""
        timer = self.metrics.request_timer()
        try:
            self._validate(inp)
            why = self.admission.refusal(self.in_flight)
            if why is not None:
                raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, why,
                                   retry_after_s=self.drain_rate.retry_after_s(self.in_flight))
        except GatewayError as e:
            timer.error(e.code.name)
            raise
        timeout = inp.deadline_s or self.request_timeout(len(inp.prompt_token_ids), inp.params.max_tokens)
        span = tracing.start_span("pdserve.generate", inp.trace_parent, tracing.tracing_enabled() and {
            "request_id": inp.public_id or inp.request_id, "internal_id": inp.request_id,
            "model": self.model_name,
            "prompt_tokens": len(inp.prompt_token_ids)})
        return RequestState(
            inp, OutputProcessor(self.tokenizer, inp.prompt_token_ids, inp.params, self.max_model_len),
            deadline=asyncio.get_running_loop().time() + timeout, timeout_s=timeout,
            timer=timer, span=span, metadata=tracing.inject_metadata(None, span),
            clock=PhaseClock(inp.arrived if inp.arrived is not None else entered))

    def _validate(self, inp: GenerateInput) -> None:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        self.check_prompt(inp.prompt_token_ids)
        if inp.params.n != 1:
            raise GatewayError(bad, "Gateway.generate() makes one completion: n must be 1")
        try:
            inp.params.validate()
        except ValueError as e:
            raise GatewayError(bad, str(e)) from None

    def _observe_end(self, req: RequestState) -> None:
        """Metrics and the request's span: finished (or cancelled: "abort") or failed."""
        out, span = req.out, req.span
        if req.error is not None:
            req.timer.error(req.error)
            span.set_status(tracing.error_status(req.error))
        else:
            reason = (out.finish_reason or "stop") if req.ok else "abort"
            req.timer.finish(len(out.prompt_token_ids), len(out.token_ids), reason)
        span.set_attribute("completion_tokens", len(out.token_ids))
        span.end()
