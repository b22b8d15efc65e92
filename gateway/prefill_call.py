"""A segment's Prefill call (gateway/segment.py runs it, and retries it): pick a prefill
worker for the decode worker's KvReady, send the prompt with that destination, wait for the
first token; with --peer-fetch on, the request names a peer prefill worker holding more of
the prompt's leading blocks (gateway/peer_prefix.py). The call's time is lapped on the
request's PhaseClock: the pick as routing, the call split into the worker's own phases (PrefillResponse.timings) and the rest, the two
transits, as prefill_queue (gateway/waterfall.py)."""
from __future__ import annotations

import asyncio

import grpc

from protos.pdserve.v1 import decode_pb2, prefill_pb2
from services.protoconv import sampling_to_proto

from .decode_calls import remaining
from .peer_prefix import peer_prefix
from .request import RequestState
from .routing import Router
from .waterfall import prefill_phases
from .worker_errors import LostCall, PrefillRetries

DESTINATION_FIELDS = ("decode_worker_id", "kv_endpoint", "transfer_id", "num_cached_tokens",
                      "compat", "expires_at_unix_ms", "idle_timeout_ms", "max_expires_at_unix_ms")


async def prefill(router: Router, seg, prompt: list[int], params, kv: decode_pb2.KvReady,
                  req: RequestState, retries: PrefillRetries) -> prefill_pb2.PrefillResponse:
    """`seg`'s Prefill (attached to its worker until it answers); raises the call's
    AioRpcError, or LostCall when the registry cut it (its worker was lost)."""
    bs = kv.compat.block_size or router.prefill.block_size()
    hashes = router.prefill_hashes(prompt, bs)
    w = router.pick_prefill(kv, retries.exclude(), hashes)
    req.clock.lap("routing")
    dest = prefill_pb2.KvDestination(**{f: getattr(kv, f) for f in DESTINATION_FIELDS},
                                     dst_block_ids=kv.block_ids)
    call = w.stub.Prefill(prefill_pb2.PrefillRequest(
        request_id=seg.rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
        destination=dest, peer_prefix=peer_prefix(router, w, prompt, kv.compat)),
        timeout=remaining(req.deadline), metadata=seg.metadata)
    uncached = max(1, len(prompt) - router.prefill_hit_tokens(w, hashes, bs))
    ticket = router.open_prefill(w, hashes)
    try:
        seg.attach_prefill(w, call, uncached, len(prompt))
        resp = await _answer(seg)
    finally:
        router.close_prefill(ticket)
    req.clock.split(prefill_phases(resp), "prefill_queue")   # the transits: queueing
    seg.detach(w)
    return resp


async def _answer(seg) -> prefill_pb2.PrefillResponse:
    try:
        return await seg.prefill_call
    except asyncio.CancelledError:
        if not seg.prefill_lost or seg.lost or asyncio.current_task().cancelling():
            raise
        raise LostCall(grpc.StatusCode.UNAVAILABLE, seg.prefill_lost) from None
