"""What a worker's gRPC status means to the gateway; segment.py acts on it.

    a worker call fails with              the gateway
      Decode, before KvReady: a code in     takes it as a refusal: another decode worker
      DECODE_REFUSALS                       may take the request
      Prefill: a code in PREFILL_RETRY      retries it on another prefill worker
                                            (PrefillRetries: after a worker's death on
                                            every other one in turn, free; after anything
                                            else once), or, when the trailing metadata say
                                            the decode worker's KV endpoint failed
                                            (blames_destination), once on another decode
                                            worker
      anything it does not retry            ends the request: rpc_error(), the worker's
                                            code where it is in PASS_THROUGH, else INTERNAL
      Decode, mid-stream or before the      the decode worker is lost (died, or draining:
      first token: UNAVAILABLE              it hands its streams off so): migrate
    LostCall: a call the gateway cut itself (its worker was lost), read as that status.
"""
from __future__ import annotations

import asyncio

import grpc

from services.protoconv import KV_DESTINATION_FAULT

from .request import GatewayError

# Codes a gateway passes through from a worker as they are; anything else becomes INTERNAL.
PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.FAILED_PRECONDITION}
# A Prefill that failed with one of these is retried once on another prefill worker.
PREFILL_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}
# A decode worker's Decode that ends with one of these before KvReady was refused: another
# worker may take the request. CANCELLED there comes from the worker's server (a stopping
# server cancels the calls that reach it during its grace; an overloaded one drops them):
# the gateway's own cancellation raises CancelledError, not a status.
DECODE_REFUSALS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.CANCELLED}


class LostCall(grpc.aio.AioRpcError):
    """A call the gateway cut because its worker was lost (stalled): handled as that status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def blames_destination(e: grpc.aio.AioRpcError) -> bool:
    """The prefill worker says the decode worker's KV endpoint failed (connect, send)."""
    return any(tuple(kv) == KV_DESTINATION_FAULT for kv in e.trailing_metadata() or ())


def rpc_error(where: str, e: grpc.aio.AioRpcError) -> GatewayError:
    """The request's error for a worker call that failed with `e`, at `where`."""
    code = e.code() if e.code() in PASS_THROUGH else grpc.StatusCode.INTERNAL
    return GatewayError(code, f"{where}: {e.code().name}: {e.details()}")


async def refusal_reason(decode_call) -> tuple[grpc.StatusCode, str]:
    """Why the decode worker ended the request before its first token (it refused
    SubmitFirstToken), from its Decode stream: INTERNAL and the error of its last chunk if
    one comes within a second (a failed KV transfer, ...); UNAVAILABLE and its details when
    the stream ended so (the worker is draining: the gateway migrates the request); else
    RESOURCE_EXHAUSTED: the reservation lapsed (overload)."""
    try:
        msg = await asyncio.wait_for(decode_call.read(), 1.0)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return e.code(), e.details() or "UNAVAILABLE"
        msg = None
    except asyncio.TimeoutError:
        msg = None
    if msg and msg is not grpc.aio.EOF and msg.HasField("tokens") and msg.tokens.error:
        return grpc.StatusCode.INTERNAL, msg.tokens.error
    return grpc.StatusCode.RESOURCE_EXHAUSTED, "reservation expired or aborted"


class PrefillRetries:
    """One request's Prefill retries: which prefill workers the next attempt may not use,
    and whether there is a next attempt.

        the worker died (UNAVAILABLE: killed,      free: retried on any other healthy
        unreachable, draining, or lost)            worker, the ones that refused it before
                                                   included (their refusal was about a
                                                   load the death changed); the dead one
                                                   stays excluded for this request
        anything else in PREFILL_RETRY (a          once per request (CHARGED): the next
        refusal, an internal error), or a KV       attempt excludes that worker too
        destination fault

    Each death excludes one more worker for good and only one retry is charged, so a request
    makes at most (its pool's size + 2) attempts."""
    CHARGED = 1

    def __init__(self):
        self.dead: list[str] = []
        self.refused: list[str] = []
        self.charged = 0

    def exclude(self) -> list[str]:
        """The prefill workers the next attempt may not use."""
        return self.dead + self.refused

    def failed(self, code: grpc.StatusCode, address: str | None) -> bool:
        """A Prefill failed with `code` (on prefill worker `address`; None: the decode
        worker's KV destination failed); whether it may be retried (given another worker)."""
        if code not in PREFILL_RETRY:
            return False
        if code == grpc.StatusCode.UNAVAILABLE and address is not None:
            self.dead.append(address)
            self.refused.clear()
            return True
        if address is not None:
            self.refused.append(address)
        self.charged += 1
        return self.charged <= self.CHARGED
