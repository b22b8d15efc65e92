"""The decode worker: gRPC `DecodeWorker` (Decode, SubmitFirstToken, Abort, Stats) + health
+ reflection, and a KVReceiver (UCX) that prefill workers push KV blocks into.

One Decode call (see protos/pdserve/v1/decode.proto):

    add_remote_request: reserve blocks for the prompt minus this worker's prefix-cache hits
        (none free: RESOURCE_EXHAUSTED); receiver.reserve(transfer_id, blocks to fill)
    -> stream KvReady{transfer_id, kv_endpoint, block_ids to fill, num_cached_tokens, compat}
    -> wait, both bounded by the reservation deadline (kv_timeout_ms or kv_expiry_s):
         the transfer reaches DONE (the receiver's reaper expires it at the deadline), and
         SubmitFirstToken(request_id) hands in the token the prefill worker sampled
    -> remote_kv_done(first token) -> stream tokens 2..n (last chunk: finish_reason + usage)

    Failure (expired, failed transfer, or no first token in time), by policy:
      fail:      free the blocks, end the stream with FINISH_REASON_ERROR and the reason
      recompute: abort the reservation and re-add the request locally with prompt (+ the
                 first token when it is known) so this worker computes the prompt itself;
                 counted in `fallbacks` and logged at WARNING
    Abort(request_id) or the caller's cancel: abort in the receiver (late KV is dropped by
    transfer id) and in the engine (blocks freed); an Abort ends the stream with
    FINISH_REASON_ABORT.

Token accounting on the stream: the first token went to the client from PrefillResponse, so
it is never repeated here, except when the decoder recomputed without knowing it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
import uuid
from dataclasses import dataclass

import grpc

from engine.async_engine import AsyncEngine, EngineError
from engine.sampling_params import SamplingParams
from kvtransfer.receiver import KVReceiver, TransferState
from services import energy
from services.energy import EnergyMeter
from services.metrics import Metrics
from services import telemetry
from services import tracing
from services import protoconv, worker_server
from services.cli_args import config_from_argv
from services.worker_server import Draining, WorkerServer, limit_threads
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from .config import DecodeWorkerConfig

log = logging.getLogger(__name__)
SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
_POLICIES = {decode_pb2.KV_FAILURE_POLICY_FAIL: "fail", decode_pb2.KV_FAILURE_POLICY_RECOMPUTE: "recompute"}


class _Status(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _Aborted(Exception):
    pass


@dataclass
class _Pending:
    """One Decode call's state shared with SubmitFirstToken/Abort (all on the loop)."""
    request_id: str
    first_token: asyncio.Future
    transfer_id: str = ""
    queued_tokens: int = 0            # prompt tokens still to arrive over KV
    kv_done: bool = False
    aborted: bool = False
    abort_reason: str = ""


@dataclass
class Counters:
    token_expirations: int = 0        # KV arrived but SubmitFirstToken did not, in time
    failed_requests: int = 0          # streams ended with FINISH_REASON_ERROR
    fallbacks: int = 0                # prompts recomputed here (policy recompute)


def _error_chunk(rid: str, reason, message: str, usage: common_pb2.Usage) -> decode_pb2.DecodeResponse:
    return decode_pb2.DecodeResponse(request_id=rid, tokens=decode_pb2.TokenChunk(
        finish_reason=reason, error=message, usage=usage))


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, cfg: DecodeWorkerConfig, aengine: AsyncEngine, receiver: KVReceiver,
                 srv: WorkerServer, worker_id: str, metrics: Metrics | None = None,
                 meter: EnergyMeter | None = None):
        self.cfg, self.ae, self.receiver, self.srv = cfg, aengine, receiver, srv
        self.worker_id = worker_id
        self.metrics = metrics or Metrics("decode")
        self.meter = meter or EnergyMeter(None)
        self.compat = receiver.compat
        self.block_size = aengine.engine.kv.block_size
        self._pending: dict[str, _Pending] = {}
        self.counters = Counters()

    # -------------------------------------------------------------- RPCs
    async def Decode(self, request, context):
        # Not made current: this is an async generator (its context is the caller's task's).
        span = tracing.start_span("pdserve.decode", tracing.extract_context(context),
                                    tracing.tracing_enabled() and {
                                        "request_id": request.request_id,
                                        "prompt_tokens": len(request.prompt_token_ids)})
        try:
            with self.srv.track():
                async for msg in self._decode(request, span):
                    yield msg
        except Draining as e:
            span.set_status(tracing.error_status(str(e)))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except _Status as e:
            span.set_status(tracing.error_status(e.message))
            await context.abort(e.code, e.message)
        finally:
            span.end()

    async def SubmitFirstToken(self, request, context):
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
        pend.aborted, pend.abort_reason = True, request.reason
        if pend.transfer_id:
            self.receiver.abort(pend.transfer_id, f"request aborted: {request.reason}")
        if not pend.first_token.done():
            pend.first_token.set_exception(_Aborted())
        try:
            await self.ae.abort(request.request_id)
        except EngineError:
            pass
        return common_pb2.AbortResponse(found=True)

    async def Stats(self, request, context):
        st, r, c = self.ae.stats(), self.receiver, self.counters
        queued = sum(p.queued_tokens for p in self._pending.values() if p.transfer_id and not p.kv_done)
        return decode_pb2.DecodeStats(
            worker_id=self.worker_id, num_waiting=st.num_waiting + st.num_waiting_for_remote_kv,
            num_waiting_for_kv=st.num_waiting_for_remote_kv, num_running=st.num_running,
            free_kv_blocks=st.num_free_blocks, total_kv_blocks=st.num_total_blocks,
            queued_prefill_tokens=queued,
            transfers=common_pb2.TransferCounters(
                transfers_done=r.transfers_done, blocks=r.blocks_received, bytes=r.bytes_received,
                failures=r.failed, expirations=r.expired + c.token_expirations),
            compat=protoconv.compat_to_proto(self.compat))

    # -------------------------------------------------------------- Decode body
    def _validate(self, request) -> tuple[SamplingParams, list[int], float, str]:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not request.request_id:
            raise _Status(bad, "request_id is required")
        if request.request_id in self._pending:
            raise _Status(bad, f"request id {request.request_id!r} is already in flight")
        try:
            params = protoconv.worker_sampling_from_proto(request.sampling)
        except (ValueError, TypeError) as e:
            raise _Status(bad, str(e)) from None
        if request.kv_timeout_ms < 0:
            raise _Status(bad, f"kv_timeout_ms must be >= 0, got {request.kv_timeout_ms}")
        timeout = request.kv_timeout_ms / 1000 if request.kv_timeout_ms else self.cfg.kv_expiry_s
        policy = _POLICIES.get(request.kv_failure_policy, self.cfg.kv_failure_policy)
        return params, list(request.prompt_token_ids), timeout, policy

    async def _decode(self, request, span=tracing.INVALID_SPAN):
        params, ids, timeout, policy = self._validate(request)
        rid = request.request_id
        t_reserve = time.monotonic()
        pend = _Pending(rid, asyncio.get_running_loop().create_future())
        self._pending[rid] = pend
        finished = False
        usage = common_pb2.Usage(prompt_tokens=len(ids))
        try:
            try:
                res = await self.ae.add_remote_request(rid, ids, params)
            except ValueError as e:
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            if res is None:
                st = self.ae.stats()
                raise _Status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"not enough free KV blocks for a {len(ids)}-token prompt "
                              f"({st.num_free_blocks} of {st.num_total_blocks} free)")
            block_ids, n_cached = res
            usage.cached_tokens = n_cached
            fill = block_ids[n_cached // self.block_size:]
            deadline = time.monotonic() + timeout
            if pend.aborted:
                yield self._abort_chunk(pend, usage)
                finished = True
                return
            tid = uuid.uuid4().hex
            if fill:
                self.receiver.reserve(tid, fill, timeout)
                pend.transfer_id, pend.queued_tokens = tid, len(ids) - n_cached
            tracing.record_span("pdserve.decode.reservation", span, t_reserve, time.monotonic(),
                                  tracing.tracing_enabled() and {"blocks": len(fill), "cached_tokens": n_cached})
            yield decode_pb2.DecodeResponse(request_id=rid, kv_ready=decode_pb2.KvReady(
                transfer_id=tid, kv_endpoint=self.receiver.address, block_ids=fill,
                num_cached_tokens=n_cached, compat=protoconv.compat_to_proto(self.compat),
                decode_worker_id=self.worker_id,
                expires_at_unix_ms=int((time.time() + timeout) * 1000)))

            t_wait = time.monotonic()
            problem, first = await self._wait_ready(pend, deadline, timeout)
            tracing.record_span("pdserve.decode.transfer_wait", span, t_wait, time.monotonic(),
                                  tracing.tracing_enabled() and {"problem": problem or ""})
            t_decode = time.monotonic()
            if pend.aborted:
                yield self._abort_chunk(pend, usage)
                finished = True
                return
            offset = sent = 0          # client tokens not in the engine's list / delivered
            if problem is None:
                await self.ae.remote_kv_done(rid, first.token_id, first.logprob,
                                                    [(t.token_id, t.logprob) for t in first.top_logprobs] or None)
                sent = 1
            elif policy == "fail":
                self.counters.failed_requests += 1
                log.warning("request %s failed (policy fail): %s", rid, problem)
                yield _error_chunk(rid, common_pb2.FINISH_REASON_ERROR, problem, usage)
                return                 # finally: blocks freed, reservation aborted
            else:
                offset = sent = await self._recompute(rid, ids, params, first, problem)
            async for out in self.ae.stream(rid, coalesce=True):   # one message per catch-up
                n_client = offset + len(out.token_ids)
                new = max(n_client - sent, 0)
                chunk = decode_pb2.TokenChunk(tokens=protoconv.output_tokens(out, new) if new else [])
                sent = max(sent, n_client)
                if out.finished:
                    if out.finish_reason == "abort":
                        yield self._abort_chunk(pend, usage, sent)
                        finished = True
                        return
                    usage.completion_tokens = sent
                    now = time.monotonic()
                    self.metrics.observe_phases(decode_s=now - t_decode)
                    tracing.record_span("pdserve.decode.generate", span, t_decode, now,
                                          tracing.tracing_enabled() and {"completion_tokens": sent})
                    joules = self.meter.pop(rid)
                    if joules is not None:
                        usage.energy_joules = joules
                        span.set_attribute("energy_joules", joules)
                    chunk.finish_reason = protoconv.FINISH_TO_PROTO[out.finish_reason]
                    chunk.usage.CopyFrom(usage)
                    finished = True
                if chunk.tokens or out.finished:
                    yield decode_pb2.DecodeResponse(request_id=rid, tokens=chunk)
        except EngineError as e:
            raise _Status(grpc.StatusCode.INTERNAL, str(e)) from None
        finally:
            self._pending.pop(rid, None)
            self.meter.pop(rid)
            if pend.transfer_id:
                self.receiver.abort(pend.transfer_id, "request ended")   # no-op once final
            if not finished:
                await asyncio.shield(self._abort_quietly(rid))

    async def _wait_ready(self, pend: _Pending, deadline: float, timeout: float):
        """Wait for the KV (if any) and the first token, both by the deadline.
        Returns (problem or None, first TokenLogprob or None)."""
        problem = None
        if pend.transfer_id:
            res = await self.receiver.wait(pend.transfer_id, timeout=timeout + 5.0)  # reaper bounds it
            pend.kv_done = True
            if res.state is TransferState.ABORTED:
                return "aborted", None
            if res.state is not TransferState.DONE:
                problem = f"KV transfer {res.transfer_id} {res.state.value}: {res.reason}"
                self.metrics.observe_kv_failure()
        if problem is None:
            try:
                first = await asyncio.wait_for(asyncio.shield(pend.first_token),
                                               max(deadline - time.monotonic(), 0.0))
                return None, first
            except asyncio.TimeoutError:
                self.counters.token_expirations += 1
                problem = (f"reservation expired: no SubmitFirstToken for {pend.request_id!r} "
                           f"within {timeout:.3g}s")
            except _Aborted:
                return "aborted", None
        first = pend.first_token.result() if pend.first_token.done() and not pend.aborted else None
        return problem, first

    async def _recompute(self, rid: str, ids: list[int], params: SamplingParams, first,
                         problem: str) -> int:
        """Policy recompute: drop the reservation, compute the prompt here. Returns how many
        client tokens the engine's token list will not contain (1 if `first` is known)."""
        self.counters.fallbacks += 1
        self.metrics.observe_kv_fallback("recompute")
        log.warning("request %s: %s; recomputing the prompt on this decode worker (fallback #%d)",
                    rid, problem, self.counters.fallbacks)
        prompt, p = ids, params
        if first is not None:
            prompt = ids + [first.token_id]
            p = dataclasses.replace(
                params, max_tokens=None if params.max_tokens is None else max(params.max_tokens - 1, 1),
                min_tokens=max(min(params.min_tokens - 1, (params.max_tokens or 2) - 2), 0))

        def cmd():
            eng = self.ae.engine
            eng.abort_request(rid)               # frees the reserved blocks; the stream stays
            eng.add_request(rid, prompt, p)
        try:
            await self.ae.call(cmd)
        except ValueError as e:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"cannot recompute: {e}") from None
        return 0 if first is None else 1

    def _abort_chunk(self, pend: _Pending, usage, sent: int = 0) -> decode_pb2.DecodeResponse:
        usage.completion_tokens = sent
        return _error_chunk(pend.request_id, common_pb2.FINISH_REASON_ABORT,
                            f"aborted: {pend.abort_reason}" if pend.abort_reason else "", usage)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.ae.abort(rid)
        except EngineError:
            pass

    async def warm_up(self) -> None:
        """One tiny local request through the engine so the first real one has no cold start."""
        rid = f"warmup-{uuid.uuid4().hex[:8]}"
        n = max(1, min(self.block_size - 3, 8))
        await self.ae.add_request(rid, list(range(1, n + 1)),
                                  SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        async for _ in self.ae.stream(rid):
            pass


async def serve(cfg: DecodeWorkerConfig, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then drain and return."""
    from kvtransfer.ucx import UcxTransport   # imports ucxx; only the serving process needs it
    engine = await asyncio.to_thread(cfg.build_engine)
    srv = WorkerServer([SERVICE], cfg.host, cfg.port, cfg.drain_timeout_s)
    worker_id = cfg.worker_id or f"decode-{cfg.host}:{srv.port}"
    receiver = KVReceiver(engine.kv_cache, worker_server.model_compat(engine),
                          UcxTransport(cfg.kv_host or cfg.host, cfg.kv_port), expiry_s=cfg.kv_expiry_s)
    address = await receiver.start()
    tel = telemetry.start_role_telemetry("decode", host=cfg.host, metrics_port=cfg.metrics_port or None,
                                         trace_file=cfg.trace_file, device=cfg.device)
    energy.instrument_engine_steps(engine, tel.meter)
    ae = AsyncEngine(engine, name="decode-engine")
    ae.start()
    tel.metrics.watch_engine(ae.stats)
    servicer = DecodeServicer(cfg, ae, receiver, srv, worker_id, tel.metrics, tel.meter)
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, srv.server)
    log.info("decode worker %s: KV endpoint %s", worker_id, address)
    try:
        await srv.run(servicer.warm_up, ready, stop)
    finally:
        await ae.shutdown()
        await receiver.close()
        tel.close()
        log.info("decode worker %s stopped", worker_id)


def run(cfg: DecodeWorkerConfig) -> None:
    import uvloop
    limit_threads(cfg.num_threads)
    uvloop.run(serve(cfg))


def main(argv: list[str] | None = None) -> int:
    run(config_from_argv(DecodeWorkerConfig, argv, "pdserve decode worker"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
