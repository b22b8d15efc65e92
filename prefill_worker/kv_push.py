"""The prefill worker's KV connector: pushes each layer of a request's blocks to its decode
worker while the next layer computes.

    KVPush(transport, decoders)           made before the engine (it is the engine's seam)
    LLMEngine(cfg, kv_connector=push)  -> push.register_kv_caches(cache, model): KVSender
    per Prefill call, on the loop:
        p = await push.open(rid, transfer_id, endpoint, dst_block_ids, first_block)
                                          refused (DestinationRefused) unless a known decode
                                          worker announces the endpoint (decoders.py); connect
                                          + HELLO on first use of the endpoint
        engine thread, inside step():
            save_kv_layer(i, sched)       the request's FINAL chunk ran layer i: bind the
                                          transfer to the request's blocks (first layer),
                                          push layer i of blocks [first_block, ...)
        stats = await push.finish(p, timeout)    every layer sent (or an error)
        push.end(p, cancel=...)           on any other way out: forget it, cancel the sends

Chunked prefill: only the step that runs a request's final chunk (the one that samples)
pushes. By then the earlier chunks' KV is complete, so layer i of EVERY block is ready as
soon as the final chunk's layer i is written: the sends still overlap the final chunk's
compute, and each layer is one message (the earlier chunks' sends do not overlap compute).

The source blocks are only known once the scheduler allocated them (in the step), so the
transfer is opened with the destination ids as a placeholder and bound to the request's real
block ids at the first pushed layer (`TransferHandle.set_source`).

A push that fails on the engine thread never breaks the step: the error is kept on the
`Push`, its sends are cancelled, and `finish` raises it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.kv_connector import KVConnector
from engine.scheduler import SchedulerOutput
from kvtransfer.sender import KVSender, TransferHandle, TransferStats
from kvtransfer.transport import Transport, TransportError
from kvtransfer.wire import CompatKey
from services import tracing

from .decoders import KnownDecoders


class DestinationRefused(Exception):
    """The Prefill names a KV endpoint no known decode worker announces."""


@dataclass
class Push:
    """One request's outgoing transfer, shared with the engine thread."""
    request_id: str
    handle: TransferHandle
    first_block: int                  # index in the request's block table of the first block sent
    bound: bool = False
    error: Exception | None = None
    span: object = tracing.INVALID_SPAN   # pdserve.kv.send: one event per pushed layer


class KVPush(KVConnector):
    def __init__(self, transport: Transport, decoders: KnownDecoders, connect_timeout_s: float = 5.0):
        self.transport = transport
        self.decoders = decoders
        self.connect_timeout_s = connect_timeout_s
        self.sender: KVSender | None = None      # made in register_kv_caches
        self._pushes: dict[str, Push] = {}       # loop writes, engine thread reads (GIL-atomic)

    @property
    def compat(self) -> CompatKey:
        return self.sender.compat

    # -------------------------------------------------------------- engine thread
    def register_kv_caches(self, kv_cache: torch.Tensor, model_name: str) -> None:
        self.sender = KVSender(kv_cache, CompatKey.from_cache(kv_cache, model_name), self.transport,
                               connect_timeout_s=self.connect_timeout_s)

    def save_kv_layer(self, layer: int, scheduler_output: SchedulerOutput) -> None:
        for s in scheduler_output.scheduled:
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
            except Exception as e:       # finish() reports it; never break the step
                push.error = e
                self.sender.cancel(push.handle)

    # -------------------------------------------------------------- loop
    async def open(self, request_id: str, transfer_id: str, endpoint: str,
                   dst_block_ids: list[int], first_block: int) -> Push:
        """Connect (first use of `endpoint`) and register the request's transfer, before the
        request enters the engine. Raises DestinationRefused (before any connection is
        opened), IncompatibleKV, TransportError or ValueError."""
        if not await self.decoders.allowed(endpoint):
            raise DestinationRefused("the destination's KV endpoint is not announced by any decode "
                                     "worker this prefill worker knows (--decode/--decode-dns)")
        t_open = time.time_ns()
        handle = await self.sender.open(transfer_id, endpoint, dst_block_ids, dst_block_ids)
        span = tracing.start_span("pdserve.kv.send", None, tracing.tracing_enabled() and {
            "transfer_id": transfer_id, "blocks": len(dst_block_ids)}, t_open)
        push = Push(request_id, handle, first_block, span=span)
        self._pushes[request_id] = push
        return push

    async def finish(self, push: Push, timeout: float) -> TransferStats:
        """Wait until every layer was sent; forgets the push. Raises KVTransferTimeout,
        TransportError (also for a push that failed on the engine thread) or ValueError."""
        self._pushes.pop(push.request_id, None)
        try:
            if push.error is not None:
                raise TransportError(f"KV push failed: {push.error}")
            st = await self.sender.finish(push.handle, timeout=timeout)
        except Exception as e:
            push.span.set_status(tracing.error_status(str(e)))
            push.span.end()
            raise
        if push.span.is_recording():
            push.span.set_attributes({"bytes": st.bytes_sent, "blocks_sent": st.blocks_sent})
        push.span.end()
        return st

    def end(self, push: Push, cancel: bool) -> None:
        """Forget a push that `finish` did not see (its span ends); `cancel`: skip its
        queued sends too."""
        if self._pushes.pop(push.request_id, None) is push:
            push.span.end()
        if cancel:
            self.sender.cancel(push.handle)

    async def close(self) -> None:
        await self.decoders.close()
        if self.sender is not None:
            await self.sender.close()
        else:
            await self.transport.close()
