"""decode_worker/reservations.py: calls with no room wait in arrival order, bounded (queue
length, the wait's hard bound, abort), and the next head tries as soon as one leaves."""
from __future__ import annotations

import asyncio
import time

from decode_worker.reservations import ReservationQueue, fits


class Slots:
    """A fake engine: `free` slots; attempt() takes one (returns its number) or None."""

    def __init__(self, free: int):
        self.free, self.taken, self.attempts = free, 0, 0

    def attempt(self, who: str, order: list[str]):
        async def go():
            self.attempts += 1
            if self.free <= 0:
                return None
            self.free -= 1
            self.taken += 1
            order.append(who)
            return self.taken
        return go

    def release(self, q: ReservationQueue) -> None:
        self.free += 1
        q.wake()


def test_waiters_are_served_in_arrival_order_as_slots_free():
    async def main():
        q, slots, order = ReservationQueue(8), Slots(1), []
        first = await q.reserve(slots.attempt("a", order), True, 10, lambda: False)
        tasks = [asyncio.create_task(q.reserve(slots.attempt(w, order), True, 10, lambda: False))
                 for w in "bcd"]
        await asyncio.sleep(0.01)
        assert len(q) == 3 and order == ["a"]
        for _ in range(3):
            slots.release(q)
            await asyncio.sleep(0.01)
        return first, await asyncio.gather(*tasks), order, len(q)
    first, rest, order, left = asyncio.run(main())
    assert first == 1 and rest == [2, 3, 4]
    assert order == ["a", "b", "c", "d"] and left == 0


def test_only_the_head_tries_so_a_later_call_cannot_overtake():
    async def main():
        q, slots, order = ReservationQueue(8), Slots(0), []
        head = asyncio.create_task(q.reserve(slots.attempt("head", order), True, 10, lambda: False))
        await asyncio.sleep(0.01)
        later = asyncio.create_task(q.reserve(slots.attempt("later", order), True, 10, lambda: False))
        await asyncio.sleep(0.01)
        slots.release(q)
        await asyncio.wait([head, later], timeout=0.1)
        done = (head.done(), later.done())
        slots.release(q)
        await asyncio.wait_for(later, 2)
        return done, order
    done, order = asyncio.run(main())
    assert done == (True, False) and order == ["head", "later"]


def test_full_queue_a_prompt_that_never_fits_and_zero_bound_refuse_at_once():
    async def main():
        q, slots, order = ReservationQueue(1), Slots(0), []
        waiting = asyncio.create_task(q.reserve(slots.attempt("w", order), True, 10, lambda: False))
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        full = await q.reserve(slots.attempt("x", order), True, 10, lambda: False)
        never = await ReservationQueue(8).reserve(slots.attempt("y", order), False, 10, lambda: False)
        off = await ReservationQueue(0).reserve(slots.attempt("z", order), True, 10, lambda: False)
        quick = time.monotonic() - t0
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return full, never, off, quick, len(q)
    full, never, off, quick, left = asyncio.run(main())
    assert (full, never, off) == (None, None, None)
    assert quick < 1.0 and left == 0          # no waiting; a cancelled waiter leaves


def test_the_wait_is_bounded_and_an_abort_leaves_the_queue():
    async def main():
        q, slots, order = ReservationQueue(8), Slots(0), []
        t0 = time.monotonic()
        timed_out = await q.reserve(slots.attempt("t", order), True, 0.3, lambda: False)
        waited = time.monotonic() - t0
        flag = [False]
        aborted = asyncio.create_task(q.reserve(slots.attempt("a", order), True, 10, lambda: flag[0]))
        await asyncio.sleep(0.01)
        flag[0] = True
        q.wake()
        res = await asyncio.wait_for(aborted, 2)
        return timed_out, waited, res, len(q), q.waited
    timed_out, waited, res, left, n_waited = asyncio.run(main())
    assert timed_out is None and 0.3 <= waited < 3.0
    assert res is None and left == 0 and n_waited == 2


def test_fits_leaves_the_schedulers_watermark():
    assert fits(16 * 99, 16, 100)             # 99 blocks of 100: 1% watermark
    assert not fits(16 * 99 + 1, 16, 100)
    assert not fits(17, 16, 2)                # 2 blocks: one is the watermark
