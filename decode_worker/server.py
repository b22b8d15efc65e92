"""The decode worker: gRPC `DecodeWorker` (Decode, SubmitFirstToken, Abort, Stats, KvEvents:
services/kv_events_rpc.py) + health + reflection, and a KVReceiver (UCX by default) that
prefill workers push KV blocks into.

One Decode call (protos/pdserve/v1/decode.proto), one `Pending` (shared with SubmitFirstToken
and Abort), in five phases:

    reserve:      (a caller holding --max-reservations-per-caller already: RESOURCE_EXHAUSTED)
                  add_remote_request: blocks for the prompt minus this worker's prefix-cache
                  hits; no room (max_num_seqs, blocks): wait for it in arrival order
                  (reservations.py; its queue full, a prompt too big for the cache, or
                  the wait past kv_max_reservation_s: RESOURCE_EXHAUSTED);
                  receiver.reserve(transfer_id signed with its expiry, blocks to fill)
    announce:     stream KvReady (transfer id, KV endpoint, blocks to fill, cached, deadlines)
    wait ready:   the transfer reaches DONE, while KV keeps arriving: the receiver expires
                  it after the idle window (kv_timeout_ms or kv_expiry_s) without a KV
                  message, or at the hard bound (kv_max_reservation_s) after the
                  reservation; then SubmitFirstToken(request_id) hands in the token the
                  prefill worker sampled, within the idle window of the last layer (and
                  the bound)
    admit (or fall back, below): remote_kv_done(first token)
    stream:       tokens 2..n (last chunk: finish_reason + usage)

    local_prefill (conditional disaggregation, local.py): the prompt joins this engine as a
    local request, no reserve, announce or wait; the stream carries every token from the first

    Failure (expired, failed transfer, or no first token in time), by policy:
      fail:      free the blocks, end the stream with FINISH_REASON_ERROR and the reason
      recompute: abort the reservation and re-add the request locally with prompt (+ the
                 first token when it is known) so this worker computes the prompt itself;
                 counted in `fallbacks` and logged at WARNING
    Abort(request_id) or the caller's cancel: abort in the receiver (late KV is dropped by
    transfer id) and in the engine (blocks freed); FINISH_REASON_ABORT ends the stream.
    Drain (SIGTERM): the same abort near the drain's end for the calls still open, but the
    stream ends with UNAVAILABLE "worker draining": the gateway migrates it (handoff.py).

Token accounting: the first token went to the client from PrefillResponse, so it is never
repeated here, except when the decoder recomputed without knowing it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time

import grpc

from engine.async_engine import EngineError
from engine.outputs import RequestOutput
from kvtransfer.receiver import KVReceiver, TransferState
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services import prefill_cost, protoconv, service_names, tracing, worker_server
from services.kv_events_rpc import KvEventsRpc
from services.security import caller_of, new_transfer_id
from services.worker_server import Draining, RpcStatus, WorkerParts

from .config import DecodeWorkerConfig
from .handoff import DRAINING, Handoff
from .local import local_decode
from .pending import Counters, Aborted, error_chunk, Pending
from .reservations import ReservationQueue, fits

log = logging.getLogger(__name__)
MAX_KV_TIMEOUT_MS = 600_000          # a reservation holds blocks: at most 10 minutes
_POLICIES = {decode_pb2.KV_FAILURE_POLICY_FAIL: "fail", decode_pb2.KV_FAILURE_POLICY_RECOMPUTE: "recompute"}


class DecodeServicer(KvEventsRpc, decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, parts: WorkerParts):
        self.cfg: DecodeWorkerConfig = parts.cfg
        self.ae, self.receiver, self.srv = parts.engine, parts.kv, parts.srv
        self.worker_id, self.metrics, self.meter = parts.worker_id, parts.metrics, parts.meter
        self.compat, self.block_size, self.token = self.receiver.compat, self.ae.block_size, parts.token
        self.kv_events = parts.kv_events     # KvEvents: services/kv_events_rpc.py
        self._pending: dict[str, Pending] = {}
        self.counters = Counters()
        self.reservations = ReservationQueue(self.cfg.max_waiting_reservations)
        self.prefill_cost: tuple[float, float] | None = None    # a local prefill's: the warm-up's
        self.handoff = Handoff(lambda: list(self._pending.values()), self._hand_off,
                               self.cfg.drain_timeout_s, self.cfg.drain_migrate_s)
        self.srv.on_drain(self.handoff.start)

    # -------------------------------------------------------------- RPCs
    async def Decode(self, request, context):
        # Not made current: this is an async generator (its context is the caller's task's).
        span = tracing.start_span("pdserve.decode", tracing.extract_context(context),
                                    tracing.tracing_enabled() and {
                                        "request_id": request.request_id,
                                        "prompt_tokens": len(request.prompt_token_ids)})
        try:
            with self.srv.track():
                async for msg in self._decode(request, span, caller_of(context)):
                    yield msg
        except Draining as e:
            span.set_status(tracing.error_status(str(e)))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except RpcStatus as e:
            span.set_status(tracing.error_status(e.message))
            await context.abort(e.code, e.message)
        finally:
            span.end()

    async def SubmitFirstToken(self, request, context):
        tid = request.first_token.token_id
        if not 0 <= tid < self.ae.vocab_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"first_token.token_id {tid} is "
                                f"outside the vocabulary [0, {self.ae.vocab_size})")
        pend = self._pending.get(request.request_id)
        if pend is None or pend.aborted or pend.first_token.done():
            return decode_pb2.SubmitFirstTokenResponse(accepted=False)
        pend.first_token.set_result(request.first_token)
        return decode_pb2.SubmitFirstTokenResponse(accepted=True)

    async def Abort(self, request, context):
        pend = self._pending.get(request.request_id)
        if pend is None or pend.aborted:
            return common_pb2.AbortResponse(found=False)
        log.info("abort %s: %s", request.request_id, request.reason or "no reason given")
        await self._abort(pend, request.reason)
        return common_pb2.AbortResponse(found=True)

    async def _abort(self, pend: Pending, reason: str) -> None:
        """Stop `pend` wherever it is: its transfer, its first-token wait, its engine
        request (blocks freed); its stream then ends by _abort_chunk."""
        pend.aborted, pend.abort_reason = True, reason
        if pend.transfer_id:
            self.receiver.abort(pend.transfer_id, f"request aborted: {reason}")
        if not pend.first_token.done():
            pend.first_token.set_exception(Aborted())
        await worker_server.abort_quietly(self.ae, pend.request_id)
        self.reservations.wake()             # waiting for room: it leaves the queue

    async def _hand_off(self, pend: Pending) -> None:
        """Draining: end `pend` with UNAVAILABLE "worker draining" (the gateway migrates it)."""
        pend.drained = True
        await self._abort(pend, DRAINING)

    async def Stats(self, request, context):
        st, r, c = self.ae.stats(), self.receiver, self.counters
        queued = sum(p.queued_tokens for p in self._pending.values() if p.transfer_id and not p.kv_done)
        return decode_pb2.DecodeStats(
            worker_id=self.worker_id,
            num_waiting=st.num_waiting + st.num_waiting_for_remote_kv + len(self.reservations),
            num_waiting_for_kv=st.num_waiting_for_remote_kv, num_running=st.num_running,
            free_kv_blocks=st.num_free_blocks, total_kv_blocks=st.num_total_blocks, queued_prefill_tokens=queued,
            transfers=common_pb2.TransferCounters(
                transfers_done=r.transfers_done, blocks=r.blocks_received, bytes=r.bytes_received,
                failures=r.failed, expirations=r.expired + c.token_expirations),
            compat=protoconv.compat_to_proto(self.compat), kv_endpoint=self.receiver.address,
            max_model_len=self.ae.max_model_len, prefill_cost=prefill_cost.to_proto(self.prefill_cost))

    # -------------------------------------------------------------- Decode body
    def _validate(self, request, span, caller: str) -> Pending:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        params = worker_server.new_request_params(request, self._pending)
        cap = self.cfg.max_reservations_per_caller
        held = sum(1 for p in self._pending.values() if p.caller == caller and not p.t_decode)
        if cap and held >= cap:
            raise RpcStatus(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{caller} already holds {held} KV reservations on this decode worker "
                            f"(--max-reservations-per-caller {cap})")
        if not 0 <= request.kv_timeout_ms <= MAX_KV_TIMEOUT_MS:
            raise RpcStatus(bad, f"kv_timeout_ms must be in [0, {MAX_KV_TIMEOUT_MS}], "
                                 f"got {request.kv_timeout_ms}")
        timeout = request.kv_timeout_ms / 1000 if request.kv_timeout_ms else self.cfg.kv_expiry_s
        policy = _POLICIES.get(request.kv_failure_policy, self.cfg.kv_failure_policy)
        ids = list(request.prompt_token_ids)
        return Pending(request.request_id, ids, params, timeout,
                        max(self.cfg.kv_max_reservation_s, timeout), policy,
                        asyncio.get_running_loop().create_future(), span,
                        common_pb2.Usage(prompt_tokens=len(ids)), caller=caller)

    async def _decode(self, request, span=tracing.INVALID_SPAN, caller: str = ""):
        pend = self._validate(request, span, caller)
        self._pending[pend.request_id] = pend
        try:
            if request.local_prefill:          # conditional disaggregation: local.py
                async for msg in local_decode(self, pend):
                    yield msg
                return
            await self._reserve(pend)
            if pend.aborted:
                yield self._abort_chunk(pend)
                return
            yield self._announce(pend)
            problem, first = await self._wait_ready(pend)
            if pend.aborted:
                yield self._abort_chunk(pend)
                return
            failed = await self._admit_or_fall_back(pend, problem, first)
            if failed is not None:
                yield failed
                return                 # _end: blocks freed, reservation aborted
            async for msg in self._stream(pend):
                yield msg
        except EngineError as e:
            raise RpcStatus(grpc.StatusCode.INTERNAL, str(e)) from None
        finally:
            await self._end(pend)

    async def _reserve(self, pend: Pending) -> None:
        """Blocks for the prompt minus this worker's prefix-cache hits; the receiver expects
        the KV of the rest by the deadline."""
        try:
            res = await self.reservations.reserve(
                lambda: self.ae.add_remote_request(pend.request_id, pend.prompt, pend.params),
                fits(len(pend.prompt), self.block_size, self.ae.stats().num_total_blocks),
                pend.max_s, lambda: pend.aborted)
        except ValueError as e:
            raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if res is None and pend.aborted:
            return
        if res is None:
            raise RpcStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, self.reservations.refusal(
                len(pend.prompt), self.ae.stats()))
        block_ids, n_cached = res
        pend.usage.cached_tokens = n_cached
        pend.fill = block_ids[n_cached // self.block_size:]
        pend.deadline = time.monotonic() + pend.max_s
        pend.reserved_unix = time.time()
        if pend.aborted:
            return
        # unguessable (the KV handshake's token) and signed with its expiry: a prefill worker
        # computes nothing for an id no decode worker made (services/security.py)
        pend.expires_at_ms = int((pend.reserved_unix + pend.timeout) * 1000)
        pend.kv_id = tid = new_transfer_id(self.token, pend.expires_at_ms)
        if pend.fill:
            self.receiver.reserve(tid, pend.fill, pend.timeout, pend.max_s)
            pend.transfer_id, pend.queued_tokens = tid, len(pend.prompt) - n_cached
        tracing.record_span("pdserve.decode.reservation", pend.span, pend.t_reserve, time.monotonic(),
                            tracing.tracing_enabled() and {"blocks": len(pend.fill),
                                                           "cached_tokens": n_cached})

    def _announce(self, pend: Pending) -> decode_pb2.DecodeResponse:
        """KvReady: where and into which blocks the prefill worker pushes the KV."""
        return decode_pb2.DecodeResponse(request_id=pend.request_id, kv_ready=decode_pb2.KvReady(
            transfer_id=pend.kv_id, kv_endpoint=self.receiver.address,
            block_ids=pend.fill, num_cached_tokens=pend.usage.cached_tokens,
            compat=protoconv.compat_to_proto(self.compat), decode_worker_id=self.worker_id,
            expires_at_unix_ms=pend.expires_at_ms, idle_timeout_ms=int(pend.timeout * 1000),
            max_expires_at_unix_ms=int((pend.reserved_unix + pend.max_s) * 1000)))

    async def _wait_ready(self, pend: Pending):
        """The KV and the first token, both by the deadline. Returns (problem or None,
        first TokenLogprob or None)."""
        t_wait = time.monotonic()
        problem, first = await self._wait_kv_and_first_token(pend)
        tracing.record_span("pdserve.decode.transfer_wait", pend.span, t_wait, time.monotonic(),
                            tracing.tracing_enabled() and {"problem": problem or ""})
        pend.t_decode = time.monotonic()
        return problem, first

    async def _wait_kv_and_first_token(self, pend: Pending):
        problem = None
        if pend.transfer_id:
            res = await self.receiver.wait(pend.transfer_id, timeout=pend.max_s + 5.0)  # reaper bounds it
            pend.kv_done = True
            if res.state is TransferState.ABORTED:
                return "aborted", None
            if res.state is not TransferState.DONE:
                problem = f"KV transfer {res.transfer_id} {res.state.value}: {res.reason}"
                self.metrics.observe_kv_failure()
        # A failed transfer with policy recompute still waits for the first token (the prefill
        # worker usually sampled it): recomputing with it, the stream never repeats it.
        if problem is None or pend.policy == "recompute":
            now = time.monotonic()    # due within the idle window of the KV's end, and the bound
            try:
                first = await asyncio.wait_for(asyncio.shield(pend.first_token),
                                               max(min(pend.timeout, pend.deadline - now), 0.0))
                return problem, first
            except asyncio.TimeoutError:
                if problem is None:
                    self.counters.token_expirations += 1
                    problem = (f"reservation expired: no SubmitFirstToken for {pend.request_id!r} "
                               f"within {pend.timeout:.3g}s of its KV")
            except Aborted:
                return "aborted", None
        first = pend.first_token.result() if pend.first_token.done() and not pend.aborted else None
        if first is None:
            pend.first_token.cancel()     # too late: a SubmitFirstToken now is not accepted
        return problem, first

    async def _admit_or_fall_back(self, pend: Pending, problem: str | None, first):
        """Admit the request to the running batch with the prefill worker's first token; on
        a problem, by policy: an error chunk to end the stream with (fail), or recompute
        the prompt here (None)."""
        if problem is None:
            await self.ae.remote_kv_done(pend.request_id, first.token_id, first.logprob,
                                         [(t.token_id, t.logprob) for t in first.top_logprobs] or None)
            pend.sent = 1
        elif pend.policy == "fail":
            log.warning("request %s failed (policy fail): %s", pend.request_id, problem)
            return error_chunk(pend.request_id, common_pb2.FINISH_REASON_ERROR, problem, pend.usage)
        else:
            pend.offset = pend.sent = await self._recompute(pend, first, problem)
        return None

    async def _stream(self, pend: Pending):
        """The engine's outputs as TokenChunks, never repeating a token the client has."""
        async for out in self.ae.stream(pend.request_id, coalesce=True):   # one message per catch-up
            self.metrics.token_path.since("to_loop", out.emitted_at)      # services/token_path.py
            n_client = pend.offset + len(out.token_ids)
            new = max(n_client - pend.sent, 0)
            chunk = decode_pb2.TokenChunk(tokens=protoconv.output_tokens(out, new) if new else [])
            pend.sent = max(pend.sent, n_client)
            if out.finished:
                if out.finish_reason == "abort":
                    yield self._abort_chunk(pend, pend.sent)
                    return
                self._finish(pend, chunk, out)
            if chunk.tokens or out.finished:
                yield decode_pb2.DecodeResponse(request_id=pend.request_id, tokens=chunk)

    def _finish(self, pend: Pending, chunk: decode_pb2.TokenChunk, out: RequestOutput) -> None:
        """The last chunk: finish reason, usage (with energy where measured), metrics, span."""
        usage, span = pend.usage, pend.span
        usage.completion_tokens = pend.sent
        now = time.monotonic()
        self.metrics.observe_phases(decode_s=now - pend.t_decode)
        tracing.record_span("pdserve.decode.generate", span, pend.t_decode, now,
                            tracing.tracing_enabled() and {"completion_tokens": pend.sent})
        joules = self.meter.pop(pend.request_id)
        if joules is not None:
            usage.energy_joules = joules
            span.set_attribute("energy_joules", joules)
        if pend.local:                 # the engine's own prefix hit for the prompt
            usage.cached_tokens = max(out.num_cached_tokens, 0)
        chunk.finish_reason = protoconv.FINISH_TO_PROTO[out.finish_reason]
        chunk.usage.CopyFrom(usage)
        pend.finished = True

    async def _end(self, pend: Pending) -> None:
        """Whatever happened: forget the call and its transfer; unless the stream finished,
        abort the engine request (its blocks are freed); a call waiting for room tries."""
        self._pending.pop(pend.request_id, None)
        self.meter.pop(pend.request_id)
        if pend.transfer_id:
            self.receiver.abort(pend.transfer_id, "request ended")   # no-op once final
        if not pend.finished:
            await asyncio.shield(worker_server.abort_quietly(self.ae, pend.request_id))
        self.reservations.wake()

    async def _recompute(self, pend: Pending, first, problem: str) -> int:
        """Policy recompute: drop the reservation, compute the prompt here. Returns how many
        client tokens the engine's token list will not contain (1 if `first` is known)."""
        self.counters.fallbacks += 1
        self.metrics.observe_kv_fallback("recompute")
        log.warning("request %s: %s; recomputing the prompt on this decode worker (fallback #%d)",
                    pend.request_id, problem, self.counters.fallbacks)
        prompt, p, params = pend.prompt, pend.params, pend.params
        if first is not None:
            prompt = pend.prompt + [first.token_id]
            p = dataclasses.replace(
                params, max_tokens=None if params.max_tokens is None else max(params.max_tokens - 1, 1),
                min_tokens=max(min(params.min_tokens - 1, (params.max_tokens or 2) - 2), 0))
        try:
            await self.ae.recompute_locally(pend.request_id, prompt, p,
                                            [] if first is None else [first.token_id])
        except ValueError as e:
            raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, f"cannot recompute: {e}") from None
        return 0 if first is None else 1

    def _abort_chunk(self, pend: Pending, sent: int = 0) -> decode_pb2.DecodeResponse:
        """The chunk an aborted stream ends with; a drained one ends UNAVAILABLE instead."""
        if pend.drained:
            raise RpcStatus(grpc.StatusCode.UNAVAILABLE, DRAINING)
        pend.usage.completion_tokens = sent
        pend.finished = True
        return error_chunk(pend.request_id, common_pb2.FINISH_REASON_ABORT,
                            f"aborted: {pend.abort_reason}" if pend.abort_reason else "", pend.usage)


class DecodeRole(worker_server.WorkerRole):
    """The decode worker for services.worker_server.serve: no KV connector (the KV comes
    in); its KV endpoint is a KVReceiver writing into the engine's cache."""
    name, service_name = "decode", service_names.DECODE

    def kv_address(self, cfg: DecodeWorkerConfig) -> tuple[str, int]:
        return cfg.kv_host or cfg.host, cfg.kv_port

    async def open_kv(self, cfg: DecodeWorkerConfig, engine, transport, connector) -> KVReceiver:
        receiver = KVReceiver(engine.kv_cache, worker_server.model_compat(engine), transport,
                              expiry_s=cfg.kv_expiry_s, max_s=cfg.kv_max_reservation_s,
                              staging=cfg.kv_staging, kv_scales=engine.kv_scales)
        log.info("decode KV endpoint %s", await receiver.start())
        return receiver

    async def warm_up(self, servicer: DecodeServicer, engine) -> None:
        """A tiny prompt, then a local prefill's cost for Stats (services/prefill_cost.py)."""
        _, servicer.prefill_cost = await prefill_cost.warm_up(engine, False, "local prefill")

    config_class, servicer_class = DecodeWorkerConfig, DecodeServicer
    add_to_server = staticmethod(decode_pb2_grpc.add_DecodeWorkerServicer_to_server)

ROLE = DecodeRole()

if __name__ == "__main__":
    sys.exit(worker_server.main(ROLE))
