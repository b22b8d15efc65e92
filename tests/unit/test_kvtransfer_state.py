"""KVSender/KVReceiver state machine over the in-process LoopbackTransport."""
import asyncio
import threading

import pytest
import torch

from kvtransfer import (CompatKey, IncompatibleKV, KVReceiver, KVSender, LoopbackTransport,
                        TransferState, TransportError)

pytestmark = pytest.mark.timeout(30)

L, NB, BS, H, D = 3, 12, 4, 2, 8


def cache(seed=None, dtype=torch.bfloat16):
    if seed is None:
        return torch.zeros(L, 2, NB, BS, H, D, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, NB, BS, H, D, generator=g).to(dtype)


def key(c, model="tiny"):
    return CompatKey.from_cache(c, model)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def pair(dst_cache=None, src_cache=None, expiry_s=5.0, **kw):
    dst = cache() if dst_cache is None else dst_cache
    src = cache(1) if src_cache is None else src_cache
    rx = KVReceiver(dst, key(dst), LoopbackTransport(), expiry_s, **kw)
    addr = await rx.start()
    tx = KVSender(src, key(src), LoopbackTransport())
    return rx, tx, addr, src, dst


async def settle(rx, tid, state=None):
    """Let the reader task process what was sent (no sleeps: poll the loop)."""
    for _ in range(1000):
        await asyncio.sleep(0)
        r = rx.poll(tid)
        if state is None or (r is not None and r.state is state):
            return r
    raise AssertionError(f"{tid} never reached {state}: {rx.poll(tid)}")


def test_done_copies_exact_blocks_and_counts():
    async def main():
        rx, tx, addr, src, dst = await pair()
        before = dst.clone()
        srcb, dstb = [7, 2, 9], [1, 5, 11]
        rx.reserve("t1", dstb, 5)
        h = await tx.open("t1", addr, srcb, dstb)
        for layer in range(L):
            await tx.push_layer(h, layer)
        stats = await tx.finish(h, 5)
        res = await rx.wait("t1", 5)
        assert res.state is TransferState.DONE and res.blocks_received == L * 3
        assert stats.blocks_sent == L * 3 and stats.messages == L  # one message per layer
        for s, d in zip(srcb, dstb):
            assert torch.equal(dst[:, :, d], src[:, :, s])
        others = [b for b in range(NB) if b not in dstb]
        assert torch.equal(dst[:, :, others], before[:, :, others])
        assert rx.transfers_done == 1 and rx.blocks_received == L * 3
        assert rx.bytes_received == L * 3 * 2 * BS * H * D * 2 == tx.bytes_sent
        await tx.close(); await rx.close()
    run(main())


def test_threadsafe_push_from_engine_thread_and_chunks():
    async def main():
        rx, tx, addr, src, dst = await pair()
        srcb, dstb = list(range(6)), list(range(6, 12))
        rx.reserve("t2", dstb)
        h = await tx.open("t2", addr, srcb, dstb)

        def engine_step():  # chunked prefill: blocks [0,4) then [4,6), each layer by layer
            for start, end in ((0, 4), (4, 6)):
                for layer in range(L):
                    tx.push_layer_threadsafe(h, layer, start, end)
        th = threading.Thread(target=engine_step)
        th.start()
        await asyncio.to_thread(th.join, 5)
        await tx.finish(h, 5)
        assert (await rx.wait("t2", 5)).state is TransferState.DONE
        assert torch.equal(dst[:, :, 6:], src[:, :, :6])
        await tx.close(); await rx.close()
    run(main())


def test_expired_reservation_drops_late_data():
    async def main():
        rx, tx, addr, src, dst = await pair(reap_interval_s=0.01)
        before = dst.clone()
        rx.reserve("late", [3, 4], idle_s=0.05)
        h = await tx.open("late", addr, [0, 1], [3, 4])
        res = await rx.wait("late", 5)
        assert res.state is TransferState.EXPIRED and "missing" in res.reason
        assert rx.expired == 1
        for layer in range(L):
            await tx.push_layer(h, layer)
        await tx.finish(h, 5)
        await settle(rx, "late")
        for _ in range(50):
            await asyncio.sleep(0)
        assert rx.dropped_messages == L
        assert torch.equal(dst, before)  # never written
        assert rx.poll("late").state is TransferState.EXPIRED
        await tx.close(); await rx.close()
    run(main())


def test_abort_mid_transfer_drops_late_data_and_leaves_cache_untouched():
    async def main():
        rx, tx, addr, src, dst = await pair()
        rx.reserve("ab", [2, 3, 4])
        h = await tx.open("ab", addr, [0, 1, 2], [2, 3, 4])
        await tx.push_layer(h, 0)
        await settle(rx, "ab", TransferState.RECEIVING)
        assert torch.equal(dst[0, :, 2:5], src[0, :, 0:3])
        snapshot = dst.clone()
        assert rx.abort("ab") is True
        assert rx.abort("ab") is False
        # the blocks now belong to someone else: write a marker, late layers must not touch it
        dst[:, :, 2:5] = 7
        snapshot[:, :, 2:5] = 7
        for layer in range(1, L):
            await tx.push_layer(h, layer)
        await tx.finish(h, 5)
        for _ in range(50):
            await asyncio.sleep(0)
        assert rx.dropped_messages == L - 1
        assert torch.equal(dst, snapshot)
        res = await rx.wait("ab", 1)
        assert res.state is TransferState.ABORTED and res.blocks_received == 3
        await tx.close(); await rx.close()
    run(main())


def test_unknown_transfer_id_is_dropped():
    async def main():
        rx, tx, addr, src, dst = await pair()
        rx.reserve("ok", [0])
        ok = await tx.open("ok", addr, [5], [0])         # the connection's HELLO names "ok"
        before = dst.clone()
        h = await tx.open("nobody-reserved-this", addr, [0], [0])
        for layer in range(L):
            await tx.push_layer(h, layer)
        await tx.finish(h, 5)
        for _ in range(50):
            await asyncio.sleep(0)
        assert rx.dropped_messages == L and torch.equal(dst, before)
        assert rx.poll("nobody-reserved-this") is None
        # the connection survives: the real transfer still works afterwards
        for layer in range(L):
            await tx.push_layer(ok, layer)
        await tx.finish(ok, 5)
        assert (await rx.wait("ok", 5)).state is TransferState.DONE
        await tx.close(); await rx.close()
    run(main())


def test_hello_without_a_reserved_token_is_rejected():
    async def main():
        rx, tx, addr, src, dst = await pair()
        with pytest.raises(IncompatibleKV, match="bad token"):
            await tx.open("forged-token", addr, [0], [0])
        assert rx.rejected_connections == 1
        await tx.close(); await rx.close()
    run(main())


def test_wrong_block_ids_fail_the_transfer_without_writing():
    async def main():
        rx, tx, addr, src, dst = await pair()
        before = dst.clone()
        rx.reserve("w", [1, 2, 3])
        h = await tx.open("w", addr, [0, 1, 2], [1, 2, 4])   # 4 was never reserved
        await tx.push_layer(h, 0)
        res = await rx.wait("w", 5)
        assert res.state is TransferState.FAILED
        assert "[1, 2, 4]" in res.reason and "[1, 2, 3]" in res.reason
        assert rx.failed == 1
        assert torch.equal(dst, before)
        await tx.close(); await rx.close()
    run(main())


def test_suffix_of_reservation_is_accepted_and_duplicates_fail():
    async def main():
        rx, tx, addr, src, dst = await pair()
        rx.reserve("s", [8, 9, 10])
        h = await tx.open("s", addr, [0, 1, 2], [8, 9, 10])
        await tx.push_layer(h, 0, 1, 3)        # suffix [9, 10]
        await tx.push_layer(h, 0, 0, 1)        # then the head
        await tx.push_layer(h, 1, 0, 3)
        await tx.push_layer(h, 1, 2, 3)        # block 10 of layer 1 twice
        res = await rx.wait("s", 5)
        assert res.state is TransferState.FAILED and "twice" in res.reason
        assert torch.equal(dst[0, :, 8:11], src[0, :, 0:3])
        await tx.close(); await rx.close()
    run(main())


def test_compat_mismatch_names_both_sides_and_receiver_rejects():
    async def main():
        dst = cache()
        src = torch.zeros(L, 2, NB, BS * 2, H, D, dtype=torch.float16)
        rx, tx, addr, _, _ = await pair(dst_cache=dst, src_cache=src)
        with pytest.raises(IncompatibleKV) as e:
            await tx.open("c", addr, [0], [0])
        msg = str(e.value)
        assert "block_size: decode=4 prefill=8" in msg
        assert "dtype: decode='bfloat16' prefill='float16'" in msg
        assert rx.rejected_connections == 1
        await tx.close(); await rx.close()
    run(main())


def test_finish_checks_completeness_and_peer_loss_is_loud():
    async def main():
        rx, tx, addr, src, dst = await pair()
        rx.reserve("p", [0])
        h = await tx.open("p", addr, [0], [0])
        await tx.push_layer(h, 0)
        with pytest.raises(ValueError, match="1 of 3"):
            await tx.finish(h, 1)
        with pytest.raises(TransportError, match="nothing listens"):
            await tx.open("q", "loopback://999999", [0], [0])
        await rx.close()                       # the decode worker goes away
        h2 = None
        for _ in range(100):                   # the watcher notices the closed connection
            await asyncio.sleep(0)
            if tx._peers.get(addr) is None:
                break
        with pytest.raises(TransportError):
            h2 = await tx.open("r", addr, [0], [0])
            for layer in range(L):
                await tx.push_layer(h2, layer)
        assert tx.failures >= 1
        await tx.close()
    run(main())


def test_reserve_validates():
    async def main():
        rx, tx, addr, src, dst = await pair()
        with pytest.raises(ValueError, match="distinct"):
            rx.reserve("v", [1, 1])
        with pytest.raises(ValueError, match="distinct"):
            rx.reserve("v", [NB])
        rx.reserve("v", [1])
        with pytest.raises(ValueError, match="already used"):
            rx.reserve("v", [2])
        with pytest.raises(KeyError):
            await rx.wait("nope", 1)
        with pytest.raises(asyncio.TimeoutError):
            await rx.wait("v", 0.01)
        await tx.close(); await rx.close()
    run(main())


def test_set_source_binds_chunks_but_never_moves_pushed_blocks():
    from kvtransfer.sender import TransferHandle
    h = TransferHandle("t", "ep", [0, 1, 2], [5, 6, 7], None, torch.tensor([0, 1, 2]))
    h.set_source([3, 4])                       # the first chunk's blocks
    assert h.src_block_ids == [3, 4, 2] and h._src_index.tolist() == [3, 4, 2]
    with pytest.raises(ValueError):
        h.set_source([1, 2], start=2)          # past the destination blocks
    h._bound_fixed = 2                         # as after pushing blocks [0, 2)
    with pytest.raises(RuntimeError):
        h.set_source([7], start=1)
    h.set_source([9], start=2)                 # the next chunk's block
    assert h._src_index.tolist() == [3, 4, 9]


def test_staging_mismatch_is_refused_at_the_handshake():
    async def main():
        rx, tx, addr, src, dst = await pair()
        tx.staging = "device"          # what a sender staging in GPU memory says in its HELLO
        with pytest.raises(IncompatibleKV, match="staging: decode='host' prefill='device'"):
            await tx.open("s", addr, [0], [0])
        assert rx.rejected_connections == 1
        await tx.close(); await rx.close()
    run(main())


def test_device_staging_needs_a_cuda_cache():
    with pytest.raises(ValueError, match="CUDA"):
        KVReceiver(cache(), key(cache()), LoopbackTransport(), staging="device")
    with pytest.raises(ValueError, match="one of"):
        KVSender(cache(), key(cache()), LoopbackTransport(), staging="gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side streams need CUDA")
def test_cuda_side_streams_wait_for_the_layer_and_deliver_exactly():
    """CUDA caches, host staging (pinned), loopback: each push is queued while the compute
    stream is still busy writing the layer (a sleep, then the write); the side-stream gather
    must see the written values, in two chunks per layer; the receiver's side-stream writes
    are complete at DONE and every staging buffer is back in its pool."""
    async def main():
        src = cache(1).cuda()
        want = src * 2
        dst = torch.zeros_like(src)
        rx = KVReceiver(dst, key(dst), LoopbackTransport(), 10.0)
        addr = await rx.start()
        tx = KVSender(src, key(src), LoopbackTransport())
        srcb, dstb = [7, 2, 9, 4], [1, 5, 11, 0]
        rx.reserve("c1", dstb, 10)
        h = await tx.open("c1", addr, srcb, dstb)
        for layer in range(L):
            torch.cuda._sleep(2_000_000)          # the layer's kernels are still running ...
            src[layer].mul_(2)                    # ... and write its KV last
            await asyncio.to_thread(tx.push_layer_threadsafe, h, layer, 0, 2)
            await asyncio.to_thread(tx.push_layer_threadsafe, h, layer, 2, 4)
        await tx.finish(h, 10)
        res = await rx.wait("c1", 10)
        assert res.state is TransferState.DONE, res.reason
        assert torch.equal(dst[:, :, dstb], want[:, :, srcb])
        assert tx.pool.pin and rx.pool.pin
        await settle(rx, "c1")
        for _ in range(100):                      # the receiver's last buffers return after their events
            if rx.pool.in_use == 0:
                break
            await asyncio.sleep(0.01)
        assert tx.pool.in_use == 0 and rx.pool.in_use == 0
        await tx.close(); await rx.close()
    run(main())
