"""One Decode call's state (`Pending`, shared by Decode, SubmitFirstToken and Abort; all on
the worker's event loop), the worker's counters and the error chunk a failed call ends with.
The phases that move a `Pending` along are in server.py's docstring."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import common_pb2, decode_pb2
from services import tracing


class Aborted(Exception):
    pass


@dataclass
class Pending:
    """One Decode call's state shared with SubmitFirstToken/Abort (all on the loop)."""
    request_id: str
    prompt: list[int]
    params: SamplingParams
    timeout: float                    # the reservation's idle window, seconds
    max_s: float                      # its hard bound, seconds from the reservation
    policy: str                       # on a failed transfer: "fail" | "recompute"
    first_token: asyncio.Future
    span: object = tracing.INVALID_SPAN   # pdserve.decode (not current: an async generator)
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)
    fill: list[int] = field(default_factory=list)   # reserved blocks the prompt's KV arrives into
    deadline: float = 0.0             # time.monotonic() of the reservation's hard bound
    reserved_unix: float = 0.0        # time.time() of the reservation
    caller: str = ""                  # who asked (caller_of): reservations are capped per caller
    kv_id: str = ""                   # the signed transfer id KvReady announces
    expires_at_ms: int = 0            # the reservation's deadline, unix ms (signed in kv_id)
    transfer_id: str = ""             # the receiver's transfer ("" when nothing arrives)
    queued_tokens: int = 0            # prompt tokens still to arrive over KV
    kv_done: bool = False
    aborted: bool = False
    abort_reason: str = ""
    local: bool = False               # local_prefill: this worker computes the prompt (local.py)
    finished: bool = False            # the stream ended with a finish or abort chunk
    offset: int = 0                   # client tokens not in the engine's token list
    sent: int = 0                     # client tokens delivered (the first one by prefill)
    t_reserve: float = field(default_factory=time.monotonic)
    t_decode: float = 0.0             # admitted to the running batch (or recomputing)


@dataclass
class Counters:
    token_expirations: int = 0        # KV arrived but SubmitFirstToken did not, in time
    fallbacks: int = 0                # prompts recomputed here (policy recompute)


def error_chunk(rid: str, reason, message: str, usage: common_pb2.Usage) -> decode_pb2.DecodeResponse:
    return decode_pb2.DecodeResponse(request_id=rid, tokens=decode_pb2.TokenChunk(
        finish_reason=reason, error=message, usage=usage))
