"""The prefill worker: gRPC `PrefillWorker` (Prefill, Abort, Stats, KvEvents: its prefix
cache's blocks for the gateway's index, services/kv_events_rpc.py; ExportPrefix: its cached
prefix pushed to a peer, peer_export.py) + health + reflection;
its KV goes out through `KVPush` (kv_push.py), the engine's KV connector.

One Prefill call (see protos/pdserve/v1/prefill.proto for the whole lifecycle), one `Call`
object holding its state (call.py), in four phases:

    validate params, prompt and destination (INVALID_ARGUMENT); compat check against the
    decoder's KvCompat (FAILED_PRECONDITION naming both sides); with the internal
    credential, a transfer id no decode worker signed (services/security.py) is
    PERMISSION_DENIED; a reservation already expired (destination.expires_at_unix_ms) is
    DEADLINE_EXCEEDED
    peer fetch:      with peer_prefix, the prompt's leading blocks fetched from that prefill
                     worker over the KV transport (peer_fetch.py), compute on any failure
    open transfer:   KVPush.open(transfer to destination.kv_endpoint): connect + HELLO
                     handshake (UNAVAILABLE if unreachable, FAILED_PRECONDITION if the
                     decoder rejects us)
    compute:         engine.add_request(prefill_only=True); on the engine thread, inside
                     step(), KVPush.save_kv_layer pushes layer i of the blocks the decoder
                     lacks (blocks >= num_cached_tokens // block_size) once it is written;
                     the first token is sampled. Bounded by the reservation's deadline,
                     which follows the work as the decoder's does (kvtransfer/receiver.py):
                     the idle window after the last layer pushed or KEEPALIVE sent (from the
                     open transfer to its first layer, while the engine computes: kv_push.py),
                     never past the hard bound. Past it the request is dropped
                     (DEADLINE_EXCEEDED), queued or not, and its engine request aborted: a
                     step of abandoned requests stops at its next layer
    finish transfer: await every send (bounded by kv_send_timeout_s)
    respond:         PrefillResponse (its `timings`: queue, compute, KV push tail on this
                     clock, for the gateway's TTFT waterfall); then engine.release(): blocks
                     back to the pool
    Any error, Abort(request_id) or the caller's cancel: cancel the transfer, abort the
    engine request (frees its blocks). Drain (SIGTERM): the calls not started are handed
    back at once, the same way, ending UNAVAILABLE (handback.py): retried elsewhere.

Chunked prefill and the late binding of source blocks: see kv_push.py.
ExportPrefix (a peer's fetch of our cached prefix): peer_export.py.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time

import grpc

from engine.async_engine import EngineError
from engine.kv_cache_manager import cdiv
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVTransferTimeout
from kvtransfer.transport import TransportError
from kvtransfer.wire import IncompatibleKV
from protos.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services import prefill_cost, protoconv, service_names, tracing, worker_server
from services.kv_events_rpc import KvEventsRpc
from services.security import MTLS, read_token, transfer_id_signed
from services.worker_server import Draining, RpcStatus, WorkerParts

from .admission import PrefillAdmission
from .call import Call, first_token_in_time
from .config import PrefillWorkerConfig
from .decoders import KnownDecoders
from .handback import HANDED_BACK, HandBack
from .kv_push import DestinationRefused, KVPush, PushFailed
from .peer_export import PeerExport
from .peer_fetch import PeerFetch

log = logging.getLogger(__name__)
DEADLINE_POLL_S = 0.25           # how often a computing call re-reads its moving deadline


class _DestinationFault(RpcStatus):
    """The destination's KV endpoint failed: its decode worker's fault, told to the gateway
    by trailing metadata (protoconv.KV_DESTINATION_FAULT)."""


class PrefillServicer(KvEventsRpc, prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, parts: WorkerParts):
        self.cfg: PrefillWorkerConfig = parts.cfg
        self.ae, self.kv, self.srv = parts.engine, parts.kv, parts.srv
        self.worker_id, self.metrics, self.meter = parts.worker_id, parts.metrics, parts.meter
        self.token = parts.token
        self.kv_events = parts.kv_events     # KvEvents: services/kv_events_rpc.py
        self.compat = self.kv.compat
        self.block_size = self.ae.block_size
        self._tasks: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()
        self._releasing: set[asyncio.Task] = set()   # _release tasks (the answer already left)
        self.handback = HandBack(self.ae, self._tasks, self.cfg.drain_timeout_s)
        self.srv.on_drain(self.handback.start)
        self.expired = 0                  # calls dropped: their reservation expired first
        self.admission = PrefillAdmission(self.cfg.max_queued_prefill_tokens,
                                          max_queue_delay_factor=self.cfg.max_queue_delay_factor)
        self.fetch = PeerFetch(self.ae, self.kv.receiver, MTLS.from_config(self.cfg), self.token, self.metrics)
        self.export = PeerExport(self.ae, self.kv, self.token)     # peer fetch (issue 31)

    # -------------------------------------------------------------- RPCs
    async def Prefill(self, request, context):
        rid = request.request_id
        try:
            with self.srv.track(), tracing.span("pdserve.prefill", tracing.extract_context(context),
                                                  tracing.tracing_enabled() and {
                                                      "request_id": rid,
                                                      "prompt_tokens": len(request.prompt_token_ids)}):
                return await self._prefill(request, context.time_remaining())
        except Draining as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except RpcStatus as e:
            if rid in self.handback.ids:
                await context.abort(grpc.StatusCode.UNAVAILABLE, HANDED_BACK)
            if isinstance(e, _DestinationFault):
                context.set_trailing_metadata((protoconv.KV_DESTINATION_FAULT,))
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:
            if rid in self.handback.ids:
                await context.abort(grpc.StatusCode.UNAVAILABLE, HANDED_BACK)
            if rid in self._aborted:
                await context.abort(grpc.StatusCode.CANCELLED, f"request {rid!r} was aborted")
            raise
        finally:
            self._aborted.discard(rid)     # also when the call ended before the cancel landed
            self.handback.ids.discard(rid)

    async def Abort(self, request, context):
        task = self._tasks.get(request.request_id)
        if task is None:
            return common_pb2.AbortResponse(found=False)
        log.info("abort %s: %s", request.request_id, request.reason or "no reason given")
        self._aborted.add(request.request_id)
        task.cancel()
        return common_pb2.AbortResponse(found=True)

    async def ExportPrefix(self, request, context):
        try:
            return await self.export.export(request, context.peer(), context.time_remaining())
        except RpcStatus as e:
            await context.abort(e.code, e.message)

    async def Stats(self, request, context):
        st = self.ae.stats()
        c = self.kv.sender
        return prefill_pb2.PrefillStats(
            worker_id=self.worker_id, num_waiting=st.num_waiting, num_running=st.num_running,
            queued_prefill_tokens=st.queued_prefill_tokens, free_kv_blocks=st.num_free_blocks,
            total_kv_blocks=st.num_total_blocks,
            transfers=common_pb2.TransferCounters(transfers_done=c.transfers_done, blocks=c.blocks_sent,
                                                  bytes=c.bytes_sent, failures=c.failures,
                                                  expirations=self.expired),
            compat=protoconv.compat_to_proto(self.compat),
            max_model_len=self.ae.max_model_len,
            prefill_cost=prefill_cost.to_proto(self.admission.cost()))

    # -------------------------------------------------------------- Prefill body
    def _validate(self, request) -> Call:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        params = worker_server.new_request_params(request, self._tasks)
        ids = list(request.prompt_token_ids)
        try:
            self.ae.check_prompt(ids)
        except ValueError as e:
            raise RpcStatus(bad, str(e)) from None
        dest = request.destination
        if not dest.kv_endpoint or not dest.transfer_id:
            raise RpcStatus(bad, "destination.kv_endpoint and destination.transfer_id are required "
                               "(copy them from the decode worker's KvReady)")
        theirs = protoconv.compat_from_proto(dest.compat)
        try:
            self.compat.check(theirs, f"prefill[{self.worker_id}]",
                              f"decode[{dest.decode_worker_id or dest.kv_endpoint}]")
        except IncompatibleKV as e:
            raise RpcStatus(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        bs, cached = self.block_size, dest.num_cached_tokens
        if cached < 0 or cached % bs or cached > len(ids):
            raise RpcStatus(bad, f"destination.num_cached_tokens={cached} must be a multiple of the "
                               f"block size {bs} within the prompt ({len(ids)} tokens)")
        want = cdiv(len(ids), bs) - cached // bs
        if len(dest.dst_block_ids) != want:
            raise RpcStatus(bad, f"destination has {len(dest.dst_block_ids)} blocks; a {len(ids)}-token "
                               f"prompt with {cached} cached tokens needs {want} (block size {bs})")
        if self.token and not transfer_id_signed(self.token, dest.transfer_id, dest.expires_at_unix_ms):
            raise RpcStatus(grpc.StatusCode.PERMISSION_DENIED,
                            "destination.transfer_id was not reserved by a decode worker of this "
                            "deployment (its signature does not match)")
        if dest.expires_at_unix_ms and dest.expires_at_unix_ms <= time.time() * 1000:
            self.expired += 1
            raise RpcStatus(grpc.StatusCode.DEADLINE_EXCEEDED,
                            "the decode worker's KV reservation has already expired")
        call = Call(request.request_id, ids, params, dest, cached)
        mono = lambda ms: time.monotonic() + ms / 1000 - time.time()   # noqa: E731
        if dest.expires_at_unix_ms > 0:
            call.expires = call.bound = mono(dest.expires_at_unix_ms)
            if dest.idle_timeout_ms > 0 and dest.max_expires_at_unix_ms > 0:
                call.idle_s, call.bound = dest.idle_timeout_ms / 1000, mono(dest.max_expires_at_unix_ms)
                call.expires = min(call.expires, call.bound)
        return call

    async def _prefill(self, request, rpc_left: float | None) -> prefill_pb2.PrefillResponse:
        call = self._validate(request)
        self._admit(call, rpc_left)
        self._tasks[call.request_id] = asyncio.current_task()
        try:
            if request.peer_prefix.num_blocks:       # the decoder's reservation bounds it
                left = None if call.expires is None else call.expires - time.monotonic()
                call.fetched = await self.fetch.fetch(call.request_id, call.prompt, request.peer_prefix, left)
            await self._open_transfer(call)
            call.keeper = asyncio.ensure_future(self._keep_alive(call))
            await self._compute(call)
            await self._finish_transfer(call)
            return await self._respond(call)
        except EngineError as e:
            raise RpcStatus(grpc.StatusCode.INTERNAL, str(e)) from None
        finally:
            await self._end(call)

    def _admit(self, call: Call, rpc_left: float | None) -> None:
        """Queue the call's prompt tokens, or refuse it (RESOURCE_EXHAUSTED), before any
        compute (admission.py): the queue is full, the work ahead would keep it waiting past
        its slowdown bound, or it and the work ahead cannot be computed by the reservation's
        hard bound or the call's deadline (`rpc_left` s). While queued, KEEPALIVEs hold the
        reservation (kv_push.py): the idle window does not bind."""
        tokens = len(call.prompt) - call.num_cached
        now = time.monotonic()
        lefts = [x for x in (None if call.bound is None else call.bound - now, rpc_left) if x is not None]
        why = self.admission.refusal(tokens, min(lefts) if lefts else None, now)
        if why is not None:
            raise RpcStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        self.admission.started(tokens)
        call.queued, call.admitted = tokens, True

    def _dequeue(self, call: Call, computed: bool) -> None:
        if call.admitted:
            self.admission.ended(call.queued, computed)
            call.queued, call.admitted = 0, False

    async def _open_transfer(self, call: Call) -> None:
        """Connect to the decoder and register the transfer before the request can run."""
        dest = call.dest
        if not dest.dst_block_ids:
            return                     # the decoder has the whole prompt cached
        try:
            call.push = await self.kv.open(call.request_id, dest.transfer_id, dest.kv_endpoint,
                                           list(dest.dst_block_ids), call.num_cached // self.block_size)
        except DestinationRefused as e:
            raise RpcStatus(grpc.StatusCode.PERMISSION_DENIED, str(e)) from None
        except IncompatibleKV as e:
            raise RpcStatus(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        except TransportError as e:
            raise _DestinationFault(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except ValueError as e:
            raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    async def _compute(self, call: Call) -> None:
        """The prompt through the engine (its layers pushed as they are written) up to the
        first sampled token, by the reservation's deadline: work still queued (or computing)
        when the decoder lets its blocks go is dropped, its engine request aborted by _end."""
        rid = call.request_id
        try:
            await self.ae.add_request(rid, call.prompt, call.params, prefill_only=True)
        except ValueError as e:
            raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        try:
            await first_token_in_time(self.ae, call, DEADLINE_POLL_S)
        except asyncio.TimeoutError:
            self.expired += 1
            raise RpcStatus(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"request {rid!r}: the decode worker's KV reservation "
                            f"{call.expiry_cause()} before its prompt was computed (dropped)"
                            ) from None
        if call.final is None or call.final.finish_reason == "abort":
            if self.srv.draining:        # aborted in the engine by the hand-back (handback.py)
                raise RpcStatus(grpc.StatusCode.UNAVAILABLE, HANDED_BACK)
            raise RpcStatus(grpc.StatusCode.CANCELLED, f"request {rid!r} was aborted")
        call.t_compute = time.monotonic()
        times = self.ae.request_times_now(rid)
        call.t_started = times.first_scheduled if times is not None else None
        self._dequeue(call, computed=True)

    async def _keep_alive(self, call: Call) -> None:
        """KEEPALIVEs for the reservation (kv_push.py) from the open transfer to the first
        layer pushed: add_request itself waits for the engine's step in progress, which on a
        slow CPU can outlast the idle window."""
        while call.push is not None and not call.push.progress_at:
            self.kv.keep_alive(call.push, call.idle_s)
            await asyncio.sleep(DEADLINE_POLL_S)

    async def _finish_transfer(self, call: Call) -> None:
        """Wait until every pushed layer was sent (kv_send_timeout_s)."""
        if call.push is not None:
            try:
                call.transfer = await self.kv.finish(call.push, self.cfg.kv_send_timeout_s)
            except KVTransferTimeout as e:
                self.metrics.observe_kv_failure()
                raise _DestinationFault(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None
            except TransportError as e:
                self.metrics.observe_kv_failure()
                raise _DestinationFault(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            except PushFailed as e:          # this worker's fault: retried on another
                self.metrics.observe_kv_failure()
                raise RpcStatus(grpc.StatusCode.INTERNAL, str(e)) from None
            except ValueError as e:
                self.metrics.observe_kv_failure()
                raise RpcStatus(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            self.metrics.observe_kv_transfer(call.transfer.bytes_sent, time.monotonic() - call.t0)
        call.t_done = time.monotonic()

    async def _respond(self, call: Call) -> prefill_pb2.PrefillResponse:
        """Answer with the first token; the blocks (their KV is with the decoder) are freed
        after: an engine command waits for the step in progress, which can outlast the
        decoder's wait for this answer (its idle window)."""
        task = asyncio.ensure_future(self._release(call.request_id))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)
        call.released = True
        final, st = call.final, call.transfer
        joules = self.meter.pop(call.request_id)          # None without a power reading
        if joules is not None:
            tracing.current_span().set_attribute("energy_joules", joules)
        return prefill_pb2.PrefillResponse(
            request_id=call.request_id, first_token=protoconv.output_tokens(final, 1)[0],
            finish_reason=protoconv.FINISH_TO_PROTO.get(final.finish_reason, 0),
            prompt_logprobs=protoconv.prompt_logprobs(final),
            num_prompt_tokens=len(call.prompt), num_cached_tokens=final.num_cached_tokens,
            blocks_transferred=st.blocks_sent if st else 0, bytes_transferred=st.bytes_sent if st else 0,
            compute_ms=(call.t_compute - call.t0) * 1e3,
            transfer_wait_ms=(call.t_done - call.t_compute) * 1e3, energy_joules=joules,
            timings=call.timings(), peer_fetched_tokens=call.fetched.tokens if call.fetched else 0)

    async def _end(self, call: Call) -> None:
        """Whatever happened: forget the call; unless it succeeded, cancel the transfer and
        abort the engine request (its blocks are freed)."""
        self._tasks.pop(call.request_id, None)
        if call.keeper is not None:
            call.keeper.cancel()
        self._dequeue(call, computed=False)
        self.meter.pop(call.request_id)
        if call.push is not None:
            self.kv.end(call.push, cancel=not call.released)
        if not call.released:
            await asyncio.shield(worker_server.abort_quietly(self.ae, call.request_id))
        await self.fetch.release(call.fetched)

    async def _release(self, rid: str) -> None:
        """Record the queue and compute time of a finished prefill-only request (it stays in
        the engine, untouched, until release()) from the engine's timestamps; free it."""
        try:
            times = await self.ae.request_times(rid)
        finally:
            await self.ae.release(rid)
        if times is None or times.first_scheduled is None or times.first_token is None:
            return
        self.metrics.observe_phases(queue_s=times.first_scheduled - times.arrival,
                                    prefill_s=times.first_token - times.first_scheduled)
        tracing.record_span("pdserve.prefill.queue", None, times.arrival, times.first_scheduled)
        tracing.record_span("pdserve.prefill.compute", None, times.first_scheduled, times.first_token)


class PrefillRole(worker_server.WorkerRole):
    """The prefill worker for services.worker_server.serve: KVPush is both its engine's KV
    connector and its KV endpoint."""
    name, service_name, prefill_only = "prefill", service_names.PREFILL, True

    def kv_address(self, cfg: PrefillWorkerConfig) -> tuple[str, int]:
        return cfg.host, 0

    def kv_connector(self, cfg: PrefillWorkerConfig, transport) -> KVPush:
        decoders = KnownDecoders(cfg.decode, cfg.decode_dns, MTLS.from_config(cfg),
                                 token=read_token(cfg.internal_token_file), file=cfg.decode_file)
        return KVPush(transport, decoders, cfg.kv_connect_timeout_s, cfg.kv_staging)

    async def open_kv(self, cfg, engine, transport, connector: KVPush) -> KVPush:
        """The connector (bound to the cache by the engine's construction), with a KV
        receiver on the same transport for the prefixes it fetches from peers (peer_fetch.py)."""
        connector.receiver = KVReceiver(engine.kv_cache, connector.compat, transport,
                                        staging=cfg.kv_staging, kv_scales=engine.kv_scales)
        await connector.receiver.start()
        connector.decoders.start(cfg.decode_refresh_s)
        return connector

    async def warm_up(self, servicer: PrefillServicer, engine) -> None:
        """A tiny prompt, then the admission's seed, measured or cached
        (services/prefill_cost.py); at the drain, the cached timings bettered from the calls
        served (once the admission has fitted MIN_CALLS of them)."""
        admission = servicer.admission
        admission.seed((await prefill_cost.warm_up(engine, True, "prefill"))[0])

        def remember(_deadline) -> None:
            if admission.num_samples >= prefill_cost.MIN_CALLS:
                prefill_cost.remember(engine, True, admission.estimate)
        servicer.srv.on_drain(remember)

    config_class, servicer_class = PrefillWorkerConfig, PrefillServicer
    add_to_server = staticmethod(prefill_pb2_grpc.add_PrefillWorkerServicer_to_server)

ROLE = PrefillRole()

if __name__ == "__main__":
    sys.exit(worker_server.main(ROLE))
