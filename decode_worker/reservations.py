"""Decode calls that find no room for their KV reservation wait for one, in arrival order,
instead of being refused (issue 34: a closed loop of more clients than the batch is queued,
not answered 429).

    try       engine.add_remote_request: a slot (max_num_seqs counts running + reserved
              requests) and blocks for the prompt less its prefix hits, leaving the watermark
    no room   the call joins the queue (FIFO: only its head tries again) and sleeps until
              something on this worker ended (`wake()`: a Decode call's end, an Abort), at
              most WAKE_S between tries (a slot freed without a wake is seen within it)
    leaves    reserved (the call goes on to announce KvReady), or refused with
              RESOURCE_EXHAUSTED (the gateway tries another decode worker, then 429):
                - at once when `max_waiting` calls already wait (the bound of the queue;
                  0: never wait, the old refusal)
                - at once when the prompt would not fit even an empty cache
                - when the wait reaches `max_s` (the reservation's hard bound,
                  --kv-max-reservation-s)
              or aborted (Abort, drain: pend.aborted; the caller's cancel or deadline
              cancels the call): it leaves the queue, nothing reserved

Nothing is held while a call waits: no blocks, no transfer, no prefill compute (decode-first:
the prefill worker is only called once KvReady names the blocks). The wait is the TTFT
waterfall's decode_reservation phase. All on the worker's event loop (no locks).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Awaitable, Callable

WAKE_S = 0.25


class ReservationQueue:
    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.waited = 0                  # calls that had to wait (reserved or not)
        self._queue: deque[object] = deque()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def wake(self) -> None:
        """Something ended on this worker: the queue's head tries again."""
        self._changed.set()
        self._changed = asyncio.Event()  # those already waiting hold the one just set

    def refusal(self, prompt_tokens: int, st) -> str:
        """Why a call was refused, from the engine's stats `st`."""
        return (f"no room for a {prompt_tokens}-token prompt: {st.num_running} running + "
                f"{st.num_waiting_for_remote_kv} reserved (max_num_seqs caps them), "
                f"{st.num_free_blocks} of {st.num_total_blocks} KV blocks free (a watermark "
                f"stays free for the running requests); {len(self)} calls wait for room (at "
                f"most {self.max_waiting}: --max-waiting-reservations, each at most "
                "--kv-max-reservation-s)")

    async def reserve(self, attempt: Callable[[], Awaitable[object | None]], fits: bool,
                      max_s: float, aborted: Callable[[], bool]) -> object | None:
        """`attempt()`'s result once it is not None; None: refused (queue full, `fits`
        False, or `max_s` passed) or `aborted()`."""
        res = await attempt()
        if res is not None or not fits or len(self._queue) >= self.max_waiting:
            return res
        me, deadline = object(), time.monotonic() + max_s
        self._queue.append(me)
        self.waited += 1
        try:
            while not aborted():
                changed = self._changed
                if self._queue[0] is me:
                    res = await attempt()
                    if res is not None or aborted():
                        return res
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(changed.wait(), min(WAKE_S, left))
                except asyncio.TimeoutError:
                    pass
            return None
        finally:
            self._queue.remove(me)
            self.wake()                  # the next head tries at once


def fits(prompt_tokens: int, block_size: int, total_blocks: int) -> bool:
    """The prompt's blocks fit an empty cache less its watermark (else it never will: the
    engine scheduler's watermark_blocks keeps at least 1% free)."""
    return -(-prompt_tokens // block_size) <= total_blocks - max(1, -(-total_blocks // 100))
