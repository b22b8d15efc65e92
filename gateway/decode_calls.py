"""A segment's calls on its decode worker beyond the stream itself (gateway/segment.py runs
them): SubmitFirstToken and the reason a refused one gives, the stream's loss as an
exception (`DecodeLost`: Segments.run migrates on it), and the deadline left to a call."""
from __future__ import annotations

import asyncio

import grpc

from protos.pdserve.v1 import common_pb2, decode_pb2

from .registry import Worker
from .request import GatewayError
from .worker_errors import rpc_error

SUBMIT_TIMEOUT_S = 10.0


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
        code, why = await refusal_reason(seg)
        raise GatewayError(code, f"decode worker {w.address} did not accept the first "
                                 f"token of {seg.rid} ({why})")


async def refusal_reason(seg) -> tuple[grpc.StatusCode, str]:
    """Why the decode worker ended the request before its first token: INTERNAL and
    the error of its stream's last chunk if one comes within a second (a failed KV
    transfer, ...), else RESOURCE_EXHAUSTED: the reservation lapsed (overload)."""
    try:
        msg = await asyncio.wait_for(seg.decode_call.read(), 1.0)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        msg = None
    if msg and msg is not grpc.aio.EOF and msg.HasField("tokens") and msg.tokens.error:
        return grpc.StatusCode.INTERNAL, msg.tokens.error
    return grpc.StatusCode.RESOURCE_EXHAUSTED, "reservation expired or aborted"


def remaining(deadline: float) -> float:
    """Seconds to the loop-time `deadline`; asyncio.TimeoutError once it passed."""
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise asyncio.TimeoutError
    return left
