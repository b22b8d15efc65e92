"""The prefill worker: gRPC `PrefillWorker` (Prefill, Abort, Stats) + health + reflection.

One Prefill call (see protos/pdserve/v1/prefill.proto for the whole lifecycle):

    validate params, prompt and destination (INVALID_ARGUMENT); compat check against the
    decoder's KvCompat (FAILED_PRECONDITION naming both sides)
      -> KVSender.open(transfer to destination.kv_endpoint): connect + HELLO handshake
         (UNAVAILABLE if unreachable, FAILED_PRECONDITION if the decoder rejects us)
      -> engine.add_request(prefill_only=True)
      -> engine thread, inside step(): after layer i's KV is written, `_layer_hook` pushes
         layer i of the blocks the decoder lacks (blocks >= num_cached_tokens // block_size)
      -> first token sampled; await every send (bounded by kv_send_timeout_s)
      -> engine.release(): blocks back to the pool -> PrefillResponse
    Any error, Abort(request_id) or the caller's cancel: cancel the transfer, abort the
    engine request (frees its blocks).

Chunked prefill: the hook pushes only in the step that runs a request's FINAL chunk (the one
that samples). By then the earlier chunks' KV is complete, so layer i of EVERY block is ready
as soon as the final chunk's layer i is written: the sends still overlap the final chunk's
compute, and each layer is one message (the earlier chunks' sends do not overlap compute).

The source blocks are only known once the scheduler allocated them (in the step), so the
transfer is opened with the destination ids as a placeholder and bound to the request's
real block ids in the hook at the first pushed layer (`TransferHandle.set_source`).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from dataclasses import dataclass

import grpc

from engine.async_engine import AsyncEngine, EngineError
from engine.kv_cache_manager import cdiv
from engine.sampling_params import SamplingParams
from kvtransfer.sender import KVSender, KVTransferTimeout, TransferHandle
from kvtransfer.transport import TransportError
from kvtransfer.wire import IncompatibleKV
from services import energy
from services.energy import EnergyMeter
from services.metrics import Metrics
from services import telemetry
from services import tracing
from protos.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from services import protoconv, worker_server
from .config import PrefillWorkerConfig
from services.cli_args import config_from_argv
from services.worker_server import Draining, WorkerServer, limit_threads

log = logging.getLogger(__name__)
SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name


class _Status(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class _Push:
    """A request's outgoing transfer, shared with the engine thread's layer hook."""
    handle: TransferHandle
    first_block: int                  # index in the request's block table of the first block sent
    bound: bool = False
    error: Exception | None = None
    span: object = tracing.INVALID_SPAN   # pdserve.kv.send: one event per pushed layer


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, cfg: PrefillWorkerConfig, aengine: AsyncEngine, sender: KVSender,
                 srv: WorkerServer, worker_id: str, metrics: Metrics | None = None,
                 meter: EnergyMeter | None = None):
        self.cfg, self.ae, self.sender, self.srv = cfg, aengine, sender, srv
        self.worker_id = worker_id
        self.metrics = metrics or Metrics("prefill")
        self.meter = meter or EnergyMeter(None)
        eng = aengine.engine
        self.compat = sender.compat
        self.block_size = eng.kv.block_size
        self.vocab_size = eng.config.model.vocab_size
        self.max_model_len = eng.config.model.max_model_len
        self._pushes: dict[str, _Push] = {}          # read by the engine thread (GIL-atomic ops)
        self._tasks: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()
        eng.layer_hook = self._layer_hook

    # -------------------------------------------------------------- engine thread
    def _layer_hook(self, layer: int, sched) -> None:
        for s in sched.scheduled:
            push = self._pushes.get(s.request.request_id)
            if push is None or push.error is not None or not s.samples:
                continue
            try:
                if not push.bound:
                    n = len(push.handle.dst_block_ids)
                    push.handle.set_source(s.request.block_ids[push.first_block:push.first_block + n])
                    push.bound = True
                self.sender.push_layer_threadsafe(push.handle, layer)
                if push.span.is_recording():
                    push.span.add_event("layer", {"layer": layer})
            except Exception as e:       # reported by the handler; never break the step
                push.error = e
                self.sender.cancel(push.handle)

    # -------------------------------------------------------------- RPCs
    async def Prefill(self, request, context):
        rid = request.request_id
        try:
            with self.srv.track(), tracing.span("pdserve.prefill", tracing.extract_context(context),
                                                  tracing.tracing_enabled() and {
                                                      "request_id": rid,
                                                      "prompt_tokens": len(request.prompt_token_ids)}):
                return await self._prefill(request)
        except Draining as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except _Status as e:
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:
            if rid in self._aborted:
                self._aborted.discard(rid)
                await context.abort(grpc.StatusCode.CANCELLED, f"request {rid!r} was aborted")
            raise

    async def Abort(self, request, context):
        task = self._tasks.get(request.request_id)
        if task is None:
            return common_pb2.AbortResponse(found=False)
        log.info("abort %s: %s", request.request_id, request.reason or "no reason given")
        self._aborted.add(request.request_id)
        task.cancel()
        return common_pb2.AbortResponse(found=True)

    async def Stats(self, request, context):
        st = self.ae.stats()
        c = self.sender
        return prefill_pb2.PrefillStats(
            worker_id=self.worker_id, num_waiting=st.num_waiting, num_running=st.num_running,
            queued_prefill_tokens=st.queued_prefill_tokens, free_kv_blocks=st.num_free_blocks,
            total_kv_blocks=st.num_total_blocks,
            transfers=common_pb2.TransferCounters(transfers_done=c.transfers_done, blocks=c.blocks_sent,
                                                  bytes=c.bytes_sent, failures=c.failures),
            compat=protoconv.compat_to_proto(self.compat))

    # -------------------------------------------------------------- Prefill body
    def _validate(self, request) -> tuple[SamplingParams, list[int], int]:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not request.request_id:
            raise _Status(bad, "request_id is required")
        if request.request_id in self._tasks:
            raise _Status(bad, f"request id {request.request_id!r} is already in flight")
        try:
            params = protoconv.worker_sampling_from_proto(request.sampling)
        except (ValueError, TypeError) as e:
            raise _Status(bad, str(e)) from None
        ids = list(request.prompt_token_ids)
        L, V = self.max_model_len, self.vocab_size
        if not ids:
            raise _Status(bad, "prompt_token_ids is empty")
        if len(ids) >= L:
            raise _Status(bad, f"prompt has {len(ids)} tokens: the context length is {L}, so at most "
                               f"{L - 1} prompt tokens leave room for one generated token")
        outside = [t for t in ids if not 0 <= t < V]
        if outside:
            raise _Status(bad, f"prompt has token ids outside the vocabulary [0, {V}): {outside[:5]}")
        dest = request.destination
        if not dest.kv_endpoint or not dest.transfer_id:
            raise _Status(bad, "destination.kv_endpoint and destination.transfer_id are required "
                               "(copy them from the decode worker's KvReady)")
        theirs = protoconv.compat_from_proto(dest.compat)
        try:
            self.compat.check(theirs, f"prefill[{self.worker_id}]",
                              f"decode[{dest.decode_worker_id or dest.kv_endpoint}]")
        except IncompatibleKV as e:
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        bs, cached = self.block_size, dest.num_cached_tokens
        if cached < 0 or cached % bs or cached > len(ids):
            raise _Status(bad, f"destination.num_cached_tokens={cached} must be a multiple of the "
                               f"block size {bs} within the prompt ({len(ids)} tokens)")
        want = cdiv(len(ids), bs) - cached // bs
        if len(dest.dst_block_ids) != want:
            raise _Status(bad, f"destination has {len(dest.dst_block_ids)} blocks; a {len(ids)}-token "
                               f"prompt with {cached} cached tokens needs {want} (block size {bs})")
        return params, ids, cached

    async def _prefill(self, request) -> prefill_pb2.PrefillResponse:
        params, ids, cached = self._validate(request)
        rid, dest = request.request_id, request.destination
        self._tasks[rid] = asyncio.current_task()
        handle, released = None, False
        t0 = time.perf_counter()
        try:
            if dest.dst_block_ids:
                t_open = time.time_ns()
                try:
                    dst = list(dest.dst_block_ids)
                    handle = await self.sender.open(dest.transfer_id, dest.kv_endpoint, dst, dst)
                except IncompatibleKV as e:
                    raise _Status(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
                except TransportError as e:
                    raise _Status(grpc.StatusCode.UNAVAILABLE, str(e)) from None
                except ValueError as e:
                    raise _Status(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
                kv_span = tracing.start_span("pdserve.kv.send", None, tracing.tracing_enabled() and {
                    "transfer_id": dest.transfer_id, "blocks": len(dest.dst_block_ids)}, t_open)
                self._pushes[rid] = _Push(handle, cached // self.block_size, span=kv_span)
            try:
                await self.ae.add_request(rid, ids, params, prefill_only=True)
            except ValueError as e:
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            final = None
            async for out in self.ae.stream(rid):
                final = out
            if final is None or final.finish_reason == "abort":
                raise _Status(grpc.StatusCode.CANCELLED, f"request {rid!r} was aborted")
            t_compute = time.perf_counter()
            self._observe_engine_phases(rid)
            blocks = nbytes = 0
            push = self._pushes.pop(rid, None)
            if push is not None:
                try:
                    if push.error is not None:
                        raise _Status(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {push.error}")
                    try:
                        st = await self.sender.finish(handle, timeout=self.cfg.kv_send_timeout_s)
                    except KVTransferTimeout as e:
                        raise _Status(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None
                    except (TransportError, ValueError) as e:
                        raise _Status(grpc.StatusCode.UNAVAILABLE, str(e)) from None
                except _Status as e:
                    self.metrics.observe_kv_failure()
                    push.span.set_status(tracing.error_status(e.message))
                    raise
                finally:
                    push.span.end()
                blocks, nbytes = st.blocks_sent, st.bytes_sent
                self.metrics.observe_kv_transfer(nbytes, time.perf_counter() - t0)
                if push.span.is_recording():
                    push.span.set_attributes({"bytes": nbytes, "blocks_sent": blocks})
            t_done = time.perf_counter()
            await self.ae.release(rid)
            released = True
            first = protoconv.output_tokens(final, 1)[0]
            joules = self.meter.pop(rid)          # None without a power reading
            if joules is not None:
                tracing.current_span().set_attribute("energy_joules", joules)
            return prefill_pb2.PrefillResponse(
                request_id=rid, first_token=first,
                finish_reason=protoconv.FINISH_TO_PROTO.get(final.finish_reason, 0),
                prompt_logprobs=protoconv.prompt_logprobs(final),
                num_prompt_tokens=len(ids), num_cached_tokens=final.num_cached_tokens,
                blocks_transferred=blocks, bytes_transferred=nbytes,
                compute_ms=(t_compute - t0) * 1e3, transfer_wait_ms=(t_done - t_compute) * 1e3,
                energy_joules=joules)
        except EngineError as e:
            raise _Status(grpc.StatusCode.INTERNAL, str(e)) from None
        finally:
            stray = self._pushes.pop(rid, None)
            if stray is not None:
                stray.span.end()
            self._tasks.pop(rid, None)
            self.meter.pop(rid)
            if not released:
                if handle is not None:
                    self.sender.cancel(handle)
                await asyncio.shield(self._abort_quietly(rid))

    def _observe_engine_phases(self, rid: str) -> None:
        """Queue and compute time of a finished prefill-only request, from the engine's own
        timestamps (the request stays in the engine, untouched, until release())."""
        req = self.ae.engine.requests.get(rid)
        arrival = getattr(req, "arrival_time", None)
        scheduled = getattr(req, "first_scheduled_time", None)
        first = getattr(req, "first_token_time", None)
        if arrival is None or scheduled is None or first is None:
            return
        self.metrics.observe_phases(queue_s=scheduled - arrival, prefill_s=first - scheduled)
        tracing.record_span("pdserve.prefill.queue", None, arrival, scheduled)
        tracing.record_span("pdserve.prefill.compute", None, scheduled, first)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.ae.abort(rid)
        except EngineError:
            pass

    async def warm_up(self) -> None:
        """One tiny request through the engine so the first real one has no cold start."""
        rid = f"warmup-{uuid.uuid4().hex[:8]}"
        n = max(1, min(self.block_size - 1, 8))
        await self.ae.add_request(rid, list(range(1, n + 1)),
                                  SamplingParams(temperature=0.0, max_tokens=1), True)
        async for _ in self.ae.stream(rid):
            pass
        await self.ae.release(rid)


async def serve(cfg: PrefillWorkerConfig, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then drain and return."""
    from kvtransfer.ucx import UcxTransport   # imports ucxx; only the serving process needs it
    engine = await asyncio.to_thread(cfg.build_engine)
    srv = WorkerServer([SERVICE], cfg.host, cfg.port, cfg.drain_timeout_s)
    worker_id = cfg.worker_id or f"prefill-{cfg.host}:{srv.port}"
    compat = worker_server.model_compat(engine)
    sender = KVSender(engine.kv_cache, compat, UcxTransport(cfg.host),
                      connect_timeout_s=cfg.kv_connect_timeout_s)
    tel = telemetry.start_role_telemetry("prefill", host=cfg.host, metrics_port=cfg.metrics_port or None,
                                         trace_file=cfg.trace_file, device=cfg.device)
    energy.instrument_engine_steps(engine, tel.meter)
    ae = AsyncEngine(engine, name="prefill-engine")
    ae.start()
    tel.metrics.watch_engine(ae.stats)
    servicer = PrefillServicer(cfg, ae, sender, srv, worker_id, tel.metrics, tel.meter)
    prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, srv.server)
    try:
        await srv.run(servicer.warm_up, ready, stop)
    finally:
        await ae.shutdown()
        await sender.close()
        tel.close()
        log.info("prefill worker %s stopped", worker_id)


def run(cfg: PrefillWorkerConfig) -> None:
    import uvloop
    limit_threads(cfg.num_threads)
    uvloop.run(serve(cfg))


def main(argv: list[str] | None = None) -> int:
    run(config_from_argv(PrefillWorkerConfig, argv, "pdserve prefill worker"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
