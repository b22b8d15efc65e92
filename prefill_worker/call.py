"""One Prefill call's state (`Call`, on the worker's loop; the engine thread sees only `push`,
via KVPush) and the decode reservation's deadline as this side tracks it: the same rule as
the decoder's receiver (kvtransfer/reservation.py),

    deadline = max(reservation's own deadline, deadline_after(last progress, idle_s, bound))

progress being every layer pushed and every KEEPALIVE sent while the prompt is queued
(kv_push.py). The decoder counts a message when it arrives, after this side sent it, so its
deadline is never earlier than this one: a call dropped here has always expired there.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.reservation import deadline_after
from kvtransfer.sender import TransferStats
from protos.pdserve.v1 import common_pb2, prefill_pb2

from .kv_push import Push
from .peer_fetch import Fetched


@dataclass
class Call:
    """One Prefill call's state (on the loop; the engine thread sees only `push`, via KVPush)."""
    request_id: str
    prompt: list[int]
    params: SamplingParams
    dest: prefill_pb2.KvDestination
    num_cached: int                   # prompt tokens the decoder has: their blocks are not sent
    push: Push | None = None          # the outgoing transfer (None: nothing to send)
    final: RequestOutput | None = None    # the prefill-only output holding the first token
    transfer: TransferStats | None = None
    queued: int = 0                   # prompt tokens it holds in the admission queue
    admitted: bool = False            # in the admission queue (also with 0 tokens to compute)
    expires: float | None = None      # time.monotonic() the reservation expires unless extended
    idle_s: float = 0.0               # each progress extends it to then + idle_s (0: fixed)
    bound: float | None = None        # ... up to this hard bound (time.monotonic())
    released: bool = False            # answered: the engine frees its blocks (release)
    keeper: asyncio.Task | None = None    # its KEEPALIVEs until its first layer (server.py)
    fetched: Fetched | None = None    # its prefix fetched from a peer (peer_fetch.py), pinned
    # time.monotonic(), the engine's clock too (its first-scheduled time splits queue/compute)
    t0: float = field(default_factory=time.monotonic)     # the call received
    t_started: float | None = None    # the engine first scheduled it (None: not known)
    t_compute: float = 0.0            # first token sampled (seen on the loop)
    t_done: float = 0.0               # every layer sent

    def timings(self) -> common_pb2.PhaseTimings:
        """The call's queue, compute and KV push tail (durations on this clock)."""
        started = self.t0 if self.t_started is None else min(max(self.t_started, self.t0),
                                                               self.t_compute)
        return common_pb2.PhaseTimings(queue_ms=(started - self.t0) * 1e3,
                                       compute_ms=(self.t_compute - started) * 1e3,
                                       kv_tail_ms=(self.t_done - self.t_compute) * 1e3)

    def deadline(self) -> float | None:
        """When the decoder lets the reservation go (time.monotonic(); None: never), as its
        receiver computes it: idle_s after the last layer or KEEPALIVE, up to the bound."""
        if self.expires is None:
            return None
        pushed = self.push.last_progress if self.push is not None else 0.0
        if not self.idle_s or not pushed:
            return self.expires
        return max(self.expires, deadline_after(pushed, self.idle_s, self.bound))

    def expiry_cause(self) -> str:
        if self.idle_s and self.bound is not None and time.monotonic() >= self.bound:
            return "reached its hard bound (the decode worker's --kv-max-reservation-s)"
        if self.idle_s:
            return f"expired (no progress for {self.idle_s:.3g}s)"
        return "expired"


async def first_token_in_time(ae, call: Call, poll_s: float) -> None:
    """The call's prefill-only output (call.final) from the engine `ae`, or TimeoutError once
    the reservation's deadline (Call.deadline) passed; re-read every `poll_s`, since each
    pushed layer moves it."""
    async def first_token() -> None:
        async for out in ae.stream(call.request_id):
            call.final = out

    task = asyncio.ensure_future(first_token())
    try:
        while not task.done():
            deadline = call.deadline()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait({task}, timeout=None if left is None else min(left, poll_s))
        task.result()
    finally:
        task.cancel()
