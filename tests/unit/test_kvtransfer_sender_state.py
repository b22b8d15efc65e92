"""KVSender's transfer states (kvtransfer/sender.py's diagram) over the in-process
LoopbackTransport, as tests/unit/test_kvtransfer_state.py checks the receiver's:
BOOTSTRAPPING -> WAITING -> TRANSFERRING -> DONE | FAILED, ABORTED from any state not final,
and final states stay final."""
import asyncio
import threading

import pytest
import torch

from kvtransfer import KVTransferTimeout, SendState, TransferState, TransportError
from kvtransfer.sender import TransferHandle
from tests.unit.test_kvtransfer_state import L, pair, run, settle

pytestmark = pytest.mark.timeout(30)


def test_open_waits_the_first_push_transfers_and_finish_is_done():
    async def main():
        rx, tx, addr, src, dst = await pair()
        rx.reserve("t1", [1, 5, 11])
        h = await tx.open("t1", addr, [7, 2, 9], [1, 5, 11])
        assert h.state is SendState.WAITING and not h.cancelled and h.error is None
        await tx.push_layer(h, 0)
        assert h.state is SendState.TRANSFERRING
        for layer in range(1, L):
            await tx.push_layer(h, layer)
        assert h.state is SendState.TRANSFERRING
        stats = await tx.finish(h, 5)
        assert h.state is SendState.DONE and h.error is None and stats.blocks_sent == L * 3
        assert (await rx.wait("t1", 5)).state is TransferState.DONE
        tx.cancel(h)                               # final: stays DONE
        assert h.state is SendState.DONE and not h.cancelled
        await tx.close(); await rx.close()
    run(main())


def test_cancel_mid_transfer_aborts_and_its_queued_messages_are_never_sent():
    async def main():
        rx, tx, addr, src, dst = await pair()
        rx.reserve("ab", [2, 3, 4])
        h = await tx.open("ab", addr, [0, 1, 2], [2, 3, 4])
        await tx.push_layer(h, 0)
        await settle(rx, "ab", TransferState.RECEIVING)
        tx.cancel(h)
        assert h.state is SendState.ABORTED and h.cancelled
        futs = [tx.push_layer_threadsafe(h, layer) for layer in range(1, L)]
        await asyncio.wait([asyncio.wrap_future(f) for f in futs], timeout=5)
        assert all(f.cancelled() for f in futs)     # skipped by the writer, not sent
        for _ in range(50):
            await asyncio.sleep(0)
        r = rx.poll("ab")
        assert r.state is TransferState.RECEIVING and r.blocks_received == 3    # layer 0 only
        assert h.state is SendState.ABORTED         # a push after the abort moves nothing
        tx.cancel(h)
        assert h.state is SendState.ABORTED
        rx.abort("ab")
        await tx.close(); await rx.close()
    run(main())


def test_finish_with_layers_missing_fails_and_stays_failed():
    async def main():
        rx, tx, addr, src, dst = await pair()
        rx.reserve("m", [0])
        h = await tx.open("m", addr, [0], [0])
        with pytest.raises(ValueError, match="0 of 3") as e:
            await tx.finish(h, 1)                   # nothing pushed: from WAITING
        assert h.state is SendState.FAILED and h.error is e.value and h.cancelled
        tx.cancel(h)
        assert h.state is SendState.FAILED and h.error is e.value
        rx.abort("m")
        await tx.close(); await rx.close()
    run(main())


def test_finish_out_of_time_fails_and_skips_what_was_queued():
    async def main():
        rx, tx, addr, src, dst = await pair()
        rx.reserve("slow", [1, 2])
        h = await tx.open("slow", addr, [3, 4], [1, 2])
        for layer in range(L):                      # queued; the writer has not run yet
            tx.push_layer_threadsafe(h, layer)
        assert h.state is SendState.TRANSFERRING
        failures = tx.failures
        with pytest.raises(KVTransferTimeout, match="not finished"):
            await tx.finish(h, 0)
        assert h.state is SendState.FAILED and isinstance(h.error, KVTransferTimeout)
        assert tx.failures == failures + 1
        for _ in range(50):
            await asyncio.sleep(0)
        assert rx.poll("slow").state is TransferState.RESERVED    # nothing was sent
        rx.abort("slow")
        await tx.close(); await rx.close()
    run(main())


def test_a_lost_peer_fails_the_transfer_at_finish():
    async def main():
        rx, tx, addr, src, dst = await pair()
        rx.reserve("p", [0])
        h = await tx.open("p", addr, [0], [0])
        await tx.push_layer(h, 0)
        await rx.close()                            # the decode worker goes away
        for _ in range(100):                        # the watcher notices the closed connection
            await asyncio.sleep(0)
            if tx._peers.get(addr) is None:
                break
        for layer in range(1, L):
            tx.push_layer_threadsafe(h, layer)
        with pytest.raises(TransportError):
            await tx.finish(h, 5)
        assert h.state is SendState.FAILED and isinstance(h.error, TransportError)
        await tx.close()
    run(main())


def test_the_transitions_are_the_drawn_ones_and_final_states_stay_final():
    def handle():
        return TransferHandle("t", "ep", [0], [0], None, torch.tensor([0]))
    h = handle()
    assert h.state is SendState.BOOTSTRAPPING
    with pytest.raises(RuntimeError, match="BOOTSTRAPPING -> TRANSFERRING"):
        h._move(SendState.TRANSFERRING)            # no push before open returned
    with pytest.raises(RuntimeError, match="BOOTSTRAPPING -> DONE"):
        h._move(SendState.DONE)
    e = TransportError("unreachable")
    assert h._move(SendState.FAILED, e) and h.error is e     # open could not connect
    for to in SendState:
        assert h._move(to) is False and h.state is SendState.FAILED
    h = handle()
    assert h._move(SendState.WAITING) and h._move(SendState.TRANSFERRING)
    assert h._move(SendState.TRANSFERRING) is False          # each push: no change
    with pytest.raises(RuntimeError, match="TRANSFERRING -> WAITING"):
        h._move(SendState.WAITING)
    # one winner when the engine thread's push and an abort race
    h = handle()
    h._move(SendState.WAITING)
    won = []
    threads = [threading.Thread(target=lambda s=s: won.append((s, h._move(s))))
               for s in (SendState.ABORTED, SendState.FAILED) * 8]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    winners = [s for s, moved in won if moved]
    assert len(winners) == 1 and h.state is winners[0]
