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
            save_kv_layer(i, sched)       a chunk of the request ran layer i: push layer i of
                                          the blocks this chunk completed (first layer: bind
                                          them to the request's blocks)
        push.keep_alive(p, idle_s)        while the request waits for its first layer
                                          (polled by the server): a KEEPALIVE every
                                          idle_s / KEEPALIVES_PER_WINDOW, if the engine
                                          computed a layer (of any request) since the last
        stats = await push.finish(p, timeout)    every layer sent (or an error)
        push.end(p, cancel=...)           on any other way out: forget it, cancel the sends

Chunked prefill: every chunk pushes, as it runs, the blocks it filled: blocks
[sent, end // block_size) for a chunk ending at token `end` (all remaining blocks in the final
chunk, whose last block may be partial). A block is sent once, after the chunk that completes
it; blocks the prefill worker had cached (its own prefix hits) go with the first chunk. So
the sends of chunk c overlap the compute of chunk c and later ones, and the final chunk only
sends its own blocks: for a 32k prompt in 16 chunks, 1/16 of the KV is left when the last
chunk ends.

    prompt blocks   | decoder's hits | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
    chunk 1 (tokens up to the middle of block 3)  pushes 0..2
    chunk 2 (final)                               pushes 3..7

The source blocks are only known once the scheduler allocated them (in the step), so the
transfer is opened with the destination ids as a placeholder and bound to the request's real
block ids chunk by chunk (`TransferHandle.set_source`).

On CUDA, save_kv_layer only queues the gather (on the sender's side stream, after an
event on the compute stream) and returns: the engine thread never waits for it. The
inherited wait_for_save does not wait either: no later step rewrites a block a queued gather
reads (a prompt position is written once, and the request's blocks are freed only after
`finish`, once every send, and so every gather, completed).

Keep-alive: the decode worker lets a reservation go `idle_s` after its last progress. A
prompt queued behind others pushes nothing for a while; its KEEPALIVEs (kvtransfer/wire.py)
tell the decoder it is queued on a live worker, so it keeps its reservation up to the hard
bound (the prefill admission refuses up front what cannot finish by then). They are sent
only while the engine computes (`layers_run`, every layer of every step, moved since the
last one; a layer, not a step: one step of a full token budget on a slow CPU can outlast
the idle window): a wedged engine stops them, and its requests' reservations expire as a
dead worker's do. Once the request's own layers flow, they are the progress.

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
from kvtransfer.transport import Transport
from kvtransfer.wire import CompatKey
from services import tracing

from .decoders import KnownDecoders

KEEPALIVES_PER_WINDOW = 3        # KEEPALIVEs per idle window while a request is queued


class PushFailed(RuntimeError):
    """A push failed on this worker's engine thread: a local fault, not the destination's."""


class DestinationRefused(Exception):
    """The Prefill names a KV endpoint no known decode worker announces."""


@dataclass
class Push:
    """One request's outgoing transfer, shared with the engine thread."""
    request_id: str
    handle: TransferHandle
    first_block: int                  # index in the request's block table of the first block sent
    sent: int = 0                     # destination blocks [0, sent) were pushed for every layer
    step_end: int = 0                 # this step pushes blocks [sent, step_end)
    error: Exception | None = None
    span: object = tracing.INVALID_SPAN   # pdserve.kv.send: one event per pushed layer
    progress_at: float = 0.0          # time.monotonic() of the last layer pushed (0: none yet)
    opened_at: float = 0.0            # time.monotonic() of open()
    alive_at: float = 0.0             # ... of the last KEEPALIVE queued (0: none yet)
    alive_layers: int = -1            # KVPush.layers_run then

    @property
    def last_progress(self) -> float:
        """time.monotonic() of the last thing that extended the reservation (0: nothing)."""
        return max(self.progress_at, self.alive_at)


class KVPush(KVConnector):
    def __init__(self, transport: Transport, decoders: KnownDecoders, connect_timeout_s: float = 5.0,
                 staging: str = "host"):
        self.transport = transport
        self.decoders = decoders
        self.connect_timeout_s = connect_timeout_s
        self.staging = staging                   # kvtransfer/staging.py
        self.sender: KVSender | None = None      # made in register_kv_caches
        self._pushes: dict[str, Push] = {}       # loop writes, engine thread reads (GIL-atomic)
        self.layers_run = 0                      # save_kv_layer calls: the engine computes
        self.receiver = None                     # KVReceiver of peer fetches (server.open_kv)

    @property
    def compat(self) -> CompatKey:
        return self.sender.compat

    # -------------------------------------------------------------- engine thread
    def register_kv_caches(self, kv_cache: torch.Tensor, model_name: str,
                           kv_scales: torch.Tensor | None = None, layout: str = "") -> None:
        self.sender = KVSender(kv_cache, CompatKey.from_cache(kv_cache, model_name, kv_scales, layout),
                               self.transport, connect_timeout_s=self.connect_timeout_s,
                               staging=self.staging, kv_scales=kv_scales)

    def save_kv_layer(self, layer: int, scheduler_output: SchedulerOutput) -> None:
        last = self.sender.compat.num_layers - 1
        self.layers_run += 1
        for s in scheduler_output.scheduled:
            push = self._pushes.get(s.request.request_id)
            if push is None or push.error is not None:
                continue
            try:
                if layer == 0:
                    self._bind_chunk(push, s)
                if push.step_end > push.sent:
                    self.sender.push_layer_threadsafe(push.handle, layer, push.sent, push.step_end)
                    push.progress_at = time.monotonic()   # what extends the reservation
                    if push.span.is_recording():
                        push.span.add_event("layer", {"layer": layer, "blocks": push.step_end - push.sent})
                if layer == last:
                    push.sent = push.step_end
            except Exception as e:       # finish() reports it; never break the step
                push.error = e
                self.sender.cancel(push.handle)

    def _bind_chunk(self, push: Push, s) -> None:
        """The destination blocks this step completes, bound to the request's blocks."""
        n = len(push.handle.dst_block_ids)
        if s.samples:                    # the final chunk: every block, the last one partial
            filled = n
        else:
            filled = min((s.start + s.num_new_tokens) // self.sender.compat.block_size - push.first_block, n)
        push.step_end = max(filled, push.sent)
        if push.step_end > push.sent:
            first = push.first_block
            push.handle.set_source(s.request.block_ids[first + push.sent:first + push.step_end], push.sent)

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
        push = Push(request_id, handle, first_block, span=span, opened_at=time.monotonic())
        self._pushes[request_id] = push
        return push

    def keep_alive(self, push: Push | None, idle_s: float, now: float | None = None) -> bool:
        """A KEEPALIVE for a request still waiting for its first layer, once per
        idle_s / KEEPALIVES_PER_WINDOW, if the engine computed a layer since the last one;
        True when one was queued."""
        if push is None or not idle_s or push.progress_at or push.error is not None:
            return False
        now, layers = time.monotonic() if now is None else now, self.layers_run
        if push.alive_layers < 0:
            push.alive_layers = layers   # the first poll: the count to move past
        if now - max(push.opened_at, push.alive_at) < idle_s / KEEPALIVES_PER_WINDOW:
            return False
        if layers == push.alive_layers or not self.sender.keepalive(push.handle):
            return False
        push.alive_at, push.alive_layers = now, layers
        return True

    async def finish(self, push: Push, timeout: float) -> TransferStats:
        """Wait until every layer was sent; forgets the push. Raises KVTransferTimeout,
        TransportError, PushFailed (the push failed on the engine thread) or ValueError."""
        self._pushes.pop(push.request_id, None)
        try:
            if push.error is not None:
                raise PushFailed(f"KV push failed: {push.error}")
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
        if self.receiver is not None:            # closes the shared transport too
            await self.receiver.close()
        if self.sender is not None:
            await self.sender.close()
        else:
            await self.transport.close()
