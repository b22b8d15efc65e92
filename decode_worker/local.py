"""A Decode call with `local_prefill` (conditional disaggregation: the gateway decided that
handing the prompt to a prefill worker does not pay): this decode worker computes the
prompt itself, as a plain colocated server would.

    add:     engine.add_request(prompt): a local request; its prefix cache applies and the
             engine's chunked prefill computes the rest (ValueError: INVALID_ARGUMENT). No
             KV reservation, no KvReady, no SubmitFirstToken: nothing waits on another worker
    stream:  every token from the first on (server.py's _stream with offset 0, sent 0); the
             last chunk carries finish_reason and usage (cached_tokens: the engine's prefix
             hit for this prompt)

Abort(request_id) or the caller's cancel frees the blocks as for any request (server.py's
Abort and _end: the engine request is aborted unless it finished). The queued-but-not-run
local prompt counts in Stats' num_waiting (the engine's own queue), not in
queued_prefill_tokens (those are reserved KV still to arrive).
"""
from __future__ import annotations

import time

import grpc

from services import tracing, worker_server
from services.worker_server import RpcStatus

from .pending import Pending


async def local_decode(servicer, pend: Pending):
    """The DecodeResponses of a local-prefill call (server.py's _decode calls it inside its
    try/finally, which ends the call whatever happens)."""
    pend.local = True
    pend.t_decode = time.monotonic()      # not a reservation: the per-caller cap skips it
    if not pend.first_token.done():
        pend.first_token.cancel()         # SubmitFirstToken has nothing to do here
    try:
        await servicer.ae.add_request(pend.request_id, pend.prompt, pend.params)
    except ValueError as e:
        raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    if pend.aborted:                      # Abort ran before the add: abort what it added
        await worker_server.abort_quietly(servicer.ae, pend.request_id)
        yield servicer._abort_chunk(pend)
        return
    tracing.record_span("pdserve.decode.local_prefill", pend.span, pend.t_reserve, time.monotonic(),
                        tracing.tracing_enabled() and {"prompt_tokens": len(pend.prompt)})
    async for msg in servicer._stream(pend):
        yield msg
