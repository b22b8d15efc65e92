"""The gateway core: one request through a decode and a prefill worker, transport-free.

Both the public gRPC servicer and the OpenAI REST shim call `Gateway.generate()`, which
yields `GenerateEvent`s and raises `GatewayError(grpc.StatusCode, message)`.

One request (decode-first, see protos/README.md), as `generate()` runs it:

    pick D (load + prefix affinity) --Decode(prompt)--> KvReady      (D refuses: next D)
    pick P (load + prefix affinity) --Prefill(dest=KvReady)--> first token
          P fails (UNAVAILABLE, ...): WARNING, counted; abort D, retry once on another P
    emit first token (TTFT) | SubmitFirstToken -> D  (or Abort D if the request finished)
    relay D's TokenChunks: detokenize, stop strings, logprobs -> events
          stop string matched here: cut the text, Abort D
          D's stream breaks (UNAVAILABLE): migrate = a new segment whose prompt is
          prompt + tokens so far, on another pair (WARNING, counted); or raise UNAVAILABLE

Every RPC carries the request's remaining deadline. When the caller goes away (generator
closed, task cancelled) or anything fails, the segment's cleanup cancels the open calls and
sends Abort to both workers in the background (each Abort has its own short deadline).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, partial_stop_len
from services.metrics import Metrics
from services import tracing
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from .config import GatewayConfig
from .discovery import WorkerSet, resolver_from_args
from services.protoconv import FINISH_FROM_PROTO, logprob_from_proto, sampling_to_proto
from .registry import PrefixAffinity, Worker, WorkerPool

log = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 2.0
_SUBMIT_TIMEOUT_S = 10.0
# Codes a gateway passes through from a worker as they are; anything else becomes INTERNAL.
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.CANCELLED, grpc.StatusCode.FAILED_PRECONDITION}
# A Prefill that failed with one of these is retried once on another prefill worker.
_PREFILL_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}


class GatewayError(Exception):
    """A request failed; `code` is the grpc.StatusCode the caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    energy_joules: float | None = None   # GPU energy, prefill + decode; None: no power reading


@dataclass
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline_s: float | None = None      # seconds the whole request may take; None: config
    trace_parent: object = None          # the caller's trace context (tracing.extract_context)


Logprob = tuple[float, "list[tuple[int, float]] | None"]


@dataclass
class GenerateEvent:
    token_ids: list[int]                 # new tokens in this event
    text: str                            # text delta
    logprobs: list[Logprob] | None = None   # one per new token, when params.logprobs is set
    finish_reason: str | None = None     # None | "stop" | "length" | "abort"
    stop_reason: int | str | None = None # the stop token id or stop string that matched
    usage: Usage | None = None           # on the last event
    prompt_logprobs: list | None = None  # first event only, when params.prompt_logprobs is set


@dataclass
class GatewayCounters:
    requests: int = 0
    finished: int = 0
    errors: int = 0
    cancelled: int = 0
    prefill_retries: int = 0
    decode_retries: int = 0
    migrations: int = 0


class _DecodeLost(Exception):
    """The decode worker's stream broke mid-request (the worker died or went away)."""

    def __init__(self, worker: Worker, detail: str):
        super().__init__(detail)
        self.worker = worker


class _Output:
    """What one request has produced so far, across segments: the gateway's output processor.

    Mirrors engine.LLMEngine._append_token: a stop token (EOS unless ignore_eos, or
    stop_token_ids) ends the request without entering the text; a stop string cuts the text
    where it begins (unless include_stop_str_in_output); a possible partial stop string at the
    end of the text is held back until it is resolved.
    """

    def __init__(self, tok: Tokenizer, inp: GenerateInput, max_model_len: int):
        p = inp.params
        self.params = p
        self.prompt = list(inp.prompt_token_ids)
        self.eos = set() if p.ignore_eos else set(tok.eos_token_ids)
        self.stop_ids = set(p.stop_token_ids)
        self.detok = IncrementalDetokenizer(tok, self.prompt, p.skip_special_tokens)
        limit = max_model_len - len(self.prompt) if max_model_len else None
        self.max_tokens = min(x for x in (p.max_tokens, limit) if x is not None) \
            if (p.max_tokens, limit) != (None, None) else None
        self.ids: list[int] = []
        self.text = ""           # final text (set when a stop string cut it)
        self.emitted = 0         # characters of text already sent
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cached_tokens = 0
        self.energy_joules: float | None = None   # summed over the workers that report it

    def add_energy(self, msg) -> None:
        """Add a worker's energy_joules (PrefillResponse or Usage) when it has one."""
        if msg.HasField("energy_joules"):
            self.energy_joules = (self.energy_joules or 0.0) + msg.energy_joules

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, tokens: Sequence[common_pb2.TokenLogprob],
            worker_finish: str | None = None) -> GenerateEvent | None:
        """Process new tokens; the event to send (None: nothing new). `worker_finish` is the
        worker's finish reason for the last of `tokens`."""
        p, new_ids, lps = self.params, [], []
        for t in tokens:
            if self.finished:
                break                                # tokens after a gateway-side stop
            self.ids.append(t.token_id)
            new_ids.append(t.token_id)
            lps.append(logprob_from_proto(t))
            self._check(t.token_id)
        if not self.finished and worker_finish is not None:
            self.finish_reason = worker_finish
            if worker_finish == "stop" and self.ids and self.ids[-1] in self.stop_ids | self.eos:
                self.stop_reason = self.ids[-1]
        text = self._stable_text()
        delta = text[self.emitted:] if len(text) > self.emitted else ""
        self.emitted = max(self.emitted, len(text))
        if not new_ids and not delta and not self.finished:
            return None
        return GenerateEvent(new_ids, delta, lps if p.logprobs is not None else None,
                             self.finish_reason, self.stop_reason)

    def _check(self, token: int) -> None:
        p, n = self.params, len(self.ids)
        if (token in self.stop_ids or token in self.eos) and n >= p.min_tokens:
            self.finish_reason, self.stop_reason = "stop", token
        else:
            delta = self.detok.add(token)
            if p.stop and n >= p.min_tokens:
                at = find_stop(self.detok.text, p.stop, len(delta))
                if at is not None:
                    s = next(s for s in p.stop if self.detok.text.startswith(s, at))
                    self.text = self.detok.text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                    self.finish_reason, self.stop_reason = "stop", s
        if not self.finished and self.max_tokens is not None and n >= self.max_tokens:
            self.finish_reason = "length"

    def _stable_text(self) -> str:
        if self.finish_reason == "stop" and isinstance(self.stop_reason, str):
            return self.text
        if self.finished:
            self.detok.flush()
            return self.detok.text
        text = self.detok.text
        if self.params.stop:
            text = text[:len(text) - partial_stop_len(text, self.params.stop)]
        return text

    def remaining_params(self) -> SamplingParams:
        """Sampling parameters for a segment that continues after the tokens so far."""
        p, n = self.params, len(self.ids)
        return replace(p, max_tokens=None if self.max_tokens is None else self.max_tokens - n,
                       min_tokens=max(0, p.min_tokens - n))


@dataclass
class _Segment:
    """One pass through a (decode, prefill) pair; owns its calls until cleanup()."""
    rid: str
    decode: Worker | None = None
    decode_call: object = None
    prefill: Worker | None = None
    prefill_call: object = None
    submit_task: asyncio.Task | None = None
    decode_done: bool = False          # the decode worker finished the request itself
    metadata: object = None            # gRPC metadata for the workers (trace context)
    tasks: list = field(default_factory=list)


class Gateway:
    """Routes requests over prefill and decode pools. `start()` before use, `stop()` after."""

    def __init__(self, cfg: GatewayConfig, tokenizer: Tokenizer | None = None):
        self.cfg = cfg
        model_dir = cfg.resolved_model_dir()
        self.tokenizer = tokenizer or Tokenizer.from_dir(model_dir)
        self.model_name = cfg.model_name(model_dir)
        self.max_model_len = cfg.context_length(model_dir)
        self.counters = GatewayCounters()
        self.metrics = Metrics("gateway")    # the caller serves metrics.registry
        self.prefill = WorkerPool("prefill", prefill_pb2_grpc.PrefillWorkerStub,
                                  cfg.health_interval_s, cfg.probe_timeout_s)
        self.decode = WorkerPool("decode", decode_pb2_grpc.DecodeWorkerStub,
                                 cfg.health_interval_s, cfg.probe_timeout_s)
        self._sets = [
            (WorkerSet(resolver_from_args(cfg.prefill, cfg.prefill_dns, cfg.discovery_interval_s),
                       name="prefill"), self.prefill),
            (WorkerSet(resolver_from_args(cfg.decode, cfg.decode_dns, cfg.discovery_interval_s),
                       name="decode"), self.decode)]
        self._affinity = {"prefill": PrefixAffinity(), "decode": PrefixAffinity()}
        self._background: set[asyncio.Task] = set()
        self._ids = itertools.count()

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Discover the workers and probe each once (so routing works on return)."""
        for wset, pool in self._sets:
            wset.on_change(pool.on_change)
            await wset.start()
            await pool.start()

    async def stop(self) -> None:
        for wset, pool in self._sets:
            await wset.stop()
        if self._background:
            await asyncio.wait(list(self._background), timeout=_ABORT_TIMEOUT_S + 1)
        for _, pool in self._sets:
            await pool.stop()

    async def worker_stats(self) -> dict[str, list[dict]]:
        """Probe every worker now; per pool: address, health, the gateway's counts, Stats."""
        await asyncio.gather(self.prefill.probe_all(), self.decode.probe_all())
        return {pool.kind: [{
            "address": w.address, "worker_id": w.worker_id, "healthy": w.healthy,
            "in_flight": w.in_flight, "requests_total": w.requests_total,
            "failures": w.failures, "last_error": w.last_error,
            "stats": MessageToDict(w.stats, preserving_proto_field_name=True)
            if w.stats is not None else None,
        } for w in pool.workers.values()] for pool in (self.prefill, self.decode)}

    # -- one request ---------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateEvent]:
        """Stream the completion of one prompt (params.n must be 1)."""
        timer = self.metrics.request_timer()
        try:
            self._validate(inp)
        except GatewayError as e:
            timer.error(e.code.name)
            raise
        self.counters.requests += 1
        loop = asyncio.get_running_loop()
        timeout = inp.deadline_s or self.cfg.request_timeout_s
        deadline = loop.time() + timeout
        out = _Output(self.tokenizer, inp, self.max_model_len)
        lost: set[str] = set()
        ok = False
        error = None                     # the failed request's status code name
        span = tracing.start_span("pdserve.generate", inp.trace_parent, tracing.tracing_enabled() and {
            "request_id": inp.request_id, "model": self.model_name,
            "prompt_tokens": len(inp.prompt_token_ids)})
        metadata = tracing.inject_metadata(None, span)
        try:
            for segment_no in itertools.count():
                rid = inp.request_id if segment_no == 0 else f"{inp.request_id}#m{segment_no}"
                seg = _Segment(rid, metadata=metadata)
                try:
                    async for ev in self._run_segment(out, seg, deadline, lost, first=segment_no == 0):
                        timer.token(len(ev.token_ids))
                        yield ev
                    ok = True
                    return
                except _DecodeLost as e:
                    lost.add(e.worker.address)
                    # A grammar's state cannot be rebuilt from a new prompt: no migration.
                    structured = getattr(inp.params, "structured", None) is not None
                    if (not self.cfg.migrate_on_decode_failure or structured
                            or loop.time() >= deadline):
                        raise GatewayError(grpc.StatusCode.UNAVAILABLE, (
                            f"decode worker {e.worker.address} failed mid-stream after "
                            f"{len(out.ids)} token(s): {e}")) from None
                    self.counters.migrations += 1
                    self.metrics.observe_kv_fallback("migrate")
                    log.warning("request %s: decode worker %s failed after %d token(s) (%s); "
                                "migrating: re-prefilling prompt + tokens so far on another "
                                "pair", inp.request_id, e.worker.address, len(out.ids), e)
                finally:
                    self._cleanup(seg)
        except asyncio.TimeoutError:
            error = grpc.StatusCode.DEADLINE_EXCEEDED.name
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"request exceeded its deadline of {timeout:.1f}s") from None
        except GatewayError as e:
            error = e.code.name
            self.counters.errors += 1
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self.counters.cancelled += 1
            raise
        finally:
            if ok:
                self.counters.finished += 1
            self._observe_end(timer, span, out, ok, error)

    def _observe_end(self, timer, span, out: _Output, ok: bool, error: str | None) -> None:
        """Metrics and the request's span: finished (or cancelled: "abort") or failed."""
        if error is not None:
            timer.error(error)
            span.set_status(tracing.error_status(error))
        else:
            timer.finish(len(out.prompt), len(out.ids), (out.finish_reason or "stop") if ok else "abort")
        span.set_attribute("completion_tokens", len(out.ids))
        span.end()

    def _validate(self, inp: GenerateInput) -> None:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not inp.prompt_token_ids:
            raise GatewayError(bad, "the prompt is empty")
        if inp.params.n != 1:
            raise GatewayError(bad, "Gateway.generate() makes one completion: n must be 1")
        try:
            inp.params.validate()
        except ValueError as e:
            raise GatewayError(bad, str(e)) from None
        L, n = self.max_model_len, len(inp.prompt_token_ids)
        if L and n >= L:
            raise GatewayError(bad, f"the prompt has {n} tokens: the context length is {L}, "
                               f"so at most {L - 1} prompt tokens leave room for one generated token")
        if any(t < 0 for t in inp.prompt_token_ids):
            raise GatewayError(bad, "the prompt has negative token ids")

    async def _run_segment(self, out: _Output, seg: _Segment, deadline: float,
                           lost: set[str], first: bool) -> AsyncIterator[GenerateEvent]:
        prompt = out.prompt + out.ids
        params = out.remaining_params()
        kv, resp = await self._prefill_with_retry(seg, prompt, params, deadline, lost)
        if first:
            out.cached_tokens = max(kv.num_cached_tokens, resp.num_cached_tokens)
        out.add_energy(resp)
        fin = FINISH_FROM_PROTO.get(resp.finish_reason)
        ev = out.add([resp.first_token], fin)
        if ev is not None and first and params.prompt_logprobs is not None:
            ev.prompt_logprobs = [logprob_from_proto(t) if i else (None, None)
                                  for i, t in enumerate(resp.prompt_logprobs)]
        if out.finished:
            yield self._final(ev, out)
            return
        seg.submit_task = asyncio.create_task(self._submit_first(seg, resp.first_token, deadline))
        seg.submit_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        if ev is not None:
            yield ev
        await seg.submit_task
        async for ev in self._relay(out, seg, deadline):
            yield self._final(ev, out) if out.finished else ev

    def _final(self, ev: GenerateEvent | None, out: _Output) -> GenerateEvent:
        ev = ev or GenerateEvent([], "", [] if out.params.logprobs is not None else None,
                                 out.finish_reason, out.stop_reason)
        ev.usage = Usage(len(out.prompt), len(out.ids), out.cached_tokens, out.energy_joules)
        return ev

    # -- the two halves --------------------------------------------------------------------
    async def _prefill_with_retry(self, seg, prompt, params, deadline, lost):
        """Open Decode (KvReady), then Prefill; a failed Prefill is retried once on another
        prefill worker, with a fresh decode reservation. Returns (KvReady, PrefillResponse)."""
        failed_prefill: list[str] = []
        for attempt in range(2):
            if attempt:
                self._cleanup(seg)
                seg.__init__(f"{seg.rid}#r{attempt}", metadata=seg.metadata)
            kv = await self._open_decode(seg, prompt, params, deadline, lost)
            try:
                return kv, await self._prefill(seg, prompt, params, kv, deadline, failed_prefill)
            except grpc.aio.AioRpcError as e:
                w = seg.prefill
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    w.mark_failed(e.details() or "UNAVAILABLE")
                failed_prefill.append(w.address)
                retry = (e.code() in _PREFILL_RETRY and attempt == 0
                         and self.prefill.healthy(failed_prefill))
                if not retry:
                    raise self._error(f"prefill worker {w.address}", e) from None
                self.counters.prefill_retries += 1
                self.metrics.observe_kv_fallback("retry")
                log.warning("request %s: Prefill on %s failed (%s: %s); retrying once on another "
                            "prefill worker", seg.rid, w.address, e.code().name, e.details())
        raise AssertionError("unreachable")

    async def _open_decode(self, seg, prompt, params, deadline, lost) -> decode_pb2.KvReady:
        """Pick a decode worker, open its stream and read KvReady; a refusing or unreachable
        worker is skipped for the next one."""
        tried = set(lost)
        hashes = self._hashes("decode", prompt)
        last_error = None
        while True:
            w = self.decode.pick(tried, self._affinity["decode"], hashes, self.cfg.affinity_slack)
            if w is None:
                if last_error is not None:
                    raise last_error
                raise self._no_worker(self.decode)
            tried.add(w.address)
            req = decode_pb2.DecodeRequest(request_id=seg.rid, prompt_token_ids=prompt,
                                           sampling=sampling_to_proto(params),
                                           kv_timeout_ms=self.cfg.kv_timeout_ms)
            seg.decode_call = w.stub.Decode(req, timeout=self._remaining(deadline), metadata=seg.metadata)
            seg.decode = w
            w.in_flight += 1
            w.requests_total += 1
            try:
                msg = await seg.decode_call.read()
            except grpc.aio.AioRpcError as e:
                self._release(seg)
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise self._error(f"decode worker {w.address}", e) from None
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    w.mark_failed(e.details() or "UNAVAILABLE")
                last_error = self._error(f"decode worker {w.address}", e)
                self.counters.decode_retries += 1
                log.warning("request %s: decode worker %s refused (%s: %s); trying another",
                            seg.rid, w.address, e.code().name, e.details())
                continue
            if msg is grpc.aio.EOF or not msg.HasField("kv_ready"):
                self._release(seg)
                raise GatewayError(grpc.StatusCode.INTERNAL,
                                   f"decode worker {w.address} did not start with KvReady")
            self._affinity["decode"].record(hashes, w.address)
            return msg.kv_ready

    async def _prefill(self, seg, prompt, params, kv, deadline, exclude) -> prefill_pb2.PrefillResponse:
        hashes = self._hashes("prefill", prompt, kv.compat.block_size)
        w = self.prefill.pick(exclude, self._affinity["prefill"], hashes, self.cfg.affinity_slack,
                              compat=kv.compat)
        if w is None:
            if self.prefill.pick(exclude) is not None:       # healthy, but none can fill this KV
                raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"no prefill worker's KV layout matches decode worker "
                                   f"{kv.decode_worker_id or kv.kv_endpoint}: "
                                   f"{MessageToDict(kv.compat)}")
            raise self._no_worker(self.prefill)
        dest = prefill_pb2.KvDestination(
            decode_worker_id=kv.decode_worker_id, kv_endpoint=kv.kv_endpoint,
            transfer_id=kv.transfer_id, dst_block_ids=kv.block_ids,
            num_cached_tokens=kv.num_cached_tokens, compat=kv.compat)
        req = prefill_pb2.PrefillRequest(request_id=seg.rid, prompt_token_ids=prompt,
                                         sampling=sampling_to_proto(params), destination=dest)
        seg.prefill_call = w.stub.Prefill(req, timeout=self._remaining(deadline), metadata=seg.metadata)
        seg.prefill = w
        w.in_flight += 1
        w.requests_total += 1
        resp = await seg.prefill_call
        seg.prefill_call = None
        w.in_flight -= 1
        seg.prefill = None
        self._affinity["prefill"].record(hashes, w.address)
        return resp

    async def _submit_first(self, seg: _Segment, first: common_pb2.TokenLogprob, deadline):
        w = seg.decode
        try:
            r = await w.stub.SubmitFirstToken(
                decode_pb2.SubmitFirstTokenRequest(request_id=seg.rid, first_token=first),
                timeout=min(_SUBMIT_TIMEOUT_S, self._remaining(deadline)))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                w.mark_failed(e.details() or "UNAVAILABLE")
                raise _DecodeLost(w, f"SubmitFirstToken: {e.details()}") from None
            raise self._error(f"decode worker {w.address} (SubmitFirstToken)", e) from None
        if not r.accepted:
            raise GatewayError(grpc.StatusCode.INTERNAL,
                               f"decode worker {w.address} did not accept the first token of "
                               f"{seg.rid} (reservation expired or aborted)")

    async def _relay(self, out: _Output, seg: _Segment, deadline) -> AsyncIterator[GenerateEvent]:
        w, call = seg.decode, seg.decode_call
        while True:
            try:
                msg = await call.read()
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    w.mark_failed(e.details() or "UNAVAILABLE")
                    raise _DecodeLost(w, f"{e.code().name}: {e.details()}") from None
                raise self._error(f"decode worker {w.address}", e) from None
            if msg is grpc.aio.EOF:
                raise _DecodeLost(w, "the stream ended without a finish reason")
            if not msg.HasField("tokens"):
                continue
            chunk = msg.tokens
            fin = FINISH_FROM_PROTO.get(chunk.finish_reason)
            if fin == "error":
                seg.decode_done = True
                raise GatewayError(grpc.StatusCode.INTERNAL,
                                   f"decode worker {w.address}: {chunk.error or 'failed'}")
            if fin is not None:
                seg.decode_done = True
            if chunk.HasField("usage"):
                out.add_energy(chunk.usage)
            ev = out.add(chunk.tokens, fin)
            if ev is not None:
                yield ev
            if out.finished:
                return

    # -- helpers ---------------------------------------------------------------------------
    def _hashes(self, kind: str, prompt: list[int], block_size: int = 0) -> list[bytes]:
        pool = self.prefill if kind == "prefill" else self.decode
        return self._affinity[kind].block_hashes(prompt, block_size or pool.block_size())

    def _remaining(self, deadline: float) -> float:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise asyncio.TimeoutError
        return left

    def _no_worker(self, pool: WorkerPool) -> GatewayError:
        known = ", ".join(f"{w.address} ({w.last_error or 'not ready'})"
                          for w in pool.workers.values()) or "none discovered"
        return GatewayError(grpc.StatusCode.UNAVAILABLE,
                            f"no healthy {pool.kind} worker (known: {known})")

    def _error(self, where: str, e: grpc.aio.AioRpcError) -> GatewayError:
        code = e.code() if e.code() in _PASS_THROUGH else grpc.StatusCode.INTERNAL
        return GatewayError(code, f"{where}: {e.code().name}: {e.details()}")

    def _release(self, seg: _Segment) -> None:
        """The decode worker no longer holds this segment (refused or finished)."""
        if seg.decode is not None:
            seg.decode.in_flight -= 1
            seg.decode = None
        seg.decode_call = None

    def _cleanup(self, seg: _Segment) -> None:
        """Cancel what is still open and Abort it on the workers (in the background)."""
        if seg.submit_task is not None and not seg.submit_task.done():
            seg.submit_task.cancel()
        if seg.prefill is not None:
            seg.prefill_call.cancel()
            self._spawn(self._abort(seg.prefill, seg.rid))
            seg.prefill.in_flight -= 1
            seg.prefill = None
        if seg.decode is not None:
            seg.decode_call.cancel()
            if not seg.decode_done:
                self._spawn(self._abort(seg.decode, seg.rid))
            self._release(seg)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, w: Worker, rid: str) -> None:
        try:
            await w.stub.Abort(common_pb2.AbortRequest(request_id=rid, reason="gateway"),
                               timeout=_ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info("Abort(%s) on %s %s: %s", rid, w.kind, w.address, e.code().name)


async def merge_streams(gens: list) -> AsyncIterator[tuple[int, GenerateEvent]]:
    """(index, event) from several `generate()` streams (the choices of an n > 1 request) as
    they come; the first error is raised; leaving early closes them all."""
    if len(gens) == 1:
        agen = gens[0]
        try:
            async for ev in agen:
                yield 0, ev
        finally:
            await agen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, agen):
        try:
            async for ev in agen:
                await queue.put((i, ev))
            await queue.put((i, done))
        except BaseException as e:  # handed to the consumer, which re-raises
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
