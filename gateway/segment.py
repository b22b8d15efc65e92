"""One request as segments on (decode, prefill) pairs, and its migration.

    segment = pick D --Decode(prompt)--> KvReady        (D refuses: the next D)
              pick P --Prefill(dest=KvReady)--> first token
                  P fails: WARNING, counted; abort D, retry on another P, fresh reservation
                  ("#r1", ...): P died: each other P in turn, free; else once (PrefillRetries);
                  when P says D's KV endpoint failed (trailing metadata KV_DESTINATION_FAULT),
                  D is held out of routing (KV_FAULT_HOLD_S), the retry goes to another D;
                  auto, the prefill pool refusing (RESOURCE_EXHAUSTED, no retry left): local
              SubmitFirstToken -> D, accepted: first token -> client (or Abort D if it
                  finished); not: fails before its first event (D's reservation lapsed: 429)
              D's TokenChunks -> OutputProcessor -> events; a stop string matched here:
                  the segment ends, cleanup aborts D
    local (placement.py + disagg.py decide per segment, once D is picked): no P; Decode(local_
      prefill): D computes the prompt, streams every token from the first; prefills_total{kind}
    D's stream breaks (UNAVAILABLE, EOF; also a draining D's "worker draining", before the
    first token or after), or D is lost (its probes unanswered: stalled; the
    registry cuts the segment's calls, Segment.cut) -> _DecodeLost -> migrate: a new
    segment ("#m1") whose prompt is prompt + tokens so far, on another pair (WARNING,
    counted); no migration (off, structured output, deadline passed): UNAVAILABLE
    P lost while its Prefill runs: the Prefill is cut and retried like a failed one

Up to its first token, each step laps the request's PhaseClock (gateway/waterfall.py: the
TTFT waterfall; local: routing, then local_prefill up to the first chunk). The Prefill call
itself: prefill_call.py. Every RPC carries the request's remaining deadline. A segment's
cleanup() cancels its open calls and sends Abort to both workers in the background (each
Abort its own short deadline).
A call a segment opens attaches the segment to its worker (Segment.attach_decode /
attach_prefill -> Worker.attach: counted in flight, cut if the worker is lost) until the call
ends or cleanup() detaches it (Segment.detach -> Worker.detach); nothing else moves those
counts. Status codes and what they mean here: worker_errors.py.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import AsyncIterator

import grpc

from protos.pdserve.v1 import decode_pb2
from services.metrics import Metrics
from services.protoconv import FINISH_FROM_PROTO, logprob_from_proto, sampling_to_proto

from .config import GatewayConfig
from .registry import Worker
from .request import GatewayError, GenerateEvent, RequestState
from .routing import Router, no_worker
from .segment_state import Segment
from .placement import Placement
from .decode_calls import (ABORT_TIMEOUT_S, DecodeLost as _DecodeLost, abort_call,
                           remaining as _remaining, submit_first)
from .prefill_call import prefill
from .worker_errors import (DECODE_REFUSALS, PrefillRetries, blames_destination,
                            rpc_error)

log = logging.getLogger(__name__)

# A decode worker whose KV endpoint failed stays out of routing this long: its gRPC health
# does not cover the KV endpoint, so its next probe would bring it back at once.
KV_FAULT_HOLD_S = 10.0


class Segments:
    """Runs requests as segments over the pools of `router`."""

    def __init__(self, router: Router, cfg: GatewayConfig, metrics: Metrics):
        self.router, self.cfg, self.metrics = router, cfg, metrics
        self.placement = Placement.from_config(cfg, router and router.prefill, metrics)
        self._background: set[asyncio.Task] = set()

    async def run(self, req: RequestState) -> AsyncIterator[GenerateEvent]:
        """The request's events, segment after segment until it finishes."""
        for n in itertools.count():
            rid = req.inp.request_id if n == 0 else f"{req.inp.request_id}#m{n}"
            seg = Segment(rid, metadata=req.metadata)
            try:
                async for ev in self._segment(req, seg, first=n == 0):
                    yield ev
                return
            except _DecodeLost as e:
                self._migrate_or_raise(req, e)
            except asyncio.CancelledError:
                if not seg.lost or asyncio.current_task().cancelling():
                    raise                  # the caller went away
                self._migrate_or_raise(req, _DecodeLost(seg.decode, seg.lost))
            finally:
                self.cleanup(seg)

    async def drain(self) -> None:
        """Wait (bounded) for the background Aborts."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=ABORT_TIMEOUT_S + 1)

    def _migrate_or_raise(self, req: RequestState, e: _DecodeLost) -> None:
        req.lost.add(e.worker.address)
        n = len(req.out.token_ids)
        # A grammar's state cannot be rebuilt from a new prompt: no migration.
        structured = getattr(req.inp.params, "structured", None) is not None
        if (not self.cfg.migrate_on_decode_failure or structured
                or asyncio.get_running_loop().time() >= req.deadline):
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, (
                f"decode worker {e.worker.address} failed mid-stream after {n} token(s): {e}")
            ) from None
        self.metrics.observe_kv_fallback("migrate")
        log.warning("request %s: decode worker %s lost after %d token(s) (%s); migrating: "
                    "re-prefilling prompt + tokens so far on another pair",
                    req.inp.request_id, e.worker.address, n, e)

    # -- one segment -----------------------------------------------------------------------
    async def _segment(self, req: RequestState, seg: Segment, first: bool
                       ) -> AsyncIterator[GenerateEvent]:
        out = req.out
        prompt = out.prompt_token_ids + out.token_ids
        params = out.remaining_params()
        req.clock.lap("gateway_queue")
        kv, resp = await self._prefill_with_retry(seg, prompt, params, req)
        self.placement.counted(seg.ticket, seg.rid)
        if first and req.span is not None:
            req.span.set_attribute("prefill_kind", seg.ticket.choice.kind)
        if kv is None:                 # local: the decode worker computed the prompt
            async for ev in self._relay(req, seg, first):
                yield req.final(ev) if out.finished else ev
            return
        if first:
            req.cached_tokens = max(kv.num_cached_tokens, resp.num_cached_tokens)
        req.add_energy(resp)
        ev = _add(req, [resp.first_token], FINISH_FROM_PROTO.get(resp.finish_reason))
        if ev is not None and first and params.prompt_logprobs is not None:
            ev.prompt_logprobs = [logprob_from_proto(t) if i else (None, None)
                                  for i, t in enumerate(resp.prompt_logprobs)]
        if out.finished:
            yield req.final(ev)
            return
        seg.submit_task = asyncio.create_task(submit_first(seg, resp.first_token, req.deadline))
        seg.submit_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:   # accepted before the client sees the token: a lapsed reservation fails before a 200
            await seg.submit_task
        except _DecodeLost:
            if ev is not None:
                yield ev         # the client's: a migration continues after it (req.out has it)
            raise
        req.clock.lap("decode_admission")
        if ev is not None:
            yield ev
        async for ev in self._relay(req, seg):
            yield req.final(ev) if out.finished else ev

    async def _prefill_with_retry(self, seg: Segment, prompt: list[int], params,
                                  req: RequestState):
        """Open Decode (KvReady), then Prefill; a failed one is retried (PrefillRetries),
        each time with a fresh decode reservation. Returns (KvReady, PrefillResponse), or
        (None, None) when the decode worker computes the prompt itself (local)."""
        retries, local_reason = PrefillRetries(), ""
        for attempt in itertools.count():
            if attempt:
                self.cleanup(seg)
                seg.retry(attempt)
                seg.local_reason = local_reason
            kv = await self._open_decode(seg, prompt, params, req)
            if kv is None:
                return None, None
            self.placement.started(seg.ticket)
            try:
                resp = await prefill(self.router, seg, prompt, params, kv, req, retries)
                self.placement.first_token(seg.ticket, asyncio.get_running_loop().time())
                return kv, resp
            except grpc.aio.AioRpcError as e:
                req.clock.lap("prefill_queue")        # a failed call: time before a compute
                if blames_destination(e):
                    # The decode worker's KV endpoint failed: its fault, not the prefill's.
                    w = seg.decode
                    w.hold(KV_FAULT_HOLD_S, f"KV endpoint: {e.details()}")
                    req.lost.add(w.address)
                    again = retries.failed(e.code(), None)
                    others = self.router.decode.healthy(req.lost)
                else:
                    w = seg.prefill
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        w.mark_failed(e.details() or "UNAVAILABLE")
                    again = retries.failed(e.code(), w.address)
                    others = self.router.prefill.healthy(retries.exclude())
                if not (again and others):
                    local_reason = self.placement.local_instead(e, seg.ticket, params)
                    if not local_reason:
                        raise rpc_error(f"{w.kind} worker {w.address}", e) from None
                    self.metrics.observe_kv_fallback("local")
                    log.warning("request %s: %s", seg.rid, local_reason)
                    continue
                self.metrics.observe_kv_fallback("retry")
                log.warning("request %s: Prefill on %s failed (%s: %s); retrying without %s "
                            "worker %s", seg.rid, seg.prefill.address, e.code().name, e.details(),
                            w.kind, w.address)
            finally:
                self.placement.done(seg.ticket)
        raise AssertionError("unreachable")

    # -- the decode half -------------------------------------------------------------------
    async def _open_decode(self, seg: Segment, prompt: list[int], params,
                           req: RequestState) -> decode_pb2.KvReady | None:
        """Pick a decode worker, decide where the prompt is computed (seg.ticket), open its
        stream and read KvReady (None: local, its first chunk read); a refusing or
        unreachable worker is skipped for the next one (which decides again)."""
        tried = set(req.lost)
        hashes = self.router.hashes(self.router.decode, prompt)
        last_error = None
        while True:
            w = self.router.pick_decode(tried, hashes)
            if w is None:
                raise last_error if last_error is not None else no_worker(self.router.decode)
            tried.add(w.address)
            seg.ticket = self.placement.choose(w, prompt, self.router.cached_on(w, hashes),
                                               params.prompt_logprobs is not None, seg.local_reason)
            req.clock.lap("routing")
            kv = await self._reserve(seg, w, prompt, params, req.deadline, seg.ticket.local)
            req.clock.lap("local_prefill" if seg.ticket.local else "decode_reservation")
            if isinstance(kv, GatewayError):
                last_error = kv
                continue
            return kv

    async def _reserve(self, seg: Segment, w: Worker, prompt: list[int], params,
                       deadline: float, local: bool = False) -> decode_pb2.KvReady | GatewayError | None:
        """Open `w`'s Decode stream and read its KvReady (local: its first TokenChunk, kept
        in seg.first_chunk; returns None); the error when `w` refused (DECODE_REFUSALS:
        another worker may take it)."""
        req = decode_pb2.DecodeRequest(request_id=seg.rid, prompt_token_ids=prompt,
                                       sampling=sampling_to_proto(params),
                                       kv_timeout_ms=self.cfg.kv_timeout_ms, local_prefill=local)
        if seg.ticket is not None:
            seg.ticket.t_open = asyncio.get_running_loop().time()
        seg.attach_decode(w, w.stub.Decode(req, timeout=_remaining(deadline), metadata=seg.metadata),
                          len(prompt))
        try:
            msg = await seg.decode_call.read()
        except grpc.aio.AioRpcError as e:
            seg.detach(w)
            if e.code() not in DECODE_REFUSALS:
                raise rpc_error(f"decode worker {w.address}", e) from None
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                w.mark_failed(e.details() or e.code().name)      # down, or stopping
            log.warning("request %s: decode worker %s refused (%s: %s); trying another",
                        seg.rid, w.address, e.code().name, e.details())
            return rpc_error(f"decode worker {w.address}", e)
        want = "tokens" if local else "kv_ready"
        if msg is grpc.aio.EOF or not msg.HasField(want):
            seg.detach(w)
            raise GatewayError(grpc.StatusCode.INTERNAL, f"decode worker {w.address} did not "
                               f"start with {'a TokenChunk' if local else 'KvReady'}")
        if not local:
            return msg.kv_ready
        seg.first_chunk = msg.tokens
        if msg.tokens.tokens:
            self.placement.first_token(seg.ticket, asyncio.get_running_loop().time())
        return None

    async def _relay(self, req: RequestState, seg: Segment, first: bool = False
                     ) -> AsyncIterator[GenerateEvent]:
        """The decode worker's TokenChunks as events, until the request finishes (`first`:
        a local first segment, whose last chunk's usage says the prompt's cached tokens)."""
        w, gaps = seg.decode, self.metrics.token_path.gaps()
        while True:
            chunk = await self._next_chunk(seg)
            read = gaps.tick()           # the per-token path: services/token_path.py
            if chunk is None:
                continue
            fin = FINISH_FROM_PROTO.get(chunk.finish_reason)
            if fin == "error":
                seg.decode_done = True
                raise GatewayError(grpc.StatusCode.INTERNAL,
                                   f"decode worker {w.address}: {chunk.error or 'failed'}")
            if fin is not None:
                seg.decode_done = True
            if chunk.HasField("usage"):
                req.add_energy(chunk.usage)
                if first:
                    req.cached_tokens = chunk.usage.cached_tokens
            ev = _add(req, chunk.tokens, fin)
            self.metrics.token_path.since("gateway", read)
            if ev is not None:
                yield ev
            if req.out.finished:
                return

    async def _next_chunk(self, seg: Segment) -> decode_pb2.TokenChunk | None:
        """The next message of the decode stream when it is a TokenChunk (else None);
        a broken stream raises _DecodeLost."""
        w = seg.decode
        if seg.first_chunk is not None:            # local: read when the stream opened
            chunk, seg.first_chunk = seg.first_chunk, None
            return chunk
        try:
            msg = await seg.decode_call.read()
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                w.mark_failed(e.details() or "UNAVAILABLE")
                raise _DecodeLost(w, f"{e.code().name}: {e.details()}") from None
            raise rpc_error(f"decode worker {w.address}", e) from None
        if msg is grpc.aio.EOF:
            raise _DecodeLost(w, "the stream ended without a finish reason")
        return msg.tokens if msg.HasField("tokens") else None

    # -- cleanup ---------------------------------------------------------------------------
    def cleanup(self, seg: Segment) -> None:
        """Cancel what is still open and Abort it on the workers (in the background)."""
        if seg.submit_task is not None and not seg.submit_task.done():
            seg.submit_task.cancel()
        if seg.prefill is not None:
            seg.prefill_call.cancel()
            self._spawn(abort_call(seg.prefill, seg.rid))
            seg.detach(seg.prefill)
        if seg.decode is not None:
            seg.decode_call.cancel()
            if not seg.decode_done:
                self._spawn(abort_call(seg.decode, seg.rid))
            seg.detach(seg.decode)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)



def _add(req: RequestState, tokens, finish_reason: str | None) -> GenerateEvent | None:
    """Worker tokens (TokenLogprob protos) through the request's output processor."""
    d = req.out.add([t.token_id for t in tokens], [logprob_from_proto(t) for t in tokens],
                    finish_reason)
    return None if d is None else GenerateEvent.of(d)
