"""The KV reservation's deadline follows the work (kvtransfer/receiver.py): each LAYER message
written extends a live reservation to now + idle_s, never past reserved at + max_s. A fake
clock drives the receiver; the messages go over the LoopbackTransport through the real
sender, so what counts as progress is what a prefill worker really sends."""
import asyncio

import pytest

from kvtransfer import KVReceiver, KVSender, LoopbackTransport, TransferState

from .test_kvtransfer_state import L, cache, key, run, settle

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


async def _pair(clock, expiry_s=10.0, max_s=None):
    dst, src = cache(), cache(1)
    rx = KVReceiver(dst, key(dst), LoopbackTransport(), expiry_s, max_s=max_s, clock=clock,
                    reap_interval_s=3600)              # the test reaps, at the times it sets
    addr = await rx.start()
    tx = KVSender(src, key(src), LoopbackTransport())
    return rx, tx, addr


async def _push(rx, tx, h, tid, start, end):
    """Every layer of blocks [start, end); returns once the receiver wrote them."""
    for layer in range(L):
        await tx.push_layer(h, layer, start, end)
    for _ in range(1000):
        await asyncio.sleep(0)
        if rx.poll(tid).blocks_received >= end * L:
            return
    raise AssertionError(f"blocks [{start}, {end}) not received: {rx.poll(tid)}")


def test_progress_extends_a_live_reservation_past_the_idle_window():
    """Chunks arriving every 8 s keep a 10 s idle window alive for 40 s; the transfer ends
    DONE although it took four idle windows."""
    async def main():
        clock = Clock()
        rx, tx, addr = await _pair(clock, expiry_s=10.0, max_s=300.0)
        t0 = clock.t
        rx.reserve("long", [0, 1, 2, 3, 4])
        assert rx.poll("long").deadline == t0 + 10
        h = await tx.open("long", addr, [5, 6, 7, 8, 9], [0, 1, 2, 3, 4])
        for chunk in range(5):
            clock.t += 8.0
            assert rx.reap() == [], f"expired before chunk {chunk}"
            await _push(rx, tx, h, "long", chunk, chunk + 1)
            if chunk < 4:
                assert rx.poll("long").deadline == clock.t + 10      # moved by the progress
        await tx.finish(h, 5)
        res = await rx.wait("long", 5)
        assert res.state is TransferState.DONE and clock.t - t0 == 40.0 > 10.0
        assert rx.expired == 0
        await tx.close(); await rx.close()
    run(main())


def test_no_progress_for_the_idle_window_expires_it():
    """Progress, then silence: it expires idle_s after the last message, not before."""
    async def main():
        clock = Clock()
        rx, tx, addr = await _pair(clock, expiry_s=10.0, max_s=300.0)
        rx.reserve("stall", [0, 1, 2])
        h = await tx.open("stall", addr, [5, 6, 7], [0, 1, 2])
        clock.t += 7.0
        await _push(rx, tx, h, "stall", 0, 1)
        last = clock.t
        clock.t = last + 9.999
        assert rx.reap() == []
        clock.t = last + 10.0
        assert rx.reap() == ["stall"]
        res = rx.poll("stall")
        assert res.state is TransferState.EXPIRED and "no progress" in res.reason
        assert "within 10s" in res.reason and f"{2 * L} of {3 * L}" in res.reason
        tx.cancel(h)
        await tx.close(); await rx.close()
    run(main())


def test_a_reservation_that_never_starts_expires_after_the_idle_window():
    async def main():
        clock = Clock()
        rx, tx, addr = await _pair(clock, expiry_s=10.0, max_s=300.0)
        rx.reserve("never", [0])
        clock.t += 9.0
        assert rx.reap() == []
        clock.t += 1.0
        assert rx.reap() == ["never"]
        assert "first KV did not arrive within 10s" in rx.poll("never").reason
        await tx.close(); await rx.close()
    run(main())


def test_the_hard_bound_ends_it_even_while_progress_comes():
    """Progress every 5 s against a 10 s window and a 30 s bound: the last extension stops
    at the bound and the reaper expires it there, saying so."""
    async def main():
        clock = Clock()
        rx, tx, addr = await _pair(clock, expiry_s=10.0, max_s=30.0)
        t0 = clock.t
        rx.reserve("bounded", list(range(8)))
        h = await tx.open("bounded", addr, list(range(8, 12)) + list(range(4)), list(range(8)))
        for chunk in range(5):             # at t0 + 5, 10, 15, 20, 25
            clock.t += 5.0
            assert rx.reap() == []
            await _push(rx, tx, h, "bounded", chunk, chunk + 1)
        assert rx.poll("bounded").deadline == t0 + 30.0       # not t0 + 25 + 10
        clock.t = t0 + 29.9
        assert rx.reap() == []
        clock.t = t0 + 30.0
        assert rx.reap() == ["bounded"]
        res = rx.poll("bounded")
        assert res.state is TransferState.EXPIRED and "bound of 30s" in res.reason
        tx.cancel(h)
        await tx.close(); await rx.close()
    run(main())


def test_per_call_windows_and_the_fixed_deadline_without_a_bound():
    """reserve(idle_s, max_s) overrides the receiver's defaults; with no bound anywhere the
    deadline is the idle window and progress cannot move it (the old fixed deadline)."""
    async def main():
        clock = Clock()
        rx, tx, addr = await _pair(clock, expiry_s=10.0)        # no max_s
        t0 = clock.t
        rx.reserve("fixed", [0, 1])
        rx.reserve("own", [2, 3], idle_s=2.0, max_s=50.0)
        h = await tx.open("fixed", addr, [5, 6], [0, 1])
        clock.t += 6.0
        await _push(rx, tx, h, "fixed", 0, 1)
        assert rx.poll("fixed").deadline == t0 + 10.0
        assert rx.reap() == ["own"]                               # 2 s without progress
        clock.t = t0 + 10.0
        assert rx.reap() == ["fixed"]
        tx.cancel(h)
        await tx.close(); await rx.close()
    run(main())


def test_the_prefill_worker_sees_the_receivers_deadline():
    """The prefill worker's view of a reservation (PrefillServicer._deadline) is the
    receiver's own deadline at every push, the bound included: one rule, not two."""
    from types import SimpleNamespace

    from prefill_worker.server import PrefillServicer, _Call

    async def main():
        clock = Clock()
        rx, tx, addr = await _pair(clock, expiry_s=10.0, max_s=30.0)
        t0 = clock.t
        rx.reserve("seen", list(range(8)))
        call = _Call("r", [1], None, None, 0, push=SimpleNamespace(progress_at=0.0),
                     expires=t0 + 10.0, idle_s=10.0, bound=t0 + 30.0)
        assert PrefillServicer._deadline(call) == rx.poll("seen").deadline == t0 + 10.0
        h = await tx.open("seen", addr, list(range(8, 12)) + list(range(4)), list(range(8)))
        for chunk in range(5):             # at t0 + 7, 14, 21, 28, 35 (the last past the bound)
            clock.t += 7.0
            await _push(rx, tx, h, "seen", chunk, chunk + 1)
            call.push.progress_at = clock.t
            assert PrefillServicer._deadline(call) == rx.poll("seen").deadline
        assert PrefillServicer._deadline(call) == t0 + 30.0
        tx.cancel(h)
        await tx.close(); await rx.close()
    run(main())
