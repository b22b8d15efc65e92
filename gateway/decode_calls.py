"""A segment's calls on its decode worker beyond the stream itself (gateway/segment.py runs
them): SubmitFirstToken and the reason a refused one gives, Abort on either worker, the stream's loss as an
exception (`DecodeLost`: Segments.run migrates on it), and the deadline left to a call."""
from __future__ import annotations

import asyncio
import logging

import grpc

from protos.pdserve.v1 import common_pb2, decode_pb2

from .registry import Worker
from .request import GatewayError
from .worker_errors import refusal_reason, rpc_error

SUBMIT_TIMEOUT_S = 10.0
ABORT_TIMEOUT_S = 2.0
log = logging.getLogger(__name__)


class DecodeLost(Exception):
    """The decode worker's stream broke mid-request (the worker died or went away)."""

    def __init__(self, worker: Worker, detail: str):
        super().__init__(detail)
        self.worker = worker


async def submit_first(seg, first: common_pb2.TokenLogprob, deadline: float) -> None:
    """SubmitFirstToken of `seg`'s request to its decode worker; raises DecodeLost
    (UNAVAILABLE) or GatewayError (refused: refusal_reason says why)."""
    w = seg.decode
    try:
        r = await w.stub.SubmitFirstToken(
            decode_pb2.SubmitFirstTokenRequest(request_id=seg.rid, first_token=first),
            timeout=min(SUBMIT_TIMEOUT_S, remaining(deadline)))
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            w.mark_failed(e.details() or "UNAVAILABLE")
            raise DecodeLost(w, f"SubmitFirstToken: {e.details()}") from None
        raise rpc_error(f"decode worker {w.address} (SubmitFirstToken)", e) from None
    if not r.accepted:
        code, why = await refusal_reason(seg.decode_call)
        if code == grpc.StatusCode.UNAVAILABLE:           # draining (or gone): migrate
            raise DecodeLost(w, f"before its first token: {why}")
        raise GatewayError(code, f"decode worker {w.address} did not accept the first "
                                 f"token of {seg.rid} ({why})")


def remaining(deadline: float) -> float:
    """Seconds to the loop-time `deadline`; asyncio.TimeoutError once it passed."""
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise asyncio.TimeoutError
    return left


async def abort_call(w: Worker, rid: str) -> None:
    """Abort `rid` on worker `w` (either kind), within ABORT_TIMEOUT_S; a failure is logged."""
    try:
        await w.stub.Abort(common_pb2.AbortRequest(request_id=rid, reason="gateway"),
                           timeout=ABORT_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        log.info("Abort(%s) on %s %s: %s", rid, w.kind, w.address, e.code().name)
